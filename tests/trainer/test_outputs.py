"""`outputs`: metrics.csv agrees with metrics.jsonl (also after a resume), TensorBoard event
files, an MLflow run that a resumed run continues, one summary table from rank 0, and
only the newest checkpoints kept."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.conftest import HAVE_TENSORBOARD
from tests.test_tracking import TRACKER_VARS
from tests.trainer.helpers import train


def _epochs(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "epoch"]


@pytest.mark.unit
def test_resume_rewrites_csv_from_kept_records(tmp_path):
    from ddpkit.trainer import TrainConfig
    from ddpkit.trainer.outputs import Outputs

    cfg = TrainConfig(epochs=3, out=str(tmp_path))
    epoch = {
        "type": "epoch",
        "train_loss": 1.0,
        "train_accuracy": 0.5,
        "test_loss": 1.0,
        "test_accuracy": 0.5,
        "test_samples": 10,
        "epoch_seconds": 0.1,
        "lr": 0.01,
    }
    with Outputs(cfg, True) as out:
        for e in (1, 2, 3):
            out.log(
                {"type": "step", "epoch": e, "step": 10 * e - 5, "loss": 1.0, "lr": 0.01, "samples_per_second": 1.0}
            )
            out.log({**epoch, "epoch": e, "step": 10 * e})
    with Outputs(cfg, True, resumed_step=(20, 2)):  # back to the checkpoint after epoch 2
        pass
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2]
    assert [r["epoch"] for r in _epochs(tmp_path)] == [1, 2]


@pytest.mark.cli
@pytest.mark.slow
def test_metrics_csv_equals_epoch_records(runs):
    _, (a, _), (b, _) = runs
    for run_dir, epochs in ((a, 2), (b, 10)):
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        records = _epochs(run_dir)
        assert len(rows) == len(records) == epochs
        for row, record in zip(rows, records):
            assert set(row) >= {"epoch", "step", "train_loss", "test_accuracy", "lr"}
            for key, value in row.items():
                assert float(value) == pytest.approx(record[key], rel=1e-12), key


@pytest.mark.cli
@pytest.mark.slow
def test_summary_table_once_from_rank0(runs):
    _, (_, proc_a), (_, proc_b) = runs
    for proc in (proc_a, proc_b):
        lines = proc.stdout.splitlines()
        assert sum(ln.startswith("done:") for ln in lines) == 1, proc.stdout
        for label in ("test accuracy", "train loss", "samples/s", "step time", "peak RSS", "wall time"):
            assert sum(ln.strip().startswith(label) for ln in lines) == 1, (label, proc.stdout)
    assert "MiB per rank" in proc_a.stdout and " / " in proc_a.stdout  # both ranks' memory


@pytest.mark.cli
@pytest.mark.slow
def test_tensorboard_event_files(runs):
    # a test dependency: missing, it fails this test rather than skip it
    assert HAVE_TENSORBOARD, "tensorboard is not installed: pip install -e '.[test]'"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, (a, _), (b, _) = runs
    assert not (b / "tensorboard").exists()  # only with --tensorboard
    acc = EventAccumulator(str(a / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_second", "epoch/test_accuracy", "epoch/train_loss"} <= tags
    test_acc = [(e.step, e.value) for e in acc.Scalars("epoch/test_accuracy")]
    assert test_acc == [(r["step"], pytest.approx(r["test_accuracy"], rel=1e-6)) for r in _epochs(a)]


@pytest.mark.cli
def test_tensorboard_missing_is_one_line(tmp_path):
    # sys.modules[name] = None makes find_spec (and import) see the package as absent.
    code = (
        "import sys; sys.modules['tensorboard'] = None; from ddpkit.cli import main; "
        f"sys.exit(main(['train', '--epochs', '1', '--device', 'cpu', '--tensorboard', '--out', {str(tmp_path / 'r')!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddpkit train: error: --tensorboard needs the tensorboard package: pip install 'ddpkit[tensorboard]'"
    ]
    assert not (tmp_path / "r").exists()


@pytest.mark.unit
@pytest.mark.parametrize("tracker,module", [("mlflow", "mlflow"), ("mlflow", "alembic"), ("wandb", "wandb")])
def test_a_tracker_flag_without_its_package_is_one_line(monkeypatch, tracker, module):
    from ddpkit.errors import UsageError
    from ddpkit.trainer import TrainConfig, resolve

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # find_spec sees the package as absent
    with pytest.raises(UsageError) as err:
        resolve(TrainConfig(device="cpu", **{tracker: True}))
    assert str(err.value) == f"--{tracker} needs the {module} package: pip install 'ddpkit[{tracker}]'"


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")  # SQLAlchemy 2.1 on MLflow's store
def test_the_mlflow_run_reads_back_and_a_resume_continues_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    for name in TRACKER_VARS:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    # 2 epochs of 5 steps on the 5 toy samples: a step record every step, an epoch record at 5 and 10
    flags = ("--nproc", "1", "--data", "toy", "--model", "mlp", "--batch-size", "1", "--log-every", "1")
    train(out, *flags, "--mlflow", "--max-steps", "3")  # stops (with a checkpoint) at step 3
    first = json.loads((out / "trackers.json").read_text())
    train(out, *flags, "--mlflow", "--resume", "auto")
    assert json.loads((out / "trackers.json").read_text()) == first  # the same run, continued
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [r["step"] for r in steps] == list(range(1, 11)) and [r["step"] for r in epochs] == [5, 10]
    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ddpkit").experiment_id])
    assert run.info.run_id == first["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name == "out"
    assert run.data.params["lr"] == "0.05" and run.data.params["mlflow"] == "true"
    assert run.data.params["resume"] == "null"  # a param keeps its first value in MLflow

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    assert sorted(history("train/loss")) == [(r["step"], r["loss"]) for r in steps]  # steps 1 ... 10
    assert sorted(history("epoch/test_accuracy")) == [(r["step"], r["test_accuracy"]) for r in epochs]


@pytest.mark.cli
def test_keep_checkpoints_and_checkpoint_every(three_checkpoints):
    # --epochs 1 --checkpoint-every 5 --keep-checkpoints 3 (tests/trainer/conftest.py): steps 5,
    # 10, 15, 20 and the epoch end at 23 were written; the newest three remain
    names = sorted(p.name for p in (three_checkpoints / "checkpoints").iterdir())
    assert names == ["step-00000015.pt", "step-00000020.pt", "step-00000023.pt"]


@pytest.mark.unit
def test_metrics_hold_null_for_nonfinite_numbers_also_after_a_resume(tmp_path):
    # A diverging run under --on-nonfinite skip logs NaN losses: strict JSON parsers reject NaN.
    from ddpkit.trainer import TrainConfig
    from ddpkit.trainer.outputs import Outputs

    def strict(line):
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))

    cfg = TrainConfig(epochs=2, out=str(tmp_path))
    nan, inf = float("nan"), float("inf")
    epoch = {"type": "epoch", "train_loss": inf, "train_accuracy": 0.5, "test_loss": nan, "test_accuracy": 0.1}
    with Outputs(cfg, True) as out:
        out.log({"type": "step", "epoch": 1, "step": 5, "loss": nan, "lr": 0.1, "samples_per_second": 1.0})
        out.log({**epoch, "epoch": 1, "step": 10})
        out.log({**epoch, "epoch": 2, "step": 20})
    with Outputs(cfg, True, resumed_step=(10, 1)):  # rewrites the kept records
        pass
    records = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] is None and records[1]["test_loss"] is None and records[1]["train_loss"] is None
    assert len(records) == 2 and records[1]["test_accuracy"] == 0.1
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], r["train_loss"], r["test_loss"]) for r in rows] == [("1", "", "")]
