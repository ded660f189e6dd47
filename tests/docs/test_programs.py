"""Every Python block of README.md and docs/ as a reader would use it: no syntax error and no
undefined name (ruff's checks), and every complete program (one with `if __name__ ==
"__main__":`, or a torchrun-style script) run as written, exit 0. A block that is a fragment
of a program says so on its first line (`# inside ...`): it is only parsed."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli
from tests.docs.program_runner import run_all

PAGES = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str]]:
    """(where, code) of every distinct Python block: 'docs/runtime.md block 3'."""
    seen, out = set(), []
    for page in PAGES:
        for i, code in enumerate(BLOCK.findall(page.read_text()), 1):
            if code not in seen:
                seen.add(code)
                out.append((f"{page.relative_to(Path(ROOT))} block {i}", code))
    return out


BLOCKS = _blocks()
FRAGMENTS = [(where, code) for where, code in BLOCKS if code.startswith("# inside")]
PROGRAMS = [(where, code) for where, code in BLOCKS if 'if __name__ == "__main__":' in code]
SCRIPTS = [(where, code) for where, code in BLOCKS if "init_process_group" in code and (where, code) not in PROGRAMS]


@pytest.mark.cli
def test_every_block_parses_and_every_whole_one_names_nothing_undefined(tmp_path):
    assert len(BLOCKS) >= 15 and len(PROGRAMS) >= 10, [w for w, _ in BLOCKS]
    files = []
    for n, (where, code) in enumerate(BLOCKS):
        ast.parse(code, filename=where)  # a SyntaxError names the block
        if (where, code) not in FRAGMENTS:
            path = tmp_path / f"block_{n}.py"
            path.write_text(code)
            files.append((where, path))
    proc = subprocess.run(
        ["ruff", "check", "--isolated", "--no-cache", "--select", "F821,F822,F823", "--output-format", "concise"]
        + [str(p) for _, p in files],
        capture_output=True,
        text=True,
    )
    said = proc.stdout
    for where, path in files:
        said = said.replace(str(path), where)
    assert proc.returncode == 0, said


@pytest.fixture(scope="module")
def programs_run(tmp_path_factory) -> dict[str, dict]:
    """Every program, each in a folder of its own, run by one runner (`program_runner`: each in
    a process forked from one that imported torch once): {where: its outcome}."""
    cases = []
    for _, code in PROGRAMS:
        folder = tmp_path_factory.mktemp("program")
        (folder / "program.py").write_text(code)
        cases.append({"path": str(folder / "program.py"), "cwd": str(folder)})
    return dict(zip([where for where, _ in PROGRAMS], run_all(cases)))


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize("where", [w for w, _ in PROGRAMS])
def test_every_program_runs_as_written(programs_run, where):
    result = programs_run[where]
    assert result["code"] == 0, f"{where} (exit {result['code']}):\n{result['stderr'][-3000:]}"


@pytest.mark.cli
def test_the_runner_runs_a_program_as_the_interpreter_does(tmp_path):
    # what `python program.py` does at its end: its own exit code, SystemExit's message, a
    # thread it left running waited for, its atexit handlers run and its output flushed; and
    # one that never ends is stopped
    programs = {
        "fails": "raise ValueError('boom')\n",
        "exits 3": "import sys\nprint('out')\nsys.exit(3)\n",
        "exits with a message": "import sys\nsys.exit('said why')\n",
        "ends late": (
            "import atexit, threading, time, sys\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
            "sys.stdout.write('no newline')\n"
        ),
        "never ends": "import time\ntime.sleep(60)\n",
        "a thread starts a thread": (
            "import threading, time\n"
            "def inner():\n    time.sleep(0.3)\n    print('inner done')\n"
            "threading.Thread(target=lambda: (time.sleep(0.1), threading.Thread(target=inner).start())).start()\n"
        ),
        "named main": (
            "import os, sys\nfrom helper import WHERE\n"  # a module beside it: its folder comes first on the path
            "if __name__ == '__main__':\n"
            "    print(sys.argv[0].endswith('p.py'), WHERE == os.path.dirname(os.path.abspath(sys.argv[0])))\n"
            "    try:\n        import tests.docs\n    except ModuleNotFoundError:\n        print('no tests package')\n"
        ),
    }
    cases = []
    for name, code in programs.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "p.py").write_text(code)
        (folder / "helper.py").write_text("import os\nWHERE = os.path.dirname(os.path.abspath(__file__))\n")
        cases.append({"path": str(folder / "p.py"), "cwd": str(tmp_path)})  # run from elsewhere
    got = dict(zip(programs, run_all(cases, timeout=5)))
    assert got["fails"]["code"] == 1 and "ValueError: boom" in got["fails"]["stderr"]
    assert (got["exits 3"]["code"], got["exits 3"]["stdout"]) == (3, "out\n")
    assert (got["exits with a message"]["code"], got["exits with a message"]["stderr"]) == (1, "said why\n")
    assert got["ends late"]["code"] == 0 and got["ends late"]["stdout"] == "no newlinethread done\natexit ran\n"
    assert got["never ends"]["code"] == "timeout"
    assert (got["a thread starts a thread"]["code"], got["a thread starts a thread"]["stdout"]) == (0, "inner done\n")
    assert got["named main"] == {**got["named main"], "code": 0, "stdout": "True True\nno tests package\n"}


@pytest.mark.cli
@pytest.mark.parametrize("where,code", SCRIPTS, ids=[w for w, _ in SCRIPTS])
def test_every_torchrun_script_runs_under_ddpkit_run(tmp_path, where, code):
    path = tmp_path / "script.py"
    path.write_text(code)
    proc = run_cli("run", "--nproc", "2", str(path), cwd=str(tmp_path))
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"


@pytest.mark.cli
def test_a_block_with_an_undefined_name_is_caught(tmp_path):
    # the check above can fail: the fsdp page's block once used a Net it never defined
    path = tmp_path / "block.py"
    path.write_text("model = Net(width=8)\n")
    proc = subprocess.run(
        ["ruff", "check", "--isolated", "--no-cache", "--select", "F821", str(path)], capture_output=True
    )
    assert proc.returncode == 1 and b"Undefined name `Net`" in proc.stdout
