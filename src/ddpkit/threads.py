"""How many threads each CPU process's torch runs, chosen from the cores it may use and how
busy other programs keep them.

torch's thread pool takes every core by default, and a waiting OpenMP thread spins. Two jobs
that each take every core fight over them: on a 2-core machine two `ddpkit train` runs started
together took 64 s where each alone takes 2.6 s, and 3.5 s at one thread each
(benchmarks/results/busy-cpu.json). So each process gets its share of the cores it may use
(affinity, a cgroup's CPU quota), less the cores other programs kept busy meanwhile: what
/proc/stat counts on those cores since `import ddpkit`, minus this process and its children
(ddpkit's own helper and workers). The reading needs a window: in `ddpkit train` and `ddpkit
run` it is the time torch took to import. A window shorter than MIN_WINDOW_S (a script that
makes its Runtime right after `import ddpkit`) is waited out; one older than MAX_WINDOW_S (a
notebook's import an hour ago) says little of now, and a fresh one is read instead.

A user's OMP_NUM_THREADS, or a count set by `torch.set_num_threads`, is kept; `DDPKIT_THREADS=
share` asks for the share of the cores whatever the load (reruns then use the same count).
The count changes the last bits of results as the number of processes does, so a rerun on a
busier machine may end within rounding of the first, not bit-identical: set either for that.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

from .device import cpu_count

MIN_WINDOW_S = 0.25  # a shorter reading of the load says little: waited out
MAX_WINDOW_S = 10.0  # an older start says little of now: read afresh
MODE = "DDPKIT_THREADS"  # "share": the share of the cores, whatever the load
CHOSEN = "DDPKIT_THREADS_CHOSEN"  # set with OMP_NUM_THREADS by ddpkit's launcher: why that count
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Reading:
    """Busy time on the usable cores and in this process tree, at one moment, in clock ticks."""

    at: float
    busy: int
    own: int


def usable_cores() -> int:
    """Cores this process may use: its affinity, capped by a cgroup CPU quota (rounded up)."""
    cores = cpu_count()
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    """The cgroup's CPU quota in cores (v2 cpu.max, v1 cfs quota), None when unlimited/unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def read() -> Reading | None:
    """Now's reading, or None where /proc cannot say (not Linux)."""
    try:
        cores = os.sched_getaffinity(0)
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit():
                    break
                if int(name[3:]) in cores:
                    v = [int(x) for x in rest.split()[:8]]
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
        return Reading(time.monotonic(), busy, _own_ticks())
    except (OSError, ValueError, AttributeError, IndexError):
        return None


def _own_ticks() -> int:
    """CPU ticks of this process and its descendants (ddpkit's helper, its workers)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    mine, total = {os.getpid()}, 0
    changed = True
    while changed:  # descendants, however deep
        changed = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                changed = True
    for pid in mine:
        total += ticks.get(pid, 0)
    return total


_start = read()  # at `import ddpkit`: the window's start


def others_busy(since: Reading | None = None) -> tuple[float, float] | None:
    """(cores other programs kept busy since `since` (default: `import ddpkit`), the window in s),
    or None where /proc cannot say. A window under MIN_WINDOW_S is waited out; one over
    MAX_WINDOW_S is replaced by a fresh one of MIN_WINDOW_S."""
    start, now = since or _start, read()
    if start is None or now is None:
        return None
    if now.at - start.at > MAX_WINDOW_S:
        start = now
    if now.at - start.at < MIN_WINDOW_S:
        time.sleep(MIN_WINDOW_S - (now.at - start.at))
        now = read()
        if now is None:
            return None
    seconds = now.at - start.at
    busy = (now.busy - start.busy) - (now.own - start.own)
    return max(0.0, busy / _TICK / seconds), seconds


def choose(processes: int) -> tuple[int, str]:
    """Threads for each of `processes` CPU processes on this machine, and why, in words."""
    cores = usable_cores()
    share = max(1, cores // processes)
    of = f"{cores} usable core{'s' if cores != 1 else ''}"
    if processes > 1:
        of += f" among {processes} processes"
    if os.environ.get(MODE) == "share":
        return share, f"its share of the {of}, whatever the load ({MODE}=share)"
    load = others_busy()
    if load is None:
        return share, f"its share of the {of}"
    busy, seconds = load
    free = max(0, round(cores - busy))
    threads = max(1, min(share, free // processes))
    if threads < share:
        return threads, f"its share of the {of}, less the {busy:.1f} other programs kept busy over {seconds:.1f} s"
    return threads, f"its share of the {of}; other programs kept {busy:.1f} busy over {seconds:.1f} s"


_ours: int | None = None  # the count apply() set last: not the user's


def apply(processes: int, say: bool = True) -> str:
    """Set this process's torch threads for a CPU run of `processes` per machine, unless the user
    set them (OMP_NUM_THREADS, torch.set_num_threads) or ddpkit's launcher did; returns why the
    count is what it is (and, with `say`, says on stderr when a user's count looks harmful)."""
    global _ours
    import torch

    given = os.environ.get("OMP_NUM_THREADS")
    if given and os.environ.get(CHOSEN):
        return os.environ[CHOSEN]
    # torch's own count is one per usable core; another one that ddpkit did not set is the user's
    if given or torch.get_num_threads() not in (cpu_count(), _ours):
        count = torch.get_num_threads()
        source = f"OMP_NUM_THREADS={given}" if given else "torch.set_num_threads"
        cores = usable_cores()
        if count * processes > cores and say:
            print(
                f"ddpkit: {source}: {count} thread{'s' if count != 1 else ''} in each of {processes} "
                f"process{'es' if processes != 1 else ''} on {cores} usable core{'s' if cores != 1 else ''}: "
                "threads will wait for each other (unset it and ddpkit chooses)",
                file=sys.stderr,
            )
        return f"{source} (yours)"
    count, why = choose(processes)
    torch.set_num_threads(count)
    _ours = count
    return why
