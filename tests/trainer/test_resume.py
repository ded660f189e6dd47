"""`resume`: `--resume auto` skips a damaged newest checkpoint (saying so), refuses a run it
cannot continue, a changed learning rate, or a folder whose checkpoints are all damaged; a
checkpoint with wrong entries is one line and exit 2; and a fresh run will not reuse a folder
with checkpoints; nothing is lost either way.

The refused command lines all end before any worker starts: they run together in one helper
interpreter (`refused`, through tests/cli/argv_runner.py, whose cases exit as `python -m ddpkit`
does: tests/cli/test_bad_flags.py and test_bad_input.py compare them with real processes), each on
a copy of its own."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.argv_runner import run_batch
from tests.conftest import run_cli
from tests.damage import flip, flip_a_tensor
from tests.trainer.helpers import COMMON, copied, max_diff, train

pytestmark = pytest.mark.cli

CANNOT_CONTINUE = {"model": ("--model", "mlp"), "batch-size": ("--batch-size", "32"), "seed": ("--seed", "1")}
CANNOT_CONTINUE["already-finished"] = ("--epochs", "1")


def _set(key, value):
    def change(state):
        state["run"][key] = value

    return change


def _set_runtime(key, value):
    def change(state):
        state["runtime"][key] = value

    return change


def _python_stream(numbers):
    def change(state):
        version, _, gauss = state["runtime"]["rng"][0]["python"]
        state["runtime"]["rng"][0]["python"] = (version, numbers, gauss)

    return change


def _drop_runtime(state):
    del state["runtime"]


def _drop(key):
    def change(state):
        del state["run"][key]

    return change


WRONG_ENTRIES = {
    "epoch-str": (_set("epoch", "1"), "'epoch' is '1'"),  # a TypeError in the plan before
    "rng-short": (_set_runtime("rng", []), "0 random states for world size 1"),  # an IndexError in every worker
    "steps-negative": (_set_runtime("steps", -1), "'steps' is -1"),
    "no-runtime": (_drop_runtime, "no 'runtime' entry"),  # rt.load_state's refusal in every worker
    "no-history": (_drop("history"), "no 'history'"),  # a KeyError in every worker
    "lr-tensor": (_set("lr", torch.tensor([0.05, 0.05])), "'lr' is Tensor"),  # "ambiguous truth value"
    # a ValueError or TypeError in every worker's random.setstate
    "python-rng-short": (_python_stream(torch.zeros(624, dtype=torch.int64)), "Python's 625 numbers"),
    "python-rng-float": (_python_stream(torch.zeros(625)), "Python's 625 numbers"),
}


# A checkpoint's bytes no longer what was written (a disk, a copy, a hand), or its name not its step.
DAMAGED = {
    "flipped": (flip_a_tensor, r"damaged \(archive/data/\d+ does not match the checksum written with it\)"),
    "renamed": (lambda path: None, r"damaged \(it holds the state of step 15, not of the step its name says\)"),
}


def _tree(folder) -> dict:
    """Every file below `folder` -> its bytes."""
    return {f: f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _files(*paths) -> dict:
    """Each file under `paths` (or the file itself) -> its bytes."""
    files = [f for p in paths for f in (sorted(p.iterdir()) if p.is_dir() else [p])]
    return {f: f.read_bytes() for f in files}


@pytest.fixture(scope="module")
def refused(three_checkpoints, fsdp_two_process_run, tmp_path_factory) -> dict[str, dict]:
    """The command lines this file expects refused, each on its own copy of `three_checkpoints`
    (a finished one-epoch run on one process) or with a checkpoint of it changed, made ready and
    run in one helper interpreter: id -> {"out", "argv", "code", "stdout", "stderr", ...}."""
    root, cases = tmp_path_factory.mktemp("refused"), {}

    def case(name: str, *args: str, out=None, **more) -> dict:
        out = out or copied(three_checkpoints, root / name)
        cases[name] = {"out": out, "argv": [*COMMON, "--out", str(out), *args], "cwd": str(root), **more}
        return cases[name]

    for name, change in CANNOT_CONTINUE.items():
        c = case(name, "--nproc", "1", "--resume", "auto", *change)
        c["before"] = _files(c["out"] / "checkpoints"), _files(c["out"] / "metrics.jsonl")
    c = case("fresh", "--nproc", "1")  # forgot --resume auto
    c["before"] = sorted(p.name for p in (c["out"] / "checkpoints").iterdir())
    case("lr", "--nproc", "1", "--resume", "auto", "--lr", "0.01")  # one epoch of two: one left to train
    c = case("none-usable", "--nproc", "1", "--resume", "auto")
    for path in (c["out"] / "checkpoints").iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    c["before"] = _files(c["out"] / "checkpoints", c["out"] / "metrics.jsonl", c["out"] / "results.json")
    for name, (change, _) in WRONG_ENTRIES.items():
        state = torch.load(three_checkpoints / "checkpoints" / "step-00000015.pt", weights_only=True)
        change(state)
        (root / name).mkdir()
        path = root / name / "bad.pt"
        torch.save(state, path)
        case(name, "--nproc", "2", "--resume", str(path), out=root / name / "new", path=path)
    for name, (damage, _) in DAMAGED.items():  # step 15's checkpoint, damaged on a copy: --resume PATH
        (root / name).mkdir()
        path = root / name / ("step-00000020.pt" if name == "renamed" else "step-00000015.pt")
        shutil.copy(three_checkpoints / "checkpoints" / "step-00000015.pt", path)
        damage(path)
        case(name, "--nproc", "2", "--resume", str(path), out=root / name / "new", path=path)
    source = copied(three_checkpoints, root / "source")  # --resume PATH into --out of another run
    c = case("into-another-run", "--nproc", "1", "--resume", str(source / "checkpoints" / "step-00000015.pt"))
    c["before"] = _tree(c["out"])
    fsdp_out, _ = fsdp_two_process_run  # an fsdp checkpoint directory, one of its shards flipped
    newest = sorted((fsdp_out / "checkpoints").iterdir())[-1]
    shard = root / "fsdp-flipped" / newest.name
    shutil.copytree(newest, shard)
    flip(shard / "__1_0.distcp", (shard / "__1_0.distcp").stat().st_size // 2)
    fsdp = ("--strategy", "fsdp", "--nproc", "2", "--resume", str(shard))
    case("fsdp-flipped", *fsdp, out=root / "fsdp-flipped" / "new", path=shard)
    outcomes = run_batch([{"argv": c["argv"], "cwd": c["cwd"]} for c in cases.values()])
    return {name: {**c, **r} for (name, c), r in zip(cases.items(), outcomes)}


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_newest_checkpoint(straight, stopped, tmp_path):
    out = copied(stopped(30)[0], tmp_path)  # --max-steps 30 --checkpoint-every 10 --keep-checkpoints 3
    folder = out / "checkpoints"
    # every 10 steps and at the end of epoch 1 (step 23); the newest three kept
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{s:08d}.pt" for s in (20, 23, 30)]
    newest = folder / "step-00000030.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn file
    (folder / ".tmp-abandoned.pt").write_bytes(b"half a write")  # a write that never finished
    resumed = train(out, "--nproc", "2", "--resume", "auto")
    assert "at step 23" in resumed["stdout"]
    assert max_diff(resumed["weights"], straight["weights"]) == 0.0  # 23 -> 46 replays exactly


@pytest.mark.parametrize("change", CANNOT_CONTINUE)
def test_resume_auto_refuses_a_run_it_cannot_continue(refused, change):
    # Starting afresh would overwrite the run's metrics and checkpoints: refuse, lose nothing.
    r = refused[change]  # --nproc 1 --resume auto CHANGE, on a copy of a finished one-epoch run
    assert r["code"] == 2, r["stderr"][-2000:]
    line = r["stderr"].strip()
    flag = CANNOT_CONTINUE[change][0]
    assert "\n" not in line and "--resume auto" in line and (flag in line or "finished" in line)
    checkpoints, metrics = r["before"]
    assert _files(r["out"] / "checkpoints") == checkpoints
    assert _files(r["out"] / "metrics.jsonl") == metrics


def test_a_fresh_run_will_not_reuse_a_folder_with_checkpoints(refused):
    r = refused["fresh"]  # --nproc 1 without --resume auto, on a copy of the run
    assert r["code"] == 2 and "--resume auto" in r["stderr"] and len(r["stderr"].strip().splitlines()) == 1
    assert sorted(p.name for p in (r["out"] / "checkpoints").iterdir()) == r["before"]


def test_resume_refuses_a_changed_learning_rate(refused):
    r = refused["lr"]  # --resume auto --lr 0.01: one epoch of the two asked for is left to train
    assert r["code"] == 2 and "--lr" in r["stderr"]  # the saved optimizer state would override it


def _copy(run, tmp_path):
    out = copied(run, tmp_path)
    return out, out / "checkpoints"


def test_resume_auto_names_each_checkpoint_it_skips_and_prunes_interrupted_writes(three_checkpoints, tmp_path):
    out, folder = _copy(three_checkpoints, tmp_path)
    newest = folder / "step-00000023.pt"
    newest.write_bytes(newest.read_bytes()[:5000])  # torn
    flip_a_tensor(folder / "step-00000020.pt")  # 16 bytes of a tensor: torch.load alone would take them
    (folder / ".tmp-k2j4.pt").write_bytes(b"half a write")  # a crash mid-write left it
    (out / ".tmp-9x.json").write_text("{")
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipped" in line]
    assert len(warnings) == 2, proc.stderr
    assert "step-00000023.pt: not a readable PyTorch file" in warnings[0]
    assert re.search(r"step-00000020.pt: damaged \(archive/data/\d+ does not match the checksum", warnings[1])
    assert "at step 15" in proc.stdout
    assert not (folder / ".tmp-k2j4.pt").exists() and not (out / ".tmp-9x.json").exists()


def test_resume_auto_exits_2_when_checkpoints_exist_and_none_is_usable(refused):
    # Starting over from step 0 would silently throw the run's progress away.
    r = refused["none-usable"]  # every checkpoint of the copy cut to a third
    assert r["code"] == 2, r["stderr"][-2000:]
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and "--resume auto: none of the 3 checkpoints" in lines[0], r["stderr"]
    assert all(f"step-000000{s}.pt" in lines[0] for s in ("15", "20", "23"))
    assert _files(*r["before"]) == r["before"]


@pytest.mark.parametrize("damage", [*DAMAGED, "fsdp-flipped"])
def test_a_checkpoint_whose_bytes_or_name_are_not_what_was_written_is_refused_before_any_worker(refused, damage):
    r = refused[damage]  # --resume PATH, --nproc 2: step 15's file flipped or renamed, an fsdp shard flipped
    assert r["code"] == 2, r["stderr"][-2000:]
    lines = r["stderr"].strip().splitlines()
    said = DAMAGED[damage][1] if damage in DAMAGED else r"damaged \(__1_0.distcp does not match the checksum"
    assert len(lines) == 1 and f"--resume: checkpoint {r['path']}: " in lines[0]
    assert re.search(said, lines[0]), lines[0]
    assert r["stdout"] == "" and not r["out"].exists()  # no worker started, nothing written


def test_resume_path_will_not_write_into_another_runs_out(refused):
    r = refused["into-another-run"]  # --resume A/checkpoints/step-15.pt --out B, B a run of its own
    assert r["code"] == 2, r["stderr"][-2000:]
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and f"--out {r['out']} holds another run (checkpoints, metrics.jsonl" in lines[0]
    assert _tree(r["out"]) == r["before"]  # nothing of B touched


@pytest.mark.parametrize("change", WRONG_ENTRIES)
def test_a_checkpoint_with_wrong_entries_is_one_line_and_exit_2_before_any_worker(refused, change):
    r, named = refused[change], WRONG_ENTRIES[change][1]  # step 15's checkpoint changed, --nproc 2
    assert r["code"] == 2, r["stderr"][-2000:]
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and f"--resume: checkpoint {r['path']}: damaged" in lines[0] and named in lines[0], lines
    assert r["stdout"] == "" and not r["out"].exists()  # no worker started, nothing written


# A checkpoint ddpkit 0.1's trainer wrote (before it saved through rt.save_state: its step count
# and every rank's random streams were in its run state), made by commit 60ee82d with
# `ddpkit train --epochs 2 --device cpu --nproc 2 --max-steps 5 --model mlp`.
LEGACY = Path(__file__).parent / "legacy" / "step-00000005.pt"


@pytest.mark.slow
def test_a_checkpoint_of_ddpkit_0_1_continues_bit_identical(tmp_path):
    """Resumed, the 0.1 checkpoint ends bit-identical to a checkpoint of today's format holding
    the same weights, optimizer and schedule at the same step: its step count, loader position
    and random streams are read right. (A straight run made here ends within rounding only: its
    first five steps ran on this machine's CPU kernels, the fixture's on its maker's, which may
    differ in the last bit: 1.5e-8 between an AVX2 and an AVX-512 machine.)"""
    run = ("--model", "mlp", "--nproc", "2", "--max-steps", "8")
    shutil.copy(LEGACY, tmp_path / LEGACY.name)
    resumed = train(tmp_path / "resumed", *run, "--resume", str(tmp_path / LEGACY.name))
    assert "at step 5 (epoch 1, step 5 of 23)" in resumed["stdout"]
    straight = train(tmp_path / "straight", *run, "--checkpoint-every", "5")
    assert max_diff(resumed["weights"], straight["weights"]) < 1e-6
    today = torch.load(tmp_path / "straight" / "checkpoints" / LEGACY.name, weights_only=True)
    legacy = torch.load(LEGACY, weights_only=True)
    today.update({key: legacy[key] for key in ("model", "optimizer", "scheduler")})
    torch.save(today, tmp_path / "today.pt")
    again = train(tmp_path / "again", *run, "--resume", str(tmp_path / "today.pt"))
    assert max_diff(resumed["weights"], again["weights"]) == 0


@pytest.mark.slow
def test_a_gpt_checkpoint_with_fused_qkv_is_refused_naming_why(tmp_path):
    """A gpt checkpoint of ddpkit 0.2 (one fused qkv map per block) cannot continue (its optimizer
    state holds one tensor where there are three now): one line, the weights' way out named."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_bytes(bytes(97 + (j * j) % 26 for j in range(3000)))
    shape = ("--gpt-width", "16", "--gpt-depth", "1", "--gpt-heads", "2", "--seq-len", "16")
    run = ("--model", "gpt", "--data", "text", "--text-path", str(corpus), *shape, "--max-steps", "2")
    train(tmp_path / "out", *run, "--checkpoint-every", "2")
    path = tmp_path / "out" / "checkpoints" / "step-00000002.pt"
    state = torch.load(path, weights_only=True)
    model = state["model"]
    for kind in ("weight", "bias"):  # as ddpkit 0.2 saved it
        model[f"block0.attn.qkv.{kind}"] = torch.cat([model.pop(f"block0.attn.{m}.{kind}") for m in "qkv"])
    torch.save(state, tmp_path / "old.pt")
    proc = run_cli(*COMMON, *run, "--resume", str(tmp_path / "old.pt"), "--out", str(tmp_path / "new"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "a gpt of ddpkit 0.2" in lines[0] and "optimizer state cannot continue" in lines[0], (
        lines
    )
