"""Regenerate the console transcripts of README.md and docs/ from real runs.

A transcript is the block between two markers in a Markdown file:

    <!-- transcript: NAME -->
    ```console
    $ command
    its output
    ```
    <!-- /transcript -->

This script runs each transcript's commands (defined in TRANSCRIPTS below) and writes what
they printed into every block of that NAME. Python files a transcript runs are taken from the
page itself: a fenced block right after `<!-- file: NAME.py -->` is written to NAME.py first,
so the code on the page is the code that ran. The images the pages show of a run's output
(docs/images/curves.png, docs/images/report.png) are copied from the same runs.

    python docs/transcripts.py               # run everything, rewrite every block
    python docs/transcripts.py NAME [NAME]   # only these (and the runs they need)
    python docs/transcripts.py --check       # run, report stale blocks, write nothing
    python docs/transcripts.py --list        # the names and where they appear

Commands run in a fresh temporary directory. Paths written as /tmp/X on the page run as
TMP/X in it and are shown as /tmp/X again; the host name is shown as `vm`. Long epoch lists
are cut to their first and last epochs, with `...` between. Timings, throughput and memory
differ from run to run and machine to machine: `--check` ignores them (and, for the
transcripts marked `shape` or `head`, every number), so it reports a block as stale only when
the commands or what they print has changed. `--check` exits 1 when a block is stale.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.core.dist import environ_outside_job

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHOWN_HOST = "vm"
# A launcher's variables or a thread count in the caller's shell would change what runs.
CLEARED = ("DDPKIT_START_METHOD", "COLUMNS", "LINES")  # and every launcher variable (environ_outside_job)

BLOCK = re.compile(
    r"(?P<open><!-- transcript: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(?P<close><!-- /transcript -->)",
    re.DOTALL,
)
FILE = re.compile(r"<!-- file: (?P<name>[\w./-]+) -->\n```\w*\n(?P<text>.*?)```", re.DOTALL)
EPOCH = re.compile(r"^(\[rank\d+\]: )?epoch\s")


@dataclass
class Step:
    """One command: `cmd` as shown after `$ ` and run by bash; `rc` the exit code it must end
    with; `epochs` (first, last) cuts a long list of epoch lines."""

    cmd: str
    rc: int = 0
    epochs: tuple[int, int] | None = None


@dataclass
class Transcript:
    """The steps of one transcript, and what they need.

    files: written to the working directory first, name -> text ("" takes it from a page).
    needs: transcripts whose outputs these steps read (run first, once).
    check: "exact" compares all but timings, throughput and memory; "shape" ignores every
        number (outputs that vary in more than timings); "head" compares only the first
        three lines, numbers ignored (a search whose rows differ from run to run).
    unordered: ranks print concurrently, so `--check` compares the lines as a set.
    images: files a step produced -> where in the repository they go.
    """

    steps: list[Step]
    files: dict[str, str] = field(default_factory=dict)
    needs: list[str] = field(default_factory=list)
    check: str = "exact"
    unordered: bool = False
    images: dict[str, str] = field(default_factory=dict)


RUN_YAML = "model: mlp\nepochs: 3\nbatch-size: 32\nlr: 0.1\n"
RUN_MAIN = "import train_digits\n\ntrain_digits.main()\n"
COMPARE = """python - <<'EOF'
import json, torch

def load(run):
    return (torch.load(f"/tmp/inv/{run}/model.pt", weights_only=True),
            json.load(open(f"/tmp/inv/{run}/results.json")))

def diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)

n1, n2 = load("n1")[0], load("n2")[0]
for run in ("n1", "n2", "n3", "n3-micro8", "stop2-resume3", "stop2-resume2", "n1-1thread"):
    w, r = load(run)
    print(f"{run:14} world size {r['world_size']}  test accuracy {r['test_accuracy']:.4f}  "
          f"max |w - w_n1| {diff(w, n1):.1e}  max |w - w_n2| {diff(w, n2):.1e}")
EOF"""
COLLECTIVES = '''python -c "
import ddpkit
def f(k):
    import torch
    with ddpkit.Runtime() as rt:
        t = torch.arange(rt.rank + 1, dtype=torch.float32)
        sizes = [len(g) for g in rt.all_gather(t)]
        return rt.all_reduce(rt.rank * k), sizes, rt.gather_objects(rt.rank), rt.broadcast_object({'from': rt.rank})
print(ddpkit.launch(f, 10, nproc=3))
"'''
CKPT = "/tmp/dkr/checkpoints/step-00000138.pt"

TRANSCRIPTS: dict[str, Transcript] = {
    "train": Transcript([Step("ddpkit train --out /tmp/dk1", epochs=(3, 1))]),
    "train-nproc2": Transcript(
        [Step("ddpkit train --nproc 2 --out /tmp/dk2", epochs=(1, 1))],
        images={"/tmp/dk2/curves.png": "docs/images/curves.png"},
    ),
    "env": Transcript([Step("ddpkit env")], check="shape"),
    "config-yaml": Transcript(
        [
            Step("cat run.yaml"),
            Step("ddpkit train --config run.yaml --epochs 2 --out /tmp/dkc"),
        ],
        files={"run.yaml": RUN_YAML},
    ),
    "lr-scaling": Transcript(
        [
            Step("ddpkit train --batch-size 256 --out /tmp/b256 | grep '^done:'"),
            Step(
                "ddpkit train --batch-size 256 --lr-scaling linear --warmup-epochs 1 "
                "--out /tmp/b256-linear | grep '^done:'"
            ),
        ]
    ),
    "invariance-runs": Transcript(
        [
            Step("ddpkit train --epochs 2 --nproc 1 --out /tmp/inv/n1"),
            Step("ddpkit train --epochs 2 --nproc 2 --out /tmp/inv/n2"),
            Step("ddpkit train --epochs 2 --nproc 3 --out /tmp/inv/n3"),
            Step("ddpkit train --epochs 2 --nproc 3 --micro-batch-size 8 --out /tmp/inv/n3-micro8 > /dev/null"),
            Step("OMP_NUM_THREADS=1 ddpkit train --epochs 2 --nproc 1 --out /tmp/inv/n1-1thread > /dev/null"),
        ]
    ),
    "invariance-resume": Transcript(
        [
            Step("ddpkit train --epochs 2 --nproc 2 --max-steps 30 --out /tmp/inv/stop2-resume3"),
            Step("ddpkit train --epochs 2 --nproc 3 --resume auto --out /tmp/inv/stop2-resume3"),
            Step("ddpkit train --epochs 2 --nproc 2 --max-steps 30 --out /tmp/inv/stop2-resume2 > /dev/null"),
            Step("ddpkit train --epochs 2 --nproc 2 --resume auto --out /tmp/inv/stop2-resume2 > /dev/null"),
        ]
    ),
    "invariance-compare": Transcript([Step(COMPARE)], needs=["invariance-runs", "invariance-resume"]),
    "resume": Transcript(
        [
            Step("ddpkit train --epochs 4 --out /tmp/dkr > /dev/null"),
            Step("ddpkit train --epochs 6 --out /tmp/dkr --resume auto"),
        ]
    ),
    "metrics-jsonl": Transcript([Step("head -n 3 /tmp/dk1/metrics.jsonl")], needs=["train"], check="shape"),
    "report": Transcript(
        [
            Step("ddpkit train --nproc 2 --out cnn-2proc > /dev/null"),
            Step("ddpkit train --model lenet --out lenet-1proc > /dev/null"),
            Step("ddpkit report cnn-2proc lenet-1proc --out report.png"),
        ],
        check="shape",
        images={"report.png": "docs/images/report.png"},
    ),
    "errors": Transcript(
        [
            Step("ddpkit train --epochs 0", rc=2),
            Step("ddpkit train --device tpu", rc=2),
            Step("ddpkit train --batch-size 2 --nproc 3", rc=2),
            Step(
                "ddpkit train --device cuda            # on a machine without a GPU",
                rc=2,
            ),
            Step(
                "ddpkit train --sync-batchnorm         # on a machine without a GPU",
                rc=2,
            ),
            Step(
                "ddpkit train --comm-hook bf16         # on a machine without a GPU",
                rc=2,
            ),
            Step("ddpkit train --resume auto", rc=2),
            Step("ddpkit train --resume /tmp/nofile.pt", rc=2),
            Step(
                "ddpkit train --resume /tmp/dk1/model.pt    # weights only, not a training checkpoint",
                rc=2,
            ),
            Step(f"ddpkit train --model mlp --resume {CKPT} --epochs 8", rc=2),
            Step(f"ddpkit train --resume {CKPT} --epochs 6", rc=2),
            Step(
                "ddpkit train --out /tmp/dk1            # a finished run's directory, without --resume",
                rc=2,
            ),
            Step("ddpkit train --lr 1e6 --out /tmp/dknan 2>&1 | tail -1"),
        ],
        needs=["train", "resume"],
    ),
    "fp16-warning": Transcript([Step("ddpkit train --precision fp16 --epochs 1 --out /tmp/dkfp16 > /dev/null")]),
    "find-batch-size": Transcript([Step("ddpkit find-batch-size --nproc 2 --max-batch 1024")], check="head"),
    "find-batch-size-pp": Transcript(
        [
            Step(
                "ddpkit find-batch-size --model gpt --nproc 2 --device cpu --mesh pp=2 --seq-len 32 --gpt-width 32 "
                "--max-batch 16"
            )
        ],
        check="head",
    ),
    "plan": Transcript(
        [
            Step(
                "ddpkit plan --gpt-width 1024 --gpt-depth 16 --gpt-heads 16 --seq-len 2048 --batch-size 64 "
                "--gpu h100 --gpus-per-node 8 --nodes 2"
            )
        ],
        check="shape",
    ),
    "plan-llama": Transcript(
        [
            Step(
                "ddpkit plan --gpt-style llama --gpt-width 4096 --gpt-depth 32 --gpt-heads 32 --gpt-kv-heads 8 "
                "--gpt-hidden 14336 --seq-len 8192 --num-classes 128256 --batch-size 16 --strategy fsdp "
                "--activation-checkpointing all --gpu h100 --gpus-per-node 8"
            )
        ],
        check="shape",
    ),
    "runtime-digits": Transcript([Step("python train_digits.py")], files={"train_digits.py": ""}),
    "collectives": Transcript([Step(COLLECTIVES)]),
    "runtime-gather": Transcript([Step("python gather_metrics.py")], files={"gather_metrics.py": ""}),
    "fail": Transcript([Step("python fail.py")], files={"fail.py": ""}),
    "run-allreduce": Transcript(
        [Step("ddpkit run --nproc 3 allreduce.py")],
        files={"allreduce.py": ""},
        unordered=True,
    ),
    "run-main": Transcript(
        [Step("cat run_main.py"), Step("ddpkit run --nproc 2 run_main.py")],
        files={"train_digits.py": "", "run_main.py": RUN_MAIN},
        unordered=True,
    ),
    "torchrun": Transcript(
        [
            Step(
                "torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 "
                "-m ddpkit train --epochs 2 --out /tmp/dktr"
            )
        ]
    ),
}


def page_files() -> dict[str, str]:
    """Files defined on the pages (`<!-- file: NAME -->` + a fenced block); each must be the
    same wherever it appears."""
    found: dict[str, str] = {}
    for page in PAGES:
        for m in FILE.finditer(page.read_text()):
            name, text = m["name"], m["text"]
            if found.setdefault(name, text) != text:
                sys.exit(f"{page.relative_to(ROOT)}: file {name} differs from its other copy")
    return found


class Session:
    """Runs transcripts in one temporary directory, each at most once."""

    def __init__(self, files: dict[str, str]):
        self.tmp = Path(tempfile.mkdtemp(prefix="ddpkit-transcripts-"))
        self.cwd = self.tmp / "work"
        self.cwd.mkdir()
        self.files = files
        self.done: dict[str, str] = {}
        self.images: list[tuple[str, Path]] = []
        self.host = socket.gethostname()

    def run(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        t = TRANSCRIPTS[name]
        for need in t.needs:
            self.run(need)
        for fname, text in t.files.items():
            if not text and fname not in self.files:
                sys.exit(f"transcript {name}: no page defines file {fname}")
            (self.cwd / fname).write_text(text or self.files[fname])
        print(f"running {name}", file=sys.stderr, flush=True)
        self.done[name] = "\n".join(self.step(name, s) for s in t.steps)
        for src, dest in t.images.items():
            self.images.append((str(self.cwd / self.real(src)), ROOT / dest))
        return self.done[name]

    def real(self, text: str) -> str:
        return re.sub(r"(?<![\w.])/tmp/", f"{self.tmp}/", text)

    def shown(self, text: str) -> str:
        text = text.replace(str(self.tmp), "/tmp")
        if self.host != SHOWN_HOST:
            text = re.sub(rf"\b{re.escape(self.host)}\b", SHOWN_HOST, text)
        return text

    def step(self, name: str, s: Step) -> str:
        env = environ_outside_job(*CLEARED)
        env["PYTHONPATH"] = str(self.cwd)
        proc = subprocess.run(
            ["bash", "-c", self.real(s.cmd)],
            check=False,
            cwd=self.cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out = self.shown(proc.stdout)
        if proc.returncode != s.rc:
            sys.exit(f"transcript {name}: `{s.cmd}` exited {proc.returncode}, expected {s.rc}:\n{out}")
        lines = [line.rstrip() for line in out.splitlines()]
        if s.epochs:
            lines = elide(lines, *s.epochs)
        return "\n".join([f"$ {s.cmd}", *lines])

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def elide(lines: list[str], first: int, last: int) -> list[str]:
    """Keep the first `first` and the last `last` epoch lines, with `...` between."""
    at = [i for i, line in enumerate(lines) if EPOCH.match(line)]
    if len(at) <= first + last + 1:
        return lines
    cut = at[first : len(at) - last]
    return lines[: cut[0]] + ["..."] + lines[cut[-1] + 1 :]


VOLATILE = [  # timings, throughput and memory: they differ from run to run
    (re.compile(r"[\d,]+(\.\d+)? samples/s"), "N samples/s"),
    (re.compile(r"samples/s(\s+)[\d,]+"), r"samples/s\1N"),
    (re.compile(r"\b\d+(\.\d+)? (s|ms)\b"), r"N \2"),
    (re.compile(r"[\d,]+( / [\d,]+)* MiB"), "N MiB"),
    (re.compile(r"^[WIE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ "), "W "),  # torch's log prefix
    (re.compile(r"\(pid \d+\)"), "(pid N)"),  # a process id differs every run
]


def normalize(text: str, t: Transcript) -> list[str]:
    lines = text.strip("\n").splitlines()
    out = []
    for line in lines:
        for pattern, repl in VOLATILE:
            line = pattern.sub(repl, line)
        if t.check in ("shape", "head"):
            line = " ".join(re.sub(r"\d[\d,.]*(e[+-]?\d+)?", "N", line).split())
        out.append(line)
    if t.check == "head":
        out = out[:3]
    return sorted(out) if t.unordered else out


def render(body: str) -> str:
    return f"```console\n{body}\n```\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Regenerate (or --check) the docs' console transcripts.")
    p.add_argument("names", nargs="*", help="transcripts to run (default: all)")
    p.add_argument("--check", action="store_true", help="report stale blocks; write nothing")
    p.add_argument(
        "--list",
        action="store_true",
        help="list the transcripts and the pages using them",
    )
    a = p.parse_args(argv)
    texts = {page: page.read_text() for page in PAGES}
    used: dict[str, list[str]] = {}
    for page, text in texts.items():
        for m in BLOCK.finditer(text):
            used.setdefault(m["name"], []).append(str(page.relative_to(ROOT)))
    unknown = sorted(set(used) - set(TRANSCRIPTS)) + [n for n in a.names if n not in TRANSCRIPTS]
    if unknown:
        sys.exit(f"unknown transcript(s): {', '.join(unknown)}")
    if a.list:
        for name in TRANSCRIPTS:
            print(f"{name:20} {', '.join(used.get(name, ['(unused)']))}")
        return 0
    names = a.names or [n for n in TRANSCRIPTS if n in used]
    session = Session(page_files())
    try:
        fresh = {name: session.run(name) for name in names}
        stale = []
        for page, text in texts.items():

            def replace(m: re.Match, page: Path = page) -> str:
                name = m["name"]
                if name not in fresh:
                    return m[0]
                old = m["body"].removeprefix("```console\n").removesuffix("```\n")
                t = TRANSCRIPTS[name]
                if normalize(old, t) != normalize(fresh[name], t):
                    stale.append((page, name, old, fresh[name]))
                return m["open"] + render(fresh[name]) + m["close"]

            new = BLOCK.sub(replace, text)
            if not a.check and new != text:
                page.write_text(new)
        if not a.check:
            for src, dest in session.images:
                shutil.copyfile(src, dest)
    finally:
        session.close()
    for page, name, old, new in stale:
        print(f"{'stale' if a.check else 'updated'}: {page.relative_to(ROOT)}: {name}")
        if a.check:
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), "page", "now", lineterm="", n=1)
            print("\n".join(diff))
    if a.check:
        print(f"{len(stale)} stale transcript block(s)" if stale else "every transcript is current")
        return 1 if stale else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
