"""Logging from your own loop: `rt.log` writes one record per call, from rank 0 only, to
metrics.jsonl, metrics.csv (widened when a new key appears) and the trackers asked for, whose
real stores are read back here (MLflow's client, TensorBoard's reader, W&B's own log reader);
`rt.progress` is rank 0's bar; bad input is one UsageError."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.errors import UsageError
from ddpkit.observe.tracking import Tracking
from tests.workers import toy_data

TRACKER_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT")
STEPS = (1, 2, 3, 4)


@pytest.fixture
def local_trackers(monkeypatch):
    """No tracker variable of the caller's: every store is the local one in the run directory."""
    for name in TRACKER_VARS:
        monkeypatch.delenv(name, raising=False)


def log_steps(log_dir: str) -> dict:
    """Each rank logs four steps of a loss all ranks agree on (all-reduced: step + 0.5), with
    `acc` from step 3 on, then walks a loader through `rt.progress`; returns what it saw."""
    trackers = ["tensorboard", "mlflow", "wandb"]
    with ddpkit.Runtime(device="cpu", log_dir=log_dir, log_with=trackers) as rt:
        rt.log_params(lr=0.1, model="toy", widths=[16, 3])
        for step in STEPS:
            loss = rt.all_reduce(torch.tensor(float(step + rt.rank)), op="mean")
            rt.log(step, loss=loss, **({"acc": step / 10} if step >= 3 else {}))
        stream = io.StringIO()
        loader = rt.loader(toy_data(24), batch_size=8)
        bar = rt.progress(loader, file=stream, disable=False)
        seen = sum(1 for _ in bar)
        return {"passed_through": bar is loader, "len": len(bar), "batches": seen, "bar": stream.getvalue()}


EXPECTED = [
    {"step": 1, "loss": 1.5},
    {"step": 2, "loss": 2.5},
    {"step": 3, "loss": 3.5, "acc": 0.3},
    {"step": 4, "loss": 4.5, "acc": 0.4},
]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")  # SQLAlchemy 2.1 on MLflow's store
def test_rt_log_on_two_processes_reads_back_from_every_sink(tmp_path, local_trackers):
    run = tmp_path / "run"
    seen = ddpkit.launch(log_steps, str(run), nproc=2, device="cpu")
    # rank 0's bar went through every batch of its share; rank 1 got the loader itself
    assert not seen[0]["passed_through"] and seen[1]["passed_through"] and seen[1]["bar"] == ""
    assert seen[0]["len"] == seen[0]["batches"] == seen[1]["len"] == 3
    assert "3/3" in seen[0]["bar"]
    # one writer: each record once, in order; the csv widened when acc appeared
    assert [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] == EXPECTED
    with open(run / "metrics.csv", newline="") as f:
        assert list(csv.reader(f)) == [
            ["step", "loss", "acc"],
            ["1", "1.5", ""],
            ["2", "2.5", ""],
            ["3", "3.5", "0.3"],
            ["4", "4.5", "0.4"],
        ]
    assert json.loads((run / "params.json").read_text()) == {"lr": 0.1, "model": "toy", "widths": [16, 3]}
    _check_mlflow(run)
    _check_tensorboard(run)
    _check_wandb(run)


def _check_mlflow(run: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run}/mlflow/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("ddpkit").experiment_id])
    assert len(runs) == 1  # rank 1 made none
    found = runs[0]
    assert found.info.run_id == json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params == {"lr": "0.1", "model": "toy", "widths": "[16, 3]"}
    for key in ("loss", "acc"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        assert history == [(r["step"], r[key]) for r in EXPECTED if key in r]


def _check_tensorboard(run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((run / "tensorboard").iterdir())) == 1  # one event file: one writer
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key in ("loss", "acc"):
        scalars = [(e.step, e.value) for e in events.Scalars(key)]
        assert scalars == [(r["step"], pytest.approx(r[key])) for r in EXPECTED if key in r]


def _check_wandb(run: Path) -> None:
    (offline,) = (run / "wandb").glob("offline-run-*")  # one run, offline: no network was needed
    records = wandb_records(offline)
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [(h["step"]["num"], h["item"]["loss"], h["item"].get("acc")) for h in history] == [
        (r["step"], r["loss"], r.get("acc")) for r in EXPECTED
    ]
    config = {}
    for r in records:
        config.update(r.get("run", {}).get("config", {}).get("update", {}))
        config.update(r.get("config", {}).get("update", {}))
    assert {k: config[k] for k in ("lr", "model", "widths")} == {"lr": 0.1, "model": "toy", "widths": [16, 3]}


def wandb_records(offline_run: Path) -> list[dict]:
    """The records of an offline W&B run, read by W&B's own reader (`wandb leet inspect --json`)."""
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    proc = subprocess.run([wandb, "leet", "inspect", "--json", str(offline_run)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"log_dir": "x", "log_with": ["neptune"]},
            r"unknown tracker 'neptune'; choose from tensorboard, mlflow, wandb",
        ),
        ({"log_dir": "x", "log_with": "tensorbord"}, r"unknown tracker 'tensorbord'"),  # a string is one name
        ({"log_with": ["tensorboard"]}, r"log_with=\.\.\.\) needs log_dir="),
    ],
)
def test_bad_trackers_are_usage_errors(tmp_path, monkeypatch, kwargs, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=message):
        ddpkit.Runtime(device="cpu", **kwargs)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.unit
@pytest.mark.parametrize(
    "tracker,module", [("wandb", "wandb"), ("mlflow", "sqlalchemy"), ("tensorboard", "tensorboard")]
)
def test_a_tracker_not_installed_says_what_to_install(tmp_path, monkeypatch, tracker, module):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # find_spec sees the package as absent
    with pytest.raises(UsageError) as err:
        ddpkit.Runtime(device="cpu", log_dir=tmp_path / "run", log_with=[tracker])
    assert (
        str(err.value) == f"Runtime(log_with=['{tracker}']) needs the {module} package: pip install 'ddpkit[{tracker}]'"
    )


@pytest.mark.unit
def test_bad_log_calls_are_usage_errors(tmp_path):
    with ddpkit.Runtime(device="cpu") as rt:
        with pytest.raises(UsageError, match=r"^rt\.log needs Runtime\(log_dir=\.\.\.\)"):
            rt.log(1, loss=1.0)
        with pytest.raises(UsageError, match=r"^rt\.log_params needs Runtime\(log_dir=\.\.\.\)"):
            rt.log_params(lr=0.1)
    with ddpkit.Runtime(device="cpu", log_dir=tmp_path) as rt:
        for step, metrics, message in [
            (-1, {}, "step must be an integer >= 0, got -1"),
            (1.5, {}, "step must be an integer >= 0, got 1.5"),
            (True, {}, "step must be an integer >= 0, got True"),
            (1, {"loss": torch.ones(2)}, r"loss must be a number or a one-element tensor, got Tensor of shape \(2,\)"),
            (1, {"loss": [1.0]}, "loss must be a number or a one-element tensor, got list"),
        ]:
            with pytest.raises(UsageError, match=message):
                rt.log(step, **metrics)
        rt.log(torch.tensor(3), loss=torch.tensor([0.25]), note="ok", nan=math.nan)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "loss": 0.25, "note": "ok", "nan": None}


@pytest.mark.unit
def test_csv_columns_widen_and_keep_earlier_rows(tmp_path):
    sinks = Tracking(tmp_path)
    sinks.log({"step": 1, "loss": 2.0})
    sinks.log({"step": 2, "loss": 1.0, "lr": 0.1})  # a new key: the file is rewritten wider
    sinks.log({"step": 3, "lr": math.inf})
    sinks.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "loss", "lr"], ["1", "2.0", ""], ["2", "1.0", "0.1"], ["3", "", ""]]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # every rewrite renamed into place


@pytest.mark.unit
def test_progress_on_one_process_is_a_bar_of_the_iterables_length():
    with ddpkit.Runtime(device="cpu") as rt:
        stream = io.StringIO()
        bar = rt.progress(range(5), file=stream, desc="epoch 1")
        assert len(bar) == 5 and list(bar) == [0, 1, 2, 3, 4]
        assert stream.getvalue() == ""  # not a terminal: no bar unless disable=False
        bar = rt.progress(range(5), file=stream, disable=False, desc="epoch 1")
        assert list(bar) == [0, 1, 2, 3, 4] and "epoch 1: 100%" in stream.getvalue()
