"""Device and core-count facts, and the one resolver of `--device auto|cpu|cuda`.

torch is imported inside the functions: `cpu_count` serves processes that have not imported it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import UsageError
from . import checks

if TYPE_CHECKING:
    import torch  # not at `import ddpkit` or `ddpkit --help`, which read this module

DEVICES = ("auto", "cpu", "cuda")


def cpu_count() -> int:
    """Cores this process may use (respects taskset / cgroup affinity where the OS reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def gpu_count() -> int:
    import torch  # not at `import ddpkit` or `ddpkit --help`, which read this module

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(name: str, local_rank: int = 0, bind: bool = True, what: str = "--device") -> torch.device:
    """`auto` is CUDA when a GPU is visible, else CPU. Each process binds to GPU `local_rank`
    among those CUDA_VISIBLE_DEVICES shows; `bind=False` only checks (a launching parent
    should not create a CUDA context it will never use)."""
    import torch  # not at `import ddpkit` or `ddpkit --help`, which read this module

    checks.choice(what, name, DEVICES)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(f"{what} cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if count == 1:
        index = 0  # one GPU per process (SLURM --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)
    elif local_rank < count:
        index = local_rank
    else:
        raise UsageError(f"local rank {local_rank} has no GPU: only {count} visible; lower --nproc")
    device = torch.device("cuda", index)
    if bind:
        torch.cuda.set_device(device)
    return device


def device_type(name: str, what: str = "--device") -> str:
    """'cpu' or 'cuda': what `name` resolves to here, checked, without touching a GPU."""
    return resolve(name, bind=False, what=what).type


def auto_nproc(device_type: str) -> int:
    """`--nproc auto`: one process per visible GPU; on CPU one process per 4 cores, at least 1.

    CPU processes each run several intra-op threads; small models gain little from more than
    about four threads per process, while every extra process costs start-up and all-reduce
    time. On a 2-core machine this gives a single process with both cores.
    """
    if device_type == "cuda":
        return max(1, gpu_count())
    return max(1, cpu_count() // 4)


def threads_per_process(nproc: int) -> int:
    """Each of `nproc` CPU processes gets its share of the cores: oversubscribed cores make CPU
    DDP several times slower."""
    return max(1, cpu_count() // nproc)
