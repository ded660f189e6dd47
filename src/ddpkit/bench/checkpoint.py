"""`ddpkit bench checkpoint`: what writing fsdp's sharded checkpoints in the background saves.

Two processes train an MLP sharded with fsdp (AdamW, so a checkpoint holds three times the
weights), and save a checkpoint directory through `Runtime.save` (DCP, each rank its own
shards) in two ways:

- `foreground`: `dcp.save`; training waits until every rank's shards are on disk;
- `background`: `dcp.async_save` on a process group of its own; training waits only while
  DCP copies the rank's shards to memory, and the write finishes in a thread.

Rank 0 then writes the size and CRC-32 of every file of the directory into its checksums.json
(in the foreground while the other ranks wait; in the background in the writing thread), and
reads them all again before any resume: `checksums_seconds` is that reading, timed apart.

For each repetition it times, on the slowest rank, how long training stood still (the call),
how long until the checkpoint was complete, and a block of training steps run while the
write is under way, against the same block with no write (what the background thread costs
the steps beside it). On CPU, the background write competes with training for the same
cores, which a GPU job's host does not.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "fsdp's sharded checkpoints: time training stands still, written in the foreground vs the background"

MODES = ("foreground", "background")


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--width",
        type=int,
        default=0,
        help="hidden width of the 4-layer MLP (default 1536: 7M parameters; --quick 256)",
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp folder, removed)")


def run(opts: Any, device: str) -> dict[str, Any]:
    from ..errors import UsageError
    from ..launcher import launch

    width = opts.extra.get("width") or (256 if opts.quick else 1536)
    if width < 1:
        raise UsageError(f"--width {width}: must be at least 1")
    reps = opts.reps(5, quick=2)
    root = opts.extra.get("dir")
    if root is not None and not os.path.isdir(root):
        raise UsageError(f"--dir {root}: not a directory")
    with tempfile.TemporaryDirectory(dir=root) as folder:
        per_rank = launch(_worker, width, reps, folder, nproc=2, device=device)
    rows = {}
    for mode in MODES:
        blocked = [max(r[mode]["blocked"][i] for r in per_rank.values()) for i in range(reps)]
        complete = [max(r[mode]["complete"][i] for r in per_rank.values()) for i in range(reps)]
        steps = [max(r[mode]["steps"][i] for r in per_rank.values()) for i in range(reps)]
        rows[mode] = {
            "blocked_seconds": _stats(blocked),
            "complete_seconds": _stats(complete),
            "steps_seconds": _stats(steps),
        }
    plain = [max(r["plain_steps"][i] for r in per_rank.values()) for i in range(reps)]
    first = next(iter(per_rank.values()))
    fg, bg = rows["foreground"]["blocked_seconds"]["median"], rows["background"]["blocked_seconds"]["median"]
    return {
        "processes": 2,
        "parameters": first["parameters"],
        "checkpoint_bytes": first["bytes"],
        "steps_per_block": first["block"],
        "modes": rows,
        "plain_steps_seconds": _stats(plain),
        "blocked_ratio_background_to_foreground": bg / fg if fg else None,
        # rank 0 reads the whole directory once for its checksums: inside a foreground save's
        # wait, in the writing thread of a background one, and before a resume loads it
        "checksums_seconds": _stats(per_rank[0]["checksums"]),
    }


def _stats(values: list[float]) -> dict[str, Any]:
    from .common import stats

    return stats(values)


def _worker(width: int, reps: int, folder: str, block: int = 4) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ..checkpoint import shards
    from ..runtime import Runtime

    with Runtime("fsdp", device="cpu", seed=0) as rt:
        model = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
        )  # fmt: skip
        parameters = sum(p.numel() for p in model.parameters())
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

        def steps() -> float:
            t0 = time.perf_counter()
            for _ in range(block):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        steps()  # warm-up, and the optimizer's state exists
        out: dict[str, Any] = {"parameters": parameters, "block": block, "plain_steps": [], "checksums": []}
        for mode in MODES:
            out[mode] = {"blocked": [], "complete": [], "steps": []}
        for i in range(reps):
            out["plain_steps"].append(steps())
            for mode in MODES:
                path = os.path.join(folder, f"{mode}-{i}")
                rt.barrier()
                t0 = time.perf_counter()
                pending = rt.save(path, background=mode == "background", model=model, optimizer=opt)
                out[mode]["blocked"].append(time.perf_counter() - t0)
                out[mode]["steps"].append(steps())  # beside the write under way (background)
                if pending is not None:
                    pending.wait()
                out[mode]["complete"].append(time.perf_counter() - t0)
                rt.barrier()
                if rt.is_main:
                    out["bytes"] = sum(e.stat().st_size for e in os.scandir(path))
                    if mode == "foreground":  # what rank 0 adds to a save, and a resume to a load:
                        t0 = time.perf_counter()  # reading every file once for its CRC-32
                        shards.verify(path)
                        out["checksums"].append(time.perf_counter() - t0)
        return out


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot

    plt = pyplot()
    r = record["result"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = ["training stood still", "checkpoint complete"]
    for j, mode in enumerate(MODES):
        values = [r["modes"][mode]["blocked_seconds"]["median"], r["modes"][mode]["complete_seconds"]["median"]]
        ax.barh([k + 0.38 * j for k in range(2)], values, height=0.36, label=mode)
    ax.set_yticks([k + 0.19 for k in range(2)], labels)
    ax.set_xlabel("seconds (median, slowest of 2 ranks)")
    mb = r["checkpoint_bytes"] / 2**20
    ax.set_title(f"fsdp checkpoint of {r['parameters'] / 1e6:.1f}M parameters + AdamW ({mb:.0f} MiB), 2 processes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    m = result["modes"]
    return [
        ("fsdp checkpoint, training stood still (fg)", f"{m['foreground']['blocked_seconds']['median'] * 1e3:.0f} ms"),
        ("fsdp checkpoint, training stood still (bg)", f"{m['background']['blocked_seconds']['median'] * 1e3:.0f} ms"),
        ("fsdp checkpoint complete after (bg)", f"{m['background']['complete_seconds']['median'] * 1e3:.0f} ms"),
        (
            "its checksums, read by rank 0",
            f"{result['checksums_seconds']['median'] * 1e3:.0f} ms for {result['checkpoint_bytes'] / 2**20:.0f} MiB",
        ),
    ]
