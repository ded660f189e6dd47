"""Every flag of every command, given invalid values: exit 2, one line on stderr naming the flag
(or the file), no traceback, nothing on stdout and nothing written.

The flags are read from each command's real argparse parser, so a new flag cannot escape the
table: an integer or float flag joins it by itself (with 0 counted as invalid unless ZERO_OK
says otherwise), and any other flag fails `test_every_flag_has_a_kind` until KINDS says what it
takes. Each case runs in an empty directory of its own, with any --out, --json or --plot
pointing into it; after the case that directory must still be empty.

The cases run in-process in a few helper interpreters (tests/cli/argv_runner.py: `ddpkit.cli.main`
with file descriptors 1 and 2 captured), one per command, at the same time: the checks all
happen before any worker starts, and one interpreter per case would spend its time importing
torch. `test_runner_agrees_with_the_command` shows that a case exits the same way as a real
`python -m ddpkit` process.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.cli.argv_runner import run_batch
from tests.cli.helpers import ok
from tests.conftest import PNG_MAGIC, run_cli
from tests.data.helpers import write_mnist

pytestmark = pytest.mark.cli

HUGE = "99999999999999999999"  # beyond int64
INVALID_INT = ("nan", "inf", "-1", "abc", "1.5", HUGE)
INVALID_FLOAT = ("nan", "inf", "-inf", "-1", "abc", "1e400")

# Integer and float flags for which 0 is a valid value (all others must refuse it). `ddpkit bench`'s
# counts with a default of 0 take 0 as "the benchmark's own default"; they are added in `_zero_ok`.
ZERO_OK = {
    "train": {
        "--seed",
        "--warmup-epochs",
        "--momentum",
        "--weight-decay",
        "--checkpoint-every",
        "--max-restarts",
        "--node-rank",
        "--master-port",  # one machine: the OS picks the rendezvous port anyway
        "--num-workers",
        "--crop-padding",
        "--label-smoothing",
        "--early-stop-min-delta",
        "--progress-every",  # no progress lines
        "--gpt-dropout",
    },
    "run": {"--node-rank", "--master-port", "--max-restarts", "--shutdown-timeout"},
    "find-batch-size": {"--warmup", "--plateau"},
    "plan": set(),
}

# The kind of every flag that is not plainly an integer or a float, by (command, its first
# option string); "bench" stands for every `ddpkit bench NAME`. FREE: any text is valid.
KINDS = {
    ("train", "--config"): "config",
    ("train", "--data"): "choice",
    ("train", "--data-dir"): "data-dir",
    ("train", "--model"): "model",
    ("train", "--nproc"): "nproc",
    ("train", "--device"): "choice",
    ("train", "--strategy"): "choice",
    ("train", "--mesh"): "mesh",
    ("train", "--pp-schedule"): "choice",
    ("train", "--lr-scaling"): "choice",
    ("train", "--optimizer"): "choice",
    ("train", "--precision"): "choice",
    ("train", "--out"): "out-dir",
    ("train", "--resume"): "checkpoint",
    ("train", "--nnodes"): "nnodes",
    ("train", "--master-addr"): "free",  # used only with --nnodes above 1
    ("train", "--on-nonfinite"): "choice",
    ("train", "--synthetic-shape"): "shape",
    ("train", "--loader"): "choice",
    ("train", "--augment"): "choice",
    ("train", "--comm-hook"): "choice",
    ("train", "--fsdp-reduce-dtype"): "choice",
    ("train", "--text-path"): "text-path",
    ("train", "--gpt-style"): "choice",
    ("train", "--activation-checkpointing-mode"): "choice",
    ("run", "--nproc"): "nproc",
    ("run", "--nnodes"): "nnodes",
    ("run", "--master-addr"): "free",
    ("run", "--run-id"): "free",
    ("run", "--rdzv-backend"): "choice",
    ("run", "--rdzv-endpoint"): "endpoint",
    ("run", "--rdzv-conf"): "rdzv-conf",
    ("run", "--log-dir"): "out-dir",
    ("run", "--local-ranks-filter"): "ranks",
    ("run", "--local-addr"): "free",
    ("run", "--monitor-interval"): "float",
    ("run", "--start-method"): "choice",
    ("run", "--numa-binding"): "choice",
    ("run", "--role"): "free",
    ("run", "--event-log-handler"): "free",
    ("run", "--logs-specs"): "free",
    ("run", "--signals-to-handle"): "free",
    ("run", "--duplicate-stdout-filters"): "free",
    ("run", "--duplicate-stderr-filters"): "free",
    ("run", "-r"): "std-spec",
    ("run", "-t"): "std-spec",
    ("find-batch-size", "--model"): "model",
    ("find-batch-size", "--data"): "choice",
    ("find-batch-size", "--synthetic-shape"): "shape",
    ("find-batch-size", "--nproc"): "nproc",
    ("find-batch-size", "--device"): "choice",
    ("find-batch-size", "--precision"): "choice",
    ("find-batch-size", "--optimizer"): "choice",
    ("find-batch-size", "--strategy"): "choice",
    ("find-batch-size", "--mesh"): "mesh",
    ("find-batch-size", "--pp-schedule"): "choice",
    ("find-batch-size", "--criterion"): "choice",
    ("find-batch-size", "--json"): "out-file",
    ("find-batch-size", "--plot"): "out-png",
    ("plan", "--model"): "model",
    ("plan", "--data"): "choice",
    ("plan", "--synthetic-shape"): "shape",
    ("plan", "--precision"): "choice",
    ("plan", "--optimizer"): "choice",
    ("plan", "--activation-checkpointing"): "choice",
    ("plan", "--gpu"): "choice",
    ("plan", "--gpt-style"): "choice",
    ("find-batch-size", "--gpt-style"): "choice",
    ("plan", "--strategy"): "choice",
    ("plan", "--json"): "out-file",
    ("plan", "--plot"): "out-png",
    ("report", "--out"): "out-png",
    ("report", "--json"): "out-file",
    ("bench", "--json"): "out-file",
    ("bench", "--plot"): "out-png",
    ("bench", "--dir"): "out-dir",  # bench checkpoint: where its checkpoints go
    ("bench", "--device"): "choice",
    ("bench", "--model"): "name",  # built-in models only; "" is the benchmark's default
    ("bench", "--shape"): "shape",
    ("bench", "--batch-sizes"): "int-list",
    ("bench", "--models"): "choice",
    ("bench", "--precision"): "name",
}

# Invalid values of each kind; FILE, DIR, BINARY, UTF16, CHECKPOINT and MODELS are made by the
# `inputs` fixture, and "={}" marks a value glued to the flag (--quick=1).
VALUES = {
    "int": INVALID_INT,
    "float": INVALID_FLOAT,
    "choice": ("nope", ""),
    "name": ("nope",),
    "nproc": ("0", "-1", "abc", "nan", "1.5", HUGE),
    "nnodes": ("0", "-1", "abc", "2:1", "1:x", ""),
    "mesh": ("dp=0", "tp=x", "pp=2", "dp=2;tp=2", "dp=2,dp=2", "", "dp=3"),  # dp=3: one process
    "shape": ("3,x", "0", "-1,4", "", "nan", "3,100000,100000"),
    "int-list": ("x", "0", "-1", "64,abc"),
    "config": ("{MISSING}", "{DIR}", "{BINARY}", "{UTF16}", "{FILE}/sub.yaml"),
    "checkpoint": ("{MISSING}", "{DIR}", "{BINARY}"),
    "data-dir": ("{FILE}",),
    "text-path": ("{MISSING}", "{DIR}", "{FILE}"),  # none, an empty folder, 13 bytes: too little text
    "out-dir": ("{FILE}", "{FILE}/sub"),
    "out-file": ("{DIR}", "{FILE}/sub.json"),
    "out-png": ("{DIR}", "{FILE}/sub.png", "{CWD}/plot.txt"),
    "model": (
        "nope",
        "",
        "no_such_module_xyz:f",
        "bad_models:nothing_here",
        "bad_models:raises",
        "bad_models:exits",
        "bad_models:raises_lines",
        "bad_models:returns_a_string",
        "bad_models:three_outputs",
        "bad_models:fifty_outputs",
        "bad_models:forward_raises",
        "exits_on_import:f",
    ),
    "endpoint": ("host:notaport", "host:70000", ":"),
    "rdzv-conf": ("nokey=1", "timeout=abc", "timeout"),
    "ranks": ("x", "-1", "0,,1"),
    "std-spec": ("x", "9", "0:x"),
    "store-true": ("={}1",),
    "bool": ("maybe", "2"),
    "free": (),
}

# Values that are invalid for one flag only (a port, a seed), besides those of its kind.
EXTRA_VALUES = {
    ("train", "--master-port"): ("65536",),
    ("run", "--master-port"): ("65536",),
    ("train", "--seed"): (str(2**32),),  # NumPy's seeds are 32-bit
    ("train", "--num-workers"): ("100000",),  # each one a process
    ("train", "--timeout"): ("1e300",),  # a timedelta, then int64 milliseconds in torch
    ("train", "--crop-padding"): ("1000000",),  # padded images of that size
    ("train", "--gpt-width"): ("6", "1000000"),  # not a multiple of --gpt-heads 4; 10^13 parameters
    ("train", "--ema"): ("1", "1.5"),  # a decay of 1 keeps the initial weights forever
    ("train", "--num-classes"): ("1",),  # a classifier of one class learns nothing
    ("find-batch-size", "--gpt-width"): ("6",),  # not a multiple of --gpt-heads 4
    ("plan", "--gpt-width"): ("6",),  # not a multiple of --gpt-heads 4
    ("plan", "--num-classes"): ("1",),
    ("plan", "--efficiency"): ("2", "1e-9"),  # a share of the peak
    ("plan", "--peak-tflops"): ("1e300",),  # no machine; inf once in FLOP/s
}

# A user's model functions, each wrong in its own way (tests/cli/argv_runner's interpreters
# import them from the inputs folder).
BAD_MODELS = """
import sys
from torch import nn

def raises(in_shape, num_classes):
    raise RuntimeError("cannot build this")

def exits(in_shape, num_classes):
    sys.exit(5)

def raises_lines(in_shape, num_classes):
    raise ValueError("a message\nof several\n\nlines")

def returns_a_string(in_shape, num_classes):
    return "a model"

def three_outputs(in_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(3))

def fifty_outputs(in_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(50))

class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 10)

    def forward(self, x):
        return self.fc(x)  # (1, C, H, W) into a 3-input layer: fails

def forward_raises(in_shape, num_classes):
    return _Broken()
"""

# Flags that only matter with another one: given before the flag under test.
CONTEXT = {
    ("train", "--synthetic-shape"): ("--data", "synthetic"),
    ("train", "--synthetic-size"): ("--data", "synthetic"),
    ("train", "--num-classes"): ("--data", "synthetic"),
    ("train", "--crop-padding"): ("--augment", "crop"),
    ("train", "--text-path"): ("--model", "gpt"),  # its recipe has --data text
    ("train", "--gpt-width"): ("--model", "gpt"),
    ("train", "--gpt-dropout"): ("--model", "gpt"),
    ("train", "--gpt-style"): ("--model", "gpt"),
    ("train", "--gpt-kv-heads"): ("--model", "gpt"),
    ("train", "--gpt-hidden"): ("--model", "gpt"),
    ("train", "--activation-checkpointing-mode"): ("--activation-checkpointing", "true"),
    ("train", "--seq-len"): ("--model", "gpt"),
    ("find-batch-size", "--synthetic-shape"): ("--data", "synthetic"),
    ("find-batch-size", "--num-classes"): ("--data", "synthetic"),
    ("find-batch-size", "--seq-len"): ("--model", "gpt"),
    ("find-batch-size", "--gpt-width"): ("--model", "gpt"),
    ("find-batch-size", "--gpt-depth"): ("--model", "gpt"),
    ("find-batch-size", "--gpt-heads"): ("--model", "gpt"),
    ("find-batch-size", "--pp-schedule"): ("--model", "gpt"),
    ("plan", "--synthetic-shape"): ("--model", "cnn", "--data", "synthetic"),
    ("plan", "--num-classes"): ("--model", "cnn", "--data", "synthetic"),
    ("plan", "--verify-nproc"): ("--verify",),
}

# What each command gets besides the flag under test: small enough that a case which slipped
# through (and so fails the test) finishes quickly; {CWD} is the case's own empty directory.
BASE = {
    "train": ("--device", "cpu", "--nproc", "1", "--epochs", "1", "--max-steps", "1", "--out", "{CWD}/out"),
    "run": ("--nproc", "1"),
    "find-batch-size": (
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--max-batch",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--json",
        "{CWD}/r.json",
    ),
    "report": ("--out", "{CWD}/r.png"),
    "plan": (
        "--gpt-width",
        "64",
        "--gpt-depth",
        "2",
        "--gpt-heads",
        "4",
        "--seq-len",
        "32",
        "--gpus-per-node",
        "2",
        "--batch-size",
        "8",
        "--activation-checkpointing",
        "off",
        "--json",
        "{CWD}/p.json",
    ),
    "env": (),
    "bench": ("--device", "cpu", "--quick", "--repeats", "1", "--json", "{CWD}/b.json", "--plot", "{CWD}/b.png"),
}


@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's real parser ("bench NAME" for every benchmark), with all its flags added."""
    from ddpkit.bench import BENCHES
    from ddpkit.cli import bench, env, find_batch_size, plan, report, run, train
    from ddpkit.trainer.config import layered

    train_parser = train._parser(layered(None, None, None))
    train_parser.parse_known_args([])  # simple_parsing adds the dataclass's flags when it parses
    found = {
        "train": train_parser,
        "run": run._parser(),
        "find-batch-size": find_batch_size._parser(),
        "report": report._parser(),
        "env": env._parser(),
        "plan": plan._parser(),
    }
    found.update({f"bench {name}": bench._parser(name, BENCHES) for name in BENCHES})
    return found


def _family(command: str) -> str:
    return command.split()[0]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _kind(command: str, action: argparse.Action) -> str | None:
    if action.type is int:
        return "int"
    if action.type is float:
        return "float"
    if type(action).__name__ == "BooleanOptionalAction":  # argparse's or simple_parsing's: --compile true|false
        return "bool"
    if action.nargs == 0:
        return "store-true"
    return KINDS.get((_family(command), action.option_strings[0]))


def _zero_ok(command: str, action: argparse.Action) -> bool:
    if _family(command) == "bench" and action.type is int and action.default == 0:
        return True
    return action.option_strings[0] in ZERO_OK.get(_family(command), ())


@dataclass
class Case:
    id: str
    command: str
    argv: list[str]  # after the command, with {placeholders}
    needles: tuple[str, ...]  # the line must name one of these
    positional: bool = False  # argv is the whole command line after the command: no BASE


def _flag_cases(command: str) -> list[Case]:
    cases = []
    for action in _options(parsers()[command]):
        kind = _kind(command, action)
        flag = action.option_strings[0]
        values = [*VALUES.get(kind or "free", ()), *EXTRA_VALUES.get((_family(command), flag), ())]
        if kind in ("int", "float") and not _zero_ok(command, action):
            values.append("0")
        context = list(CONTEXT.get((_family(command), flag), ()))
        for value in values:
            args = [f"{flag}={value[3:]}"] if value.startswith("={}") else [flag, value]
            needles = tuple(action.option_strings)
            cases.append(Case(f"{command} {flag} {value!r}", command, [*context, *args], needles))
    return cases


def _other_cases() -> list[Case]:
    """Positional arguments and the commands themselves."""
    out = ["--out", "{CWD}/r.png"]
    return [
        Case("report DIR missing", "report", ["{MISSING}", *out], ("{MISSING}",), positional=True),
        Case("report DIR a file", "report", ["{FILE}", *out], ("{FILE}",), positional=True),
        Case("report DIR empty", "report", ["{DIR}", *out], ("{DIR}",), positional=True),
        Case("report no DIR", "report", out, ("DIR",), positional=True),
        Case("run SCRIPT missing", "run", ["{MISSING}"], ("{MISSING}",), positional=True),
        Case("run no SCRIPT", "run", [], ("SCRIPT",), positional=True),
        Case("bench NAME unknown", "bench", ["nope"], ("nope",), positional=True),
        Case("command unknown", "", ["nope"], ("nope",), positional=True),
        Case("train stray negative value", "train", ["--bucket-cap-mb", "-inf"], ("--bucket-cap-mb=-inf",)),
        Case("train typo", "train", ["--epochz", "3"], ("--epochz 3 (--epochz: did you mean --epochs?)",)),
        Case("train abbreviation", "train", ["--epoch", "3"], ("--epoch 3 (--epoch: did you mean --epochs?)",)),
        Case("train abbreviated --config", "train", ["--conf", "{FILE}"], ("unrecognized arguments: --conf",)),
        Case("find-batch-size typo", "find-batch-size", ["--max-btch", "4"], ("did you mean --max-batch?",)),
        Case("env abbreviation", "env", ["--js"], ("did you mean --json?",)),
        Case(
            "train --data-dir under a file, --data mnist",
            "train",
            ["--data", "mnist", "--data-dir", "{FILE}/sub"],
            ("--data-dir", "{FILE}"),
        ),
        Case(
            "train --data mnist whose training file holds 0 images",
            "train",
            ["--data", "mnist", "--data-dir", "{EMPTY_SET}"],
            ("train-images-idx3-ubyte.gz: holds no images",),
        ),
        Case(
            "train --data synthetic too large for memory",
            "train",
            ["--data", "synthetic", "--synthetic-size", str(2**40)],
            ("--synthetic-size",),
        ),
    ]


def all_cases() -> list[Case]:
    commands = list(parsers())
    return [case for command in commands for case in _flag_cases(command)] + _other_cases()


def _command_line(case: Case) -> list[str]:
    """The full command line: the command, its base flags, then the case's (which win), and
    the positional arguments the command needs."""
    if case.positional:
        return [*case.command.split(), *case.argv]
    family = _family(case.command)
    if family == "report":
        return [case.command, "{RUN}", *BASE[family], *case.argv]
    if family == "run":
        return [case.command, *BASE[family], *case.argv, "{SCRIPT}"]
    return [*case.command.split(), *BASE[family], *case.argv]


CASES = all_cases()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The files the cases point at, in a folder of their own (never a case's working directory)."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "a-file").write_text("a plain file\n")
    (root / "a-dir").mkdir()
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (root / "bom.yaml").write_bytes("epochs: 0\n".encode("utf-16"))  # with a byte order mark
    (root / "utf16.yaml").write_bytes("epochs: 1\n".encode("utf-16-le"))  # no byte order mark: not YAML
    (root / "bad_models.py").write_text(BAD_MODELS)
    (root / "exits_on_import.py").write_text("import sys\n\nsys.exit(7)\n")
    (root / "script.py").write_text("print('ran')\n")
    write_mnist(root / "empty-set" / "mnist", n_train=0)
    run = root / "a-run"
    run.mkdir()
    epoch = {"type": "epoch", "epoch": 1, "train_loss": 1.0, "train_accuracy": 0.5, "test_loss": 1.0}
    (run / "metrics.jsonl").write_text(json.dumps({**epoch, "test_accuracy": 0.5}) + "\n")
    (run / "results.json").write_text(json.dumps({"model": "cnn", "data": "digits", "world_size": 1}))
    return {
        "FILE": str(root / "a-file"),
        "DIR": str(root / "a-dir"),
        "MISSING": str(root / "missing"),
        "BINARY": str(root / "binary.bin"),
        "UTF16": str(root / "utf16.yaml"),
        "BOM": str(root / "bom.yaml"),
        "SCRIPT": str(root / "script.py"),
        "RUN": str(run),
        "MODELS": str(root),
        "EMPTY_SET": str(root / "empty-set"),
    }


def _fill(text: str, names: dict[str, str]) -> str:
    for name, value in names.items():
        text = text.replace("{" + name + "}", value)
    return text


def _run_batch(items: list[dict]) -> list[dict]:
    return run_batch(items, items[0]["models"])


# Command lines that are not bad-value cases, run with them (in the same interpreters) for the
# tests at the end of this file: name -> argv.
OTHERS = {
    "bare ddpkit": [],
    "bare bench": ["bench"],
    "bench --help": ["bench", "--help"],
    "env --json": ["env", "--json"],
    "config in UTF-16 with a BOM": ["train", "--config", "{BOM}", "--out", "{CWD}/out"],
}


@pytest.fixture(scope="module")
def results(inputs, tmp_path_factory) -> dict[str, dict]:
    """Every case (and OTHERS) run, in a few helper interpreters at once: id -> outcome."""
    root = tmp_path_factory.mktemp("cases")
    lines = [(case.id, case.command, _command_line(case)) for case in CASES]
    lines += [(name, "", argv) for name, argv in OTHERS.items()]
    batches: dict[str, list[dict]] = {}
    for i, (id_, command, argv) in enumerate(lines):
        cwd = root / str(i)
        cwd.mkdir()
        names = {**inputs, "CWD": str(cwd)}
        item = {"id": id_, "argv": [_fill(a, names) for a in argv], "cwd": str(cwd), "models": inputs["MODELS"]}
        batches.setdefault("train" if command == "train" else f"other-{i % 2}", []).append(item)
    with ThreadPoolExecutor(len(batches)) as pool:
        outcomes = pool.map(_run_batch, batches.values())
    by_id = {}
    for items, outs in zip(batches.values(), outcomes):
        for item, out in zip(items, outs):
            by_id[item["id"]] = {**out, "argv": item["argv"], "left": sorted(os.listdir(item["cwd"]))}
    return by_id


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_value_exits_2_with_one_line(case, results, inputs):
    r = results[case.id]
    shown = f"ddpkit {' '.join(r['argv'])}\nexit {r['code']}\nstdout:\n{r['stdout'][-2000:]}\nstderr:\n{r['stderr'][-3000:]}"
    assert r["code"] == 2, shown
    assert "Traceback" not in r["stderr"] + r["stdout"], shown
    assert not r["stdout"].strip(), shown
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].strip(), shown
    needles = [_fill(n, inputs) for n in case.needles]
    assert any(n in lines[0] for n in needles), f"none of {needles} named in: {lines[0]}"
    assert not r["left"], f"written although refused: {r['left']}\n{shown}"


def test_every_flag_has_a_kind():
    missing = [
        f"{command} {action.option_strings[0]}"
        for command, parser in parsers().items()
        for action in _options(parser)
        if _kind(command, action) is None
    ]
    assert not missing, f"flags without a kind in KINDS (say which invalid values they take): {missing}"


def test_every_command_is_in_the_table():
    from ddpkit.bench import BENCHES
    from ddpkit.cli import COMMANDS

    assert set(COMMANDS) == {_family(c) for c in parsers()}
    assert {c.split()[1] for c in parsers() if c.startswith("bench ")} == set(BENCHES)


def test_runner_agrees_with_the_command(results, tmp_path):
    """The in-process runner exits as `python -m ddpkit` does: a refused case compared with a
    real process, and a valid command (so the runner can report success at all)."""
    refused = results["train --epochs 'nan'"]
    real = run_cli(*refused["argv"], cwd=str(tmp_path))
    assert (refused["code"], refused["stderr"], refused["stdout"]) == (real.returncode, real.stderr, real.stdout)
    assert refused["code"] == 2 and "--epochs" in refused["stderr"]
    valid = results["env --json"]
    assert valid["code"] == 0 and json.loads(valid["stdout"]), valid


def test_bare_commands_print_their_usage_on_stderr_and_exit_2(results):
    for name in ("bare ddpkit", "bare bench"):
        r = results[name]
        assert r["code"] == 2 and not r["stdout"], r
        assert "usage: ddpkit" in r["stderr"] and "Traceback" not in r["stderr"], r
    listed = results["bench --help"]  # asked for: on stdout, exit 0
    assert listed["code"] == 0 and "loader" in listed["stdout"] and not listed["stderr"], listed


def test_report_replaces_its_own_default_file_but_no_one_elses_unless_named(inputs, tmp_path):
    # Run twice, as a newcomer does: the second call replaces the plot the first one drew
    for _ in range(2):
        ok(run_cli("report", inputs["RUN"], cwd=str(tmp_path)))
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_MAGIC)
    (tmp_path / "report.png").write_bytes(b"someone's plot")  # a file ddpkit report did not draw
    proc = run_cli("report", inputs["RUN"], cwd=str(tmp_path))
    assert proc.returncode == 2 and not proc.stdout, proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "ddpkit report: error: ./report.png exists and was not drawn by ddpkit report; name the plot with --out "
        "FILE.png (an --out that exists is replaced)"
    ]
    assert (tmp_path / "report.png").read_bytes() == b"someone's plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.png"]
    # a run that is not there is said first, whatever is in the way of the plot
    proc = run_cli("report", str(tmp_path / "nothere"), cwd=str(tmp_path))
    assert proc.returncode == 2 and "nothere: no metrics.jsonl" in proc.stderr and "report.png" not in proc.stderr
    proc = run_cli("report", inputs["RUN"], "--out", "report.png", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_MAGIC)


def test_config_in_utf16_with_a_byte_order_mark_is_read(results):
    """YAML allows UTF-16 with a byte order mark: such a file is read (its bad value is what is
    refused), while one without the mark is refused as not YAML (a case above)."""
    r = results["config in UTF-16 with a BOM"]
    assert r["code"] == 2 and r["stderr"].strip() == "ddpkit train: error: --epochs must be positive, got 0", r
