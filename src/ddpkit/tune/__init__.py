"""`ddpkit find-batch-size`: the largest per-device batch that fits, and the throughput curve.

Each size is one trial of real training steps (forward, backward, optimizer step under DDP,
FSDP2, HSDP, tensor or pipeline parallel) on a synthetic batch of that many samples per data
rank (per process, except where a tensor-parallel group or a pipeline shares its samples).

- `search`: the pure search (doubling, then bisection; the knee) and `Trial`;
- `probe`: one trial on one rank (probe below DDP, agree by all-reduce, timed steps);
- `plan`: `Settings` and their resolution from the command line;
- `output`: the table, the conclusion, JSON and plot.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..core.log import print0
from ..launcher import Topology, run_function
from .output import TABLE_HEADER, conclusion, header, nothing_fits, plot, row, shared_samples, summarize
from .plan import Settings, resolve
from .probe import Tuner
from .search import Trial, knee, largest_fit, pick, search

__all__ = [
    "Settings",
    "Trial",
    "Tuner",
    "find",
    "knee",
    "largest_fit",
    "pick",
    "resolve",
    "run",
    "search",
    "summarize",
    "worker",
]


def worker(settings: Settings, probe_hook: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The search on this rank; every rank returns the same result, plus what it saw alone."""
    from ..runtime import Runtime  # in the workers: the launching process never builds one

    with Runtime(
        strategy=settings.strategy,
        mesh=settings.mesh,
        pp_schedule=settings.pp_schedule,
        precision=settings.precision,
        device=settings.device,
        seed=0,
        timeout_s=settings.timeout_s,
    ) as rt:
        tuner = Tuner(rt, settings, probe_hook)
        criterion = settings.resolved_criterion(rt.device.type)
        start = max(settings.start, tuner.smallest)
        layout = f"{rt.strategy} on {rt.layout.spec}" if settings.mesh else rt.strategy
        print0(header(settings, rt.world_size, rt.device.type, layout, probes=not rt.sharded))
        shared = shared_samples(rt.world_size, rt.data_world_size, str(rt.layout.spec))
        if shared:
            print0(shared)
        if start > settings.start:
            print0(f"({tuner.smallest_why}: starting at {start})")
        print0(TABLE_HEADER)

        def trial(size: int, phase: str) -> Trial:
            t = tuner(size, phase)
            print0(row(t))
            return t

        plateau = settings.plateau if criterion == "knee" else 0
        trials = search(trial, start, max(start, settings.max_batch), plateau, tuner.smallest)
        result = summarize(trials, settings, criterion, rt.world_size, rt.device.type, rt.data_world_size)
        result.update(strategy=rt.strategy, mesh=str(rt.layout.spec), rank=rt.rank, local_failures=tuner.local)
        if rt.is_main:
            from ..observe.env import metadata  # rank 0 alone

            result.update(metadata(rt.device.type))
        return result


def run(settings: Settings, topology: Topology, probe_hook: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The search here (one process, or one worker under torchrun / srun) or on the
    topology's local workers; returns the result (rank 0's, with the metadata)."""
    if topology.in_process:
        return worker(settings, probe_hook)
    return run_function(topology, worker, settings, probe_hook)[0]


def find(settings: Settings, topology: Topology, json_path: str | None = None, plot_path: str | None = None) -> int:
    """The command: search, then rank 0 prints the conclusion and writes the JSON and plot.
    0 when a size fits, 1 when none does."""
    # (dist imports torch: after the search, which ran in the workers, the launcher needs it alone)
    from ..core.dist import detect_env
    from ..core.files import write_json

    result = run(settings, topology)
    found = result["per_device_batch"] is not None
    if detect_env().rank != 0:  # under torchrun / srun: rank 0 reports
        return 0 if found else 1
    if not found:
        print(f"ddpkit find-batch-size: {nothing_fits(result)}", file=sys.stderr, flush=True)
    for line in conclusion(result) if found else []:
        print(line, flush=True)
    if plot_path:
        plot(result, plot_path)
        result["plot"] = plot_path
    if json_path:
        write_json(json_path, result)
    return 0 if found else 1
