"""End-to-end tests of the `ddpkit` command line, run as real subprocesses (`python -m ddpkit`).

Multi-process training is expensive on a 2-core machine, so one `ddpkit train --nproc 2
--epochs 2` run (the `run1` fixture) is shared by every test that only reads its outputs; the
resume test works on its own copy of that directory. Bad-input cases start no training at all.
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import shutil

import pytest
import torch
import yaml

import ddpkit
from ddpkit import data as ddpkit_data
from ddpkit import models as ddpkit_models
from ddpkit import strategy as ddpkit_strategy

from .conftest import run_cli

DIGITS_TRAIN, DIGITS_TEST = 1438, 359
RESULT_KEYS = ("test_accuracy", "test_samples", "train_samples", "world_size", "global_batch_size", "epochs",
               "steps", "final_train_loss", "samples_per_second", "wall_seconds", "device", "strategy",
               "precision", "seed", "ddpkit_version", "torch_version")


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _results(out) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line must be JSON


# ---------------------------------------------------------------------------------------------
# run 1: `ddpkit train --nproc 2 --epochs 2 --device cpu --out DIR`, shared by many tests
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    root = tmp_path_factory.mktemp("run1")
    out = root / "out"
    proc = run_cli("train", "--nproc", "2", "--epochs", "2", "--device", "cpu", "--out", str(out), cwd=str(root))
    return out, proc


def test_run1_exits_zero(run1):
    out, proc = run1
    _ok(proc)
    assert "Traceback" not in proc.stderr


def test_run1_results_json(run1):
    out, proc = run1
    _ok(proc)
    r = _results(out)
    missing = [k for k in RESULT_KEYS if k not in r]
    assert not missing, f"results.json lacks {missing}"
    assert r["world_size"] == 2
    assert r["test_samples"] == DIGITS_TEST
    assert r["train_samples"] == DIGITS_TRAIN
    assert r["strategy"] == "ddp"
    assert r["global_batch_size"] == 64
    assert r["epochs"] == 2
    assert r["steps"] == 2 * math.ceil(DIGITS_TRAIN / 64) == 46
    assert r["device"] == "cpu"
    assert r["precision"] == "fp32"
    assert r["seed"] == 0
    assert r["ddpkit_version"] == ddpkit.__version__
    assert r["torch_version"] == torch.__version__
    assert 0.0 <= r["test_accuracy"] <= 1.0
    assert r["test_accuracy"] > 0.5  # two epochs on digits learn far more than chance (0.1)
    assert math.isfinite(r["final_train_loss"]) and r["final_train_loss"] > 0
    assert r["samples_per_second"] > 0
    assert r["wall_seconds"] > 0


def test_run1_metrics_jsonl(run1):
    out, proc = run1
    _ok(proc)
    records = _metrics(out)
    epochs = [r for r in records if r.get("type") == "epoch"]
    steps = [r for r in records if r.get("type") == "step"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert [r["step"] for r in epochs] == [23, 46]
    assert all(r["test_samples"] == DIGITS_TEST for r in epochs)
    assert steps, "no step records"
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)
    assert all(r["step"] % 10 == 0 for r in steps)  # --log-every defaults to 10
    assert all(math.isfinite(r["loss"]) for r in steps)
    # the last epoch record is what results.json reports
    assert epochs[-1]["test_accuracy"] == pytest.approx(_results(out)["test_accuracy"], abs=1e-12)


def test_run1_model_pt_is_a_plain_state_dict_of_the_bare_model(run1):
    out, proc = run1
    _ok(proc)
    state = torch.load(out / "model.pt", weights_only=True, map_location="cpu")
    assert isinstance(state, dict) and state
    prefixed = [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert not prefixed, f"wrapper prefixes in model.pt: {prefixed}"
    model = ddpkit_models.build("cnn", (1, 8, 8), 10)
    model.load_state_dict(state, strict=True)
    model.eval()
    test = ddpkit_data.digits().test
    x, y = test.tensors
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).double().mean().item()
    assert len(y) == DIGITS_TEST
    assert abs(acc - _results(out)["test_accuracy"]) <= 1e-6


def test_run1_curves_png(run1):
    out, proc = run1
    _ok(proc)
    png = (out / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 1000


def test_run1_config_yaml(run1):
    out, proc = run1
    _ok(proc)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["batch_size"] == 64
    assert cfg["epochs"] == 2
    assert cfg["device"] == "cpu"
    assert str(cfg["nproc"]) == "2"


def test_run1_checkpoints(run1):
    out, proc = run1
    _ok(proc)
    names = sorted(os.listdir(out / "checkpoints"))
    assert "step-00000046.pt" in names
    assert not [n for n in names if n.startswith(".tmp")], f"temp files left behind: {names}"
    ckpt = torch.load(out / "checkpoints" / "step-00000046.pt", weights_only=True, map_location="cpu")
    assert ckpt["run"]["epoch"] == 2
    assert ckpt["run"]["step"] == 46


def test_run1_only_rank0_prints(run1):
    out, proc = run1
    _ok(proc)
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("done:") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("epoch   1/2") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("epoch   2/2") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("ddpkit train:") for line in lines) == 1, proc.stdout


# ---------------------------------------------------------------------------------------------
# other training runs (kept few and short)
# ---------------------------------------------------------------------------------------------

def test_resume_auto_continues_to_epoch_3(run1, tmp_path):
    src, proc1 = run1
    _ok(proc1)
    out = tmp_path / "resumed"
    shutil.copytree(src, out)  # run1's own files stay as they were for the other tests
    proc = run_cli("train", "--nproc", "2", "--epochs", "3", "--resume", "auto", "--out", str(out),
                   "--device", "cpu", cwd=str(tmp_path))
    _ok(proc)
    assert "resumed from" in proc.stdout
    r = _results(out)
    assert r["resumed_from_step"] == 46
    assert r["epochs"] == 3
    assert r["steps"] == 69
    assert r["test_samples"] == DIGITS_TEST
    records = _metrics(out)
    epochs = [rec["epoch"] for rec in records if rec.get("type") == "epoch"]
    assert epochs == [1, 2, 3]  # appended, not rewritten
    assert (out / "checkpoints" / "step-00000069.pt").is_file()
    # epochs 1 and 2 were not run again
    assert "epoch   1/3" not in proc.stdout and "epoch   2/3" not in proc.stdout
    assert sum(line.startswith("epoch   3/3") for line in proc.stdout.splitlines()) == 1


def test_resume_after_a_crash_ends_where_the_uninterrupted_run_ends(tmp_path):
    # A 3-epoch run, and the same run "crashed" during epoch 3: its last checkpoint and final
    # outputs gone, and step records of the lost epoch left in metrics.jsonl. Resuming must
    # restore model, optimizer, scheduler, loader position and RNG so the end is bit-identical.
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    _ok(run_cli("train", "--nproc", "2", "--epochs", "3", "--device", "cpu", "--out", str(full), cwd=str(tmp_path)))
    shutil.copytree(full, crashed)
    for name in ("checkpoints/step-00000069.pt", "model.pt", "results.json"):
        (crashed / name).unlink()
    kept = [line for line in (crashed / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] <= 46 or json.loads(line)["type"] == "step"]
    (crashed / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    proc = run_cli("train", "--nproc", "2", "--epochs", "3", "--device", "cpu", "--resume", "auto",
                   "--out", str(crashed), cwd=str(tmp_path))
    _ok(proc)
    a = torch.load(full / "model.pt", weights_only=True)
    b = torch.load(crashed / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _results(crashed)["test_accuracy"] == _results(full)["test_accuracy"]
    assert _results(crashed)["resumed_from_step"] == 46
    steps = [(r["type"], r["step"]) for r in _metrics(crashed)]
    assert steps == [(r["type"], r["step"]) for r in _metrics(full)]  # lost epoch's records not doubled


def test_default_run_reaches_97_percent(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("train", "--nproc", "1", "--device", "cpu", "--out", str(out), cwd=str(tmp_path))
    _ok(proc)
    r = _results(out)
    assert r["epochs"] == 10
    assert r["world_size"] == 1
    assert r["test_samples"] == DIGITS_TEST
    assert r["test_accuracy"] >= 0.97, r


def test_config_file_and_command_line_override(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text("epochs: 1\nbatch-size: 32\nmodel: mlp\n")
    out = tmp_path / "out"
    proc = run_cli("train", "--config", str(config), "--batch-size", "16", "--nproc", "1", "--device", "cpu",
                   "--out", str(out), cwd=str(tmp_path))
    _ok(proc)
    r = _results(out)
    assert r["epochs"] == 1  # from the file
    assert r["model"] == "mlp"  # from the file
    assert r["global_batch_size"] == 16  # the flag beats the file's 32
    assert r["steps"] == math.ceil(DIGITS_TRAIN / 16)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["batch_size"] == 16
    assert cfg["epochs"] == 1
    assert cfg["model"] == "mlp"
    state = torch.load(out / "model.pt", weights_only=True)
    ddpkit_models.build("mlp", (1, 8, 8), 10).load_state_dict(state, strict=True)


def test_strategy_single(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("train", "--strategy", "single", "--nproc", "1", "--epochs", "1", "--device", "cpu",
                   "--out", str(out), cwd=str(tmp_path))
    _ok(proc)
    r = _results(out)
    assert r["strategy"] == "single"
    assert r["world_size"] == 1
    assert r["steps"] == math.ceil(DIGITS_TRAIN / 64)


def test_strategy_dp_on_cpu_runs_as_single(tmp_path):
    # strategy.resolve: 'dp' needs a CUDA device and at least two GPUs; otherwise it is 'single'.
    assert ddpkit_strategy.resolve_name("dp", 1, torch.device("cpu")) == "single"
    out = tmp_path / "out"
    proc = run_cli("train", "--strategy", "dp", "--epochs", "1", "--device", "cpu", "--out", str(out),
                   cwd=str(tmp_path))
    _ok(proc)
    r = _results(out)
    assert r["strategy"] == "single"
    assert r["world_size"] == 1
    assert "DataParallel" not in proc.stderr  # no nn.DataParallel wrapper (and so no warning) on CPU


# ---------------------------------------------------------------------------------------------
# bad input: exit 2, one line on stderr naming the flag or file, no traceback, no --out made
# ---------------------------------------------------------------------------------------------

class _Evil:
    """Unpickling this runs os.system(command): what a code-carrying checkpoint looks like."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _evil_checkpoint(path, marker) -> None:
    torch.save({"model": {"w": torch.zeros(1)}, "payload": _Evil(f"touch {shlex.quote(str(marker))}")}, path)


def _make_input(kind: str, tmp_path, run1) -> str:
    """Create the file a bad-input case points at; returns its path."""
    if kind == "missing.yaml":
        return str(tmp_path / "missing.yaml")
    if kind == "invalid.yaml":
        (tmp_path / kind).write_text("epochs: [1, 2\nlr: 0.1\n")
    elif kind == "list.yaml":
        (tmp_path / kind).write_text("- epochs\n- 1\n")
    elif kind == "unknown-key.yaml":
        (tmp_path / kind).write_text("epochs: 1\nnosuch_option: 3\n")
    elif kind == "wrong-type.yaml":
        (tmp_path / kind).write_text('epochs: "ten"\n')
    elif kind == "missing.pt":
        return str(tmp_path / "missing.pt")
    elif kind == "truncated.pt":
        out, proc = run1
        _ok(proc)
        blob = (out / "checkpoints" / "step-00000046.pt").read_bytes()
        (tmp_path / kind).write_bytes(blob[: len(blob) // 2])
    elif kind.startswith("random-"):  # random-SEED.pt: 4096 bytes from random.Random(SEED)
        seed = int(kind.split("-")[1].split(".")[0])
        (tmp_path / kind).write_bytes(random.Random(seed).randbytes(4096))
    elif kind == "model.pt":  # a readable weights file that is not a training checkpoint
        out, proc = run1
        _ok(proc)
        shutil.copy(out / "model.pt", tmp_path / kind)
    elif kind == "a-file":
        (tmp_path / kind).write_text("not a directory\n")
    elif kind == "cnn-checkpoint.pt":  # a real training checkpoint, of another model
        out, proc = run1
        _ok(proc)
        shutil.copy(out / "checkpoints" / "step-00000046.pt", tmp_path / kind)
    else:
        raise AssertionError(kind)
    return str(tmp_path / kind)


NO_CUDA = not torch.cuda.is_available()


def case(id_, args, kind, needle, marks=()):
    """One bad-input case: `args` with {FILE} for the created input, the input kind (or None),
    and what the stderr line must name (a string or a tuple of strings)."""
    needles = (needle,) if isinstance(needle, str) else tuple(needle)
    return pytest.param(args, kind, needles, id=id_, marks=marks)


BAD_INPUT = [
    case("data", ["train", "--data", "no-such-set"], None, "--data"),
    case("model", ["train", "--model", "nope"], None, "--model"),
    case("strategy", ["train", "--strategy", "nope"], None, "--strategy"),
    case("epochs-0", ["train", "--epochs", "0"], None, "--epochs"),
    case("batch-size-0", ["train", "--batch-size", "0"], None, "--batch-size"),
    case("batch-size-negative", ["train", "--batch-size", "-3"], None, "--batch-size"),
    case("lr-0", ["train", "--lr", "0"], None, "--lr"),
    # NaN passes a naive `value <= 0` check; it must be refused, not trained to chance accuracy.
    case("lr-nan", ["train", "--lr", "nan", "--epochs", "1", "--nproc", "1", "--device", "cpu"], None, "--lr"),
    case("nproc-0", ["train", "--nproc", "0"], None, "--nproc"),
    case("nproc-abc", ["train", "--nproc", "abc"], None, "--nproc"),
    case("device-cuda", ["train", "--device", "cuda"], None, "--device",
         marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible")),
    case("config-missing", ["train", "--config", "{FILE}"], "missing.yaml", "--config"),
    case("config-invalid-yaml", ["train", "--config", "{FILE}"], "invalid.yaml", "--config"),
    case("config-list", ["train", "--config", "{FILE}"], "list.yaml", "--config"),
    case("config-unknown-key", ["train", "--config", "{FILE}"], "unknown-key.yaml", ("--config", "nosuch_option")),
    case("config-wrong-type", ["train", "--config", "{FILE}"], "wrong-type.yaml", ("--config", "epochs", "ten")),
    case("batch-smaller-than-world", ["train", "--batch-size", "1", "--nproc", "2", "--device", "cpu"], None,
         "--batch-size"),
    case("resume-missing", ["train", "--resume", "{FILE}", "--device", "cpu"], "missing.pt", "{FILE}"),
    case("resume-truncated", ["train", "--resume", "{FILE}", "--device", "cpu"], "truncated.pt", "{FILE}"),
    case("resume-random-bytes-seed0", ["train", "--resume", "{FILE}", "--device", "cpu"], "random-0.pt", "{FILE}"),
    # Garbage that makes torch's weights-only unpickler raise IndexError ("pop from empty list").
    case("resume-random-bytes-seed2", ["train", "--resume", "{FILE}", "--device", "cpu"], "random-2.pt", "{FILE}"),
    # ...and KeyError (a memo lookup of an entry never stored).
    case("resume-random-bytes-seed20", ["train", "--resume", "{FILE}", "--device", "cpu"], "random-20.pt", "{FILE}"),
    # A readable weights file that is not a training checkpoint (the run's own model.pt) must be
    # refused before anything starts, not fail inside fit().
    case("resume-not-a-checkpoint", ["train", "--resume", "{FILE}", "--nproc", "1", "--epochs", "1", "--device", "cpu"],
     "model.pt", "{FILE}"),
    # A cnn checkpoint resumed as an mlp: refused up front, naming the model flag.
    case("resume-model-mismatch", ["train", "--resume", "{FILE}", "--model", "mlp", "--nproc", "2", "--device", "cpu"],
         "cnn-checkpoint.pt", ("{FILE}", "--model mlp")),
    case("resume-other-optimizer", ["train", "--resume", "{FILE}", "--optimizer", "adamw", "--device", "cpu"],
         "cnn-checkpoint.pt", ("{FILE}", "--optimizer adamw")),
    case("resume-nothing-left", ["train", "--resume", "{FILE}", "--epochs", "2", "--device", "cpu"],
         "cnn-checkpoint.pt", ("{FILE}", "--epochs")),
    case("resume-auto-without-out", ["train", "--resume", "auto"], None, "--out", marks=pytest.mark.no_out),
    case("out-is-a-file", ["train", "--device", "cpu", "--out", "{FILE}"], "a-file", "--out",
         marks=pytest.mark.no_out),
    case("lenet-on-tiny-images", ["train", "--data", "synthetic", "--synthetic-shape", "3,2,2", "--model", "lenet"],
         None, "--model"),
    case("sync-batchnorm-on-cpu", ["train", "--sync-batchnorm", "true", "--device", "cpu"], None, "--sync-batchnorm"),
    case("micro-batch-size-0", ["train", "--micro-batch-size", "0"], None, "--micro-batch-size"),
    case("lr-scaling-unknown", ["train", "--lr-scaling", "cubic"], None, "--lr-scaling"),
    case("unknown-command", ["nosuch"], None, "nosuch"),
]


@pytest.mark.parametrize("args, kind, needles", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(args, kind, needles, tmp_path, request):
    if kind is not None:
        run1 = request.getfixturevalue("run1") if kind in ("truncated.pt", "model.pt", "cnn-checkpoint.pt") else None
        path = _make_input(kind, tmp_path, run1)
        args = [a.replace("{FILE}", path) for a in args]
        needles = tuple(n.replace("{FILE}", path) for n in needles)
    # Cases marked no_out bring their own --out (or must go without): then nothing may appear
    # in the working directory, where the default runs/ folder would go.
    own_out = request.node.get_closest_marker("no_out") is not None
    out = tmp_path / ("runs" if own_out else "out")
    proc = run_cli(*args, *([] if own_out else ["--out", str(out)]), cwd=str(tmp_path))
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not named in: {lines[0]}"
    assert not out.exists(), "--out was created although the input was rejected"


def test_malicious_checkpoint_is_refused_without_running_its_code(tmp_path):
    # First prove the payload is live: an unsafe load of a twin file does run it.
    twin, twin_marker = tmp_path / "twin.pt", tmp_path / "twin-ran"
    _evil_checkpoint(twin, twin_marker)
    torch.load(twin, weights_only=False)
    assert twin_marker.exists(), "test setup: the malicious pickle did not run its payload"

    evil, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    _evil_checkpoint(evil, marker)
    out = tmp_path / "out"
    for nproc in ("1", "2"):
        proc = run_cli("train", "--resume", str(evil), "--nproc", nproc, "--device", "cpu", "--out", str(out),
                       cwd=str(tmp_path))
        assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        assert not marker.exists(), "loading the checkpoint ran code from it"
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(evil) in lines[0], proc.stderr
        assert not out.exists()


# ---------------------------------------------------------------------------------------------
# env, --version, --help
# ---------------------------------------------------------------------------------------------

def test_env_text(cli, tmp_path):
    proc = cli("env", cwd=str(tmp_path))
    _ok(proc)
    assert "PyTorch" in proc.stdout
    assert torch.__version__ in proc.stdout


def test_env_json(cli, tmp_path):
    proc = cli("env", "--json", cwd=str(tmp_path))
    _ok(proc)
    r = json.loads(proc.stdout)
    for key in ("torch", "cuda", "gpus", "cpu", "distributed_backends", "train_defaults"):
        assert key in r, key
    assert r["distributed_backends"]["gloo"] is True
    assert r["torch"]["version"] == torch.__version__
    assert r["cuda"]["available"] == torch.cuda.is_available()
    assert isinstance(r["gpus"], list) and len(r["gpus"]) == torch.cuda.device_count()


def test_version(cli, tmp_path):
    proc = cli("--version", cwd=str(tmp_path))
    _ok(proc)
    assert ddpkit.__version__ in proc.stdout


def test_train_help(cli, tmp_path):
    proc = cli("train", "--help", cwd=str(tmp_path))
    _ok(proc)
    assert "--batch-size" in proc.stdout
    assert "GLOBAL" in proc.stdout
    assert not os.listdir(tmp_path), "--help wrote files"
