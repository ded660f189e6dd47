"""`ddpkit` itself: `--version`; the program's end, which skips the interpreter's teardown
but not what the teardown would do that matters: atexit handlers, buffered output (and a
reader that left: 141), the wait for a thread still running."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import ddpkit
from ddpkit.bench import BENCHES
from tests.cli.helpers import ok
from tests.conftest import SRC, clean_env

pytestmark = pytest.mark.cli


def test_version(cli, tmp_path):
    proc = cli("--version", cwd=str(tmp_path))
    ok(proc)
    assert ddpkit.__version__ in proc.stdout


def _program(body: str, tmp_path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in clean_env().items() if k != "PYTHONUNBUFFERED"}  # stdout stays buffered
    env["PYTHONPATH"] = SRC
    head = "import atexit, sys, threading, time\nfrom ddpkit.cli import end_program\n"
    return subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(body), str(tmp_path)], env=env, timeout=60, **kw
    )


def test_the_program_end_runs_atexit_and_flushes_what_is_buffered(tmp_path):
    proc = _program(
        """
        atexit.register(lambda: open(sys.argv[1] + "/atexit", "w").write("ran"))
        sys.stdout.write("buffered, no newline")
        end_program(7)
        print("not reached")
        """,
        tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_a_running_thread_leaves_the_end_to_the_interpreter(tmp_path):
    proc = _program(
        """
        def late():
            time.sleep(0.3)
            open(sys.argv[1] + "/thread", "w").write("done")
        threading.Thread(target=late).start()
        end_program(5)
        print("the interpreter ends it")
        sys.exit(5)
        """,
        tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 5, proc.stderr
    assert "the interpreter ends it" in proc.stdout
    assert (tmp_path / "thread").read_text() == "done"  # waited for, as without ddpkit


def test_output_lost_at_the_end_is_not_a_success(tmp_path):
    # stdout on a full disk: the last of the output cannot be written. Exit 120, as Python's own
    # teardown would; a failure's own code is kept.
    with open("/dev/full", "w") as full:
        lost = _program('sys.stdout.write("x" * 10)\nend_program(0)\n', tmp_path, stdout=full, stderr=subprocess.PIPE)
        failed = _program('sys.stdout.write("x")\nend_program(1)\n', tmp_path, stdout=full, stderr=subprocess.PIPE)
    assert lost.returncode == 120 and b"could not write the last of its output" in lost.stderr
    assert failed.returncode == 1


def test_a_reader_gone_at_the_end_is_exit_141(tmp_path):
    env = {k: v for k, v in clean_env().items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # the reader leaves before the output, still buffered, is flushed
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Exception ignored" not in err and "Traceback" not in err


def test_train_help_gives_every_flag_its_own_text_and_one_default(cli):
    # A newcomer read `--text-path` with no text (its text sat under --seq-len), "(default:
    # runs/<date>-<time>) (default: None)" and an internal "TrainConfig ['cfg']:" header
    proc = cli("train", "--help", env={"COLUMNS": "200"})
    ok(proc)
    assert "TrainConfig" not in proc.stdout and "['cfg']" not in proc.stdout
    assert "(default: None)" not in proc.stdout
    options = proc.stdout.split("\noptions:\n", 1)[1]
    entries: dict[str, str] = {}
    for line in options.splitlines():
        if line.startswith("  -"):  # a flag's first line: its names, then the start of its text
            names, _, text = line.strip().partition("  ")
            flag = names.split()[0].rstrip(",")
            entries[flag] = text.strip()
        elif line.startswith("    ") and entries:
            entries[flag] += " " + line.strip()
    assert len(entries) > 60 and "--text-path" in entries and "--seq-len" in entries
    for flag, text in entries.items():
        assert text, f"{flag} has no help text"
        assert text.count("(default") <= 1, f"{flag}: {text}"
    assert entries["--text-path"].startswith("--data text: a text file, or a directory of them")
    assert entries["--seq-len"].startswith("--data text: bytes per sequence")
    assert entries["--out"] == "output directory (default: runs/<date>-<time>)"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--help"],
        ["train", "--bogus"],
        ["train", "--epochs", "two"],
        ["train", "--epochs", "0"],
        *([command, "--help"] for command in ("run", "find-batch-size", "plan", "env", "report")),
        ["find-batch-size", "--warmup", "two"],
        ["plan", "--gpus-per-node", "two"],
        *(["bench", name, "--help"] for name in BENCHES),
        ["bench", "comm", "--repeats", "many"],
    ],
)
def test_help_and_a_bad_flag_answer_without_loading_torch(argv):
    # torch takes seconds to import: a command's --help and a flag that does not parse end
    # before it loads; a value the plan checks, such as --epochs 0, is checked after torch
    # loads but before its compiler does (another second: ddpkit's dropout makes what keeps
    # its draw out of compiled graphs only when something compiles).
    program = (
        "import sys\nfrom ddpkit.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        "print('torch' in sys.modules, 'torch._dynamo' in sys.modules, code, file=sys.stderr)\n"
    )
    env = {**clean_env(), "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", program, *argv], env=env, capture_output=True, text=True, timeout=60)
    torch, compiler, code = proc.stderr.strip().splitlines()[-1].split()
    checked_after_torch = argv[-1] == "0"
    assert (torch, compiler) == (str(checked_after_torch), "False"), proc.stderr[-2000:]
    assert code == ("0" if "--help" in argv else "2"), proc.stderr[-2000:]
