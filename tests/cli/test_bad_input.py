"""Bad input to `ddpkit train`: exit 2, one line on stderr naming the flag or file, no traceback,
no --out made, and no code run from a malicious checkpoint. No training starts, except the
shared `run1` (tests/cli/conftest.py) whose files some cases point at.

The cases run in one helper interpreter (tests/cli/argv_runner.py: `ddpkit.cli.main` with file
descriptors 1 and 2 captured, each case in a directory of its own), as the bad-flag table does:
they all end before any worker starts, and a process per case would spend its time importing
torch. `test_runner_agrees_with_the_command` compares a case with a real `python -m ddpkit`;
the malicious checkpoint is refused by real processes."""

from __future__ import annotations

import os
import random
import shlex
import shutil

import pytest
import torch

from tests.cli.argv_runner import run_batch
from tests.cli.helpers import ok
from tests.conftest import run_cli

pytestmark = pytest.mark.cli


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
        ok(proc)
        blob = (out / "checkpoints" / "step-00000046.pt").read_bytes()
        (tmp_path / kind).write_bytes(blob[: len(blob) // 2])
    elif kind.startswith("random-"):  # random-SEED.pt: 4096 bytes from random.Random(SEED)
        seed = int(kind.split("-")[1].split(".")[0])
        (tmp_path / kind).write_bytes(random.Random(seed).randbytes(4096))
    elif kind == "model.pt":  # a readable weights file that is not a training checkpoint
        out, proc = run1
        ok(proc)
        shutil.copy(out / "model.pt", tmp_path / kind)
    elif kind == "a-file":
        (tmp_path / kind).write_text("not a directory\n")
    elif kind == "cnn-checkpoint.pt":  # a real training checkpoint, of another model
        out, proc = run1
        ok(proc)
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
    case(
        "device-cuda",
        ["train", "--device", "cuda"],
        None,
        "--device",
        marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible"),
    ),
    case("config-missing", ["train", "--config", "{FILE}"], "missing.yaml", "--config"),
    case("config-invalid-yaml", ["train", "--config", "{FILE}"], "invalid.yaml", "--config"),
    case("config-list", ["train", "--config", "{FILE}"], "list.yaml", "--config"),
    case("config-unknown-key", ["train", "--config", "{FILE}"], "unknown-key.yaml", ("--config", "nosuch_option")),
    case("config-wrong-type", ["train", "--config", "{FILE}"], "wrong-type.yaml", ("--config", "epochs", "ten")),
    case(
        "batch-smaller-than-world",
        ["train", "--batch-size", "1", "--nproc", "2", "--device", "cpu"],
        None,
        "--batch-size",
    ),
    case("resume-missing", ["train", "--resume", "{FILE}", "--device", "cpu"], "missing.pt", "{FILE}"),
    case("resume-truncated", ["train", "--resume", "{FILE}", "--device", "cpu"], "truncated.pt", "{FILE}"),
    case("resume-random-bytes-seed0", ["train", "--resume", "{FILE}", "--device", "cpu"], "random-0.pt", "{FILE}"),
    # Garbage that makes torch's weights-only unpickler raise IndexError ("pop from empty list").
    case("resume-random-bytes-seed2", ["train", "--resume", "{FILE}", "--device", "cpu"], "random-2.pt", "{FILE}"),
    # ...and KeyError (a memo lookup of an entry never stored).
    case("resume-random-bytes-seed20", ["train", "--resume", "{FILE}", "--device", "cpu"], "random-20.pt", "{FILE}"),
    # A readable weights file that is not a training checkpoint (the run's own model.pt) must be
    # refused before anything starts, not fail inside fit().
    case(
        "resume-not-a-checkpoint",
        ["train", "--resume", "{FILE}", "--nproc", "1", "--epochs", "1", "--device", "cpu"],
        "model.pt",
        "{FILE}",
    ),
    # A cnn checkpoint resumed as an mlp: refused up front, naming the model flag.
    case(
        "resume-model-mismatch",
        ["train", "--resume", "{FILE}", "--model", "mlp", "--nproc", "2", "--device", "cpu"],
        "cnn-checkpoint.pt",
        ("{FILE}", "--model mlp"),
    ),
    case(
        "resume-other-optimizer",
        ["train", "--resume", "{FILE}", "--optimizer", "adamw", "--device", "cpu"],
        "cnn-checkpoint.pt",
        ("{FILE}", "--optimizer adamw"),
    ),
    case(
        "resume-nothing-left",
        ["train", "--resume", "{FILE}", "--epochs", "2", "--device", "cpu"],
        "cnn-checkpoint.pt",
        ("{FILE}", "--epochs"),
    ),
    case("resume-auto-without-out", ["train", "--resume", "auto"], None, "--out", marks=pytest.mark.no_out),
    case("out-is-a-file", ["train", "--device", "cpu", "--out", "{FILE}"], "a-file", "--out", marks=pytest.mark.no_out),
    case(
        "lenet-on-tiny-images",
        ["train", "--data", "synthetic", "--synthetic-shape", "3,2,2", "--model", "lenet"],
        None,
        "--model",
    ),
    case("sync-batchnorm-on-cpu", ["train", "--sync-batchnorm", "true", "--device", "cpu"], None, "--sync-batchnorm"),
    case("micro-batch-size-0", ["train", "--micro-batch-size", "0"], None, "--micro-batch-size"),
    case("lr-scaling-unknown", ["train", "--lr-scaling", "cubic"], None, "--lr-scaling"),
    case("unknown-command", ["nosuch"], None, "nosuch"),
]


SPEED_FLAGS = [
    pytest.param(flags, needle, id=id_)
    for id_, flags, needle in [
        ("augment-non-image", ("--augment", "crop-flip", "--model", "mlp", "--data", "synthetic", "--synthetic-shape", "20"), "--augment"),
        ("comm-hook", ("--comm-hook", "int8"), "--comm-hook"),
        ("bf16-hook-on-cpu", ("--comm-hook", "bf16", "--device", "cpu"), "--comm-hook bf16 needs CUDA"),
        ("label-smoothing", ("--label-smoothing", "1.5"), "--label-smoothing"),
        ("loader", ("--loader", "disk"), "--loader"),
        ("bucket", ("--bucket-cap-mb", "0"), "--bucket-cap-mb"),
    ]
]  # fmt: skip


def _skipped(param) -> bool:
    return any(m.name == "skipif" and m.args[0] for m in param.marks)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, run1) -> dict[str, dict]:
    """Every case of BAD_INPUT and SPEED_FLAGS run in one helper interpreter, each in an empty
    directory of its own holding the file it points at: id -> its argv, the needles with {FILE}
    filled in, its exit code, stdout and stderr, and the --out it must not have made."""
    root, items = tmp_path_factory.mktemp("cases"), []
    for param in (p for p in BAD_INPUT if not _skipped(p)):
        (args, kind, needles), cwd = param.values, root / param.id
        cwd.mkdir()
        if kind is not None:
            path = _make_input(kind, cwd, run1)
            args = [a.replace("{FILE}", path) for a in args]
            needles = tuple(n.replace("{FILE}", path) for n in needles)
        # Cases marked no_out bring their own --out (or must go without): then nothing may appear
        # in the working directory, where the default runs/ folder would go.
        own_out = any(m.name == "no_out" for m in param.marks)
        out = cwd / ("runs" if own_out else "out")
        items.append({"id": param.id, "argv": [*args, *([] if own_out else ["--out", str(out)])], "cwd": str(cwd)})
        items[-1].update(needles=needles, out=str(out))
    for param in SPEED_FLAGS:
        (flags, needle), cwd = param.values, root / f"speed-{param.id}"
        cwd.mkdir()
        out = str(cwd / "o")
        items.append({"id": f"speed-{param.id}", "argv": ["train", "--out", out, *flags], "cwd": str(cwd)})
        items[-1].update(needles=(needle,), out=out)
    results = run_batch([{"argv": i["argv"], "cwd": i["cwd"]} for i in items])
    return {i["id"]: {**i, **r} for i, r in zip(items, results)}


def _exits_2_with_one_line(r: dict) -> str:
    """The one line `r` wrote on stderr, once it is known to have exited 2 without a traceback."""
    shown = f"ddpkit {' '.join(r['argv'])}\nexit {r['code']}\nstdout:\n{r['stdout']}\nstderr:\n{r['stderr']}"
    assert r["code"] == 2, shown
    assert "Traceback" not in r["stderr"] and "Traceback" not in r["stdout"], shown
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{r['stderr']}"
    return lines[0]


@pytest.mark.parametrize("args, kind, needles", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(args, kind, needles, outcomes, request):
    r = outcomes[request.node.callspec.id]
    line = _exits_2_with_one_line(r)
    for needle in r["needles"]:
        assert needle in line, f"{needle!r} not named in: {line}"
    assert not os.path.exists(r["out"]), "--out was created although the input was rejected"


def test_runner_agrees_with_the_command(outcomes):
    """A case run by the helper interpreter exits as a real `python -m ddpkit` process does."""
    r = outcomes["resume-truncated"]
    real = run_cli(*r["argv"], cwd=r["cwd"])
    assert (r["code"], r["stderr"], r["stdout"]) == (real.returncode, real.stderr, real.stdout)
    assert r["code"] == 2 and "truncated.pt" in r["stderr"]


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
        proc = run_cli(
            "train", "--resume", str(evil), "--nproc", nproc, "--device", "cpu", "--out", str(out), cwd=str(tmp_path)
        )
        assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        assert not marker.exists(), "loading the checkpoint ran code from it"
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(evil) in lines[0], proc.stderr
        assert not out.exists()


@pytest.mark.parametrize("flags,needle", SPEED_FLAGS)
def test_bad_speed_flags_exit_2_with_one_line(outcomes, request, flags, needle):
    r = outcomes[f"speed-{request.node.callspec.id}"]
    line = _exits_2_with_one_line(r)
    assert needle in line, line
    assert not os.path.exists(r["out"])


@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("value", ["0", "abc", "-2"])
def test_a_thread_count_that_is_no_count_is_one_line_and_exit_2(tmp_path, command, value):
    # kept, OpenMP would ignore it and every process take all the cores: many times slower
    args = ["--out", str(tmp_path / "out")] if command == "train" else [str(tmp_path / "script.py")]
    proc = run_cli(command, *args, env={"OMP_NUM_THREADS": value}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"ddpkit {command}: error: OMP_NUM_THREADS='{value}': not a positive whole number of threads per "
        "process; unset it (ddpkit gives each process its share of the cores) or set a count such as 1"
    ]
    assert not (tmp_path / "out").exists()


def test_a_thread_mode_that_is_no_mode_is_one_line_and_exit_2(tmp_path):
    # a typo of DDPKIT_THREADS=share was the default, without a word
    proc = run_cli("train", "--out", str(tmp_path / "out"), env={"DDPKIT_THREADS": "shared"}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "ddpkit train: error: DDPKIT_THREADS='shared': 'share' (each process its share of the cores, whatever "
        "the load) or unset (ddpkit also leaves out the cores other programs keep busy)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "env,said",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=0 WORLD_SIZE=2 are set, describing a job of 2"),
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_PORT": "29511"}, "RANK=3 WORLD_SIZE=2: the rank is not one of"),
    ],
)
def test_launcher_variables_of_a_job_that_is_not_there_are_one_line_and_exit_2(tmp_path, env, said):
    # left set by hand, they made the run wait for peers that never come, until --timeout
    proc = run_cli("train", "--out", str(tmp_path / "out"), env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddpkit train: error: {said}"), lines
    assert not (tmp_path / "out").exists()


def test_a_model_and_data_that_do_not_go_together_are_one_and_the_same_line_in_every_command(tmp_path):
    # train, find-batch-size and plan each take --model and --data: the same check, the same line
    pairs = {
        ("gpt", "digits"): "--model gpt is a language model of bytes: use it with --data text",
        ("cnn", "text"): "--data text is byte sequences for a language model: use --model gpt, not cnn",
    }
    cases = []
    for command, where in (("train", ["--device", "cpu"]), ("find-batch-size", ["--device", "cpu"]), ("plan", [])):
        for (model, name), said in pairs.items():
            cwd = tmp_path / f"{command}-{model}"
            cwd.mkdir()
            cases.append(({"argv": [command, "--model", model, "--data", name, *where], "cwd": str(cwd)}, said))
    for (case, said), r in zip(cases, run_batch([c for c, _ in cases])):
        line = _exits_2_with_one_line({**r, "argv": case["argv"]})
        assert line.endswith(said), (case["argv"], line)
        assert not os.listdir(case["cwd"]), (case["argv"], os.listdir(case["cwd"]))  # no runs/ or plan files


# A flag that acts on one model or dataset only, given with another: it would change nothing.
FLAGS_ELSEWHERE = [
    (["--model", "cnn", "--gpt-width", "64"], "--gpt-width applies to --model gpt only (this run has --model cnn)"),
    (["--model", "mlp", "--gpt-style", "llama"], "--gpt-style applies to --model gpt only (this run has --model mlp)"),
    (["--model", "cnn", "--gpt-heads", "2"], "--gpt-heads applies to --model gpt only (this run has --model cnn)"),
    # not "--gpt-width 128 must be a multiple of --gpt-heads 3": a cnn has no heads to divide
    (["--model", "cnn", "--gpt-heads", "3"], "--gpt-heads applies to --model gpt only (this run has --model cnn)"),
    (
        ["--model", "cnn", "--data", "digits", "--synthetic-shape", "1,8,8"],
        "--synthetic-shape applies to --data synthetic only (this run has --data digits)",
    ),
    (
        ["--model", "cnn", "--data", "digits", "--seq-len", "64"],
        "--seq-len applies to --data text only (this run has --data digits)",
    ),
    (
        ["--model", "gpt", "--data", "text", "--synthetic-shape", "1,8,8"],
        "--synthetic-shape applies to --data synthetic only (this run has --data text)",
    ),
]


def test_a_flag_for_another_model_or_dataset_is_one_line_in_every_command(tmp_path):
    # `--gpt-width` with a cnn, `--synthetic-shape` without synthetic data: silently ignored
    # before, by train, find-batch-size and plan alike. Now the same line from all three.
    cases = []
    for command, where in (("train", ["--device", "cpu"]), ("find-batch-size", ["--device", "cpu"]), ("plan", [])):
        for i, (flags, said) in enumerate(FLAGS_ELSEWHERE):
            cwd = tmp_path / f"{command}-{i}"
            cwd.mkdir()
            cases.append(({"argv": [command, *flags, *where], "cwd": str(cwd)}, said))
    # --num-classes: the synthetic set's classes; plan also takes it as a language model's vocabulary
    for command in ("train", "find-batch-size", "plan"):
        cwd = tmp_path / f"{command}-classes"
        cwd.mkdir()
        argv = [command, "--model", "cnn", "--data", "digits", "--num-classes", "3"]
        cases.append(
            (
                {"argv": argv, "cwd": str(cwd)},
                "--num-classes applies to --data synthetic only (this run has --data digits)",
            )
        )
    for (case, said), r in zip(cases, run_batch([c for c, _ in cases])):
        line = _exits_2_with_one_line({**r, "argv": case["argv"]})
        assert line.endswith(said), (case["argv"], line)
        assert not os.listdir(case["cwd"]), (case["argv"], os.listdir(case["cwd"]))


def test_a_language_models_vocabulary_is_a_plan_flag_and_train_refuses_it(tmp_path):
    # plan sizes a language model's output layer by --num-classes (Llama 3's 128256, say); train
    # and find-batch-size read bytes, 256 of them, and say so.
    small = ("--gpt-width", "32", "--gpt-depth", "1", "--gpt-heads", "2", "--seq-len", "16", "--batch-size", "4")
    plan = run_cli(
        "plan", "--model", "gpt", "--num-classes", "512", *small, "--gpus-per-node", "2", "--strategy", "ddp",
        cwd=str(tmp_path),
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    cases = [
        {"argv": [c, "--model", "gpt", "--num-classes", "512", "--device", "cpu"], "cwd": str(tmp_path)}
        for c in ("train", "find-batch-size")
    ]
    for case, r in zip(cases, run_batch(cases)):
        line = _exits_2_with_one_line({**r, "argv": case["argv"]})
        assert line.endswith("--num-classes applies to --data synthetic only (this run has --data text)"), line
