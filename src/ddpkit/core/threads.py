"""How many threads each CPU process's torch runs, chosen from the cores it may use and how
busy other programs keep them.

torch's thread pool takes every core by default, and a waiting OpenMP thread spins. Two jobs
that each take every core fight over them: on a 2-core machine two `ddpkit train` runs started
together took 64 s where each alone takes 2.6 s, and 3.5 s at one thread each
(benchmarks/results/busy-cpu-before.json). So each process gets its share of the cores it may
use (affinity, a cgroup's CPU quota), less the cores other programs kept busy meanwhile: what
/proc/stat counts on the process's cores since `import ddpkit`, minus this process and its
descendants (ddpkit's own helper and workers, those that ended meanwhile included). The reading
needs a window: in `ddpkit train` and `ddpkit run` it is the time torch took to import. A
window shorter than MIN_WINDOW_S (a script that makes its Runtime right after `import ddpkit`)
is waited out; one older than MAX_WINDOW_S (a notebook's import an hour ago) says little of
now, and a fresh one is read instead.

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
from typing import Any, NamedTuple

from .device import cpu_count

MIN_WINDOW_S = 0.25  # a shorter reading of the load says little: waited out
MAX_WINDOW_S = 10.0  # an older start says little of now: read afresh
MODE = "DDPKIT_THREADS"  # "share": the share of the cores, whatever the load
CHOSEN = "DDPKIT_THREADS_CHOSEN"  # set with OMP_NUM_THREADS by ddpkit's launcher: why that count
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Reading(NamedTuple):
    """Busy time on this process's cores and in its process tree, at one moment, in clock ticks."""

    at: float
    busy: int
    own: int


def usable_cores() -> int:
    """Cores this process may use: its affinity, capped by a cgroup CPU quota (rounded up)."""
    cores = cpu_count()
    quota = cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_quota() -> float | None:
    """The CPU quota in cores of this process's cgroup and those above it (the tightest; v2's
    cpu.max, v1's cfs quota), None when unlimited or unknown."""
    quotas = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:  # hierarchy:controllers:path
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:  # v2: cpu.max in its folder and each one above
            quotas += [_v2_quota(os.path.join("/sys/fs/cgroup", p.lstrip("/"))) for p in _upwards(path)]
        elif "cpu" in controllers.split(","):  # v1's cpu controller, mounted at /sys/fs/cgroup/cpu
            quotas += [_v1_quota(os.path.join("/sys/fs/cgroup/cpu", p.lstrip("/"))) for p in _upwards(path)]
    found = [q for q in quotas if q]
    return min(found) if found else None


def _upwards(path: str) -> list[str]:
    """`path` and each folder above it, up to the root: '/a/b' -> ['/a/b', '/a', '/']."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def physical_cores() -> int:
    """Physical cores among this process's usable ones (hyperthreads of a core counted once)."""
    try:
        siblings = set()
        for cpu in os.sched_getaffinity(0):
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings.add(f.read().strip())
        return max(1, len(siblings))
    except (OSError, AttributeError):
        return cpu_count()


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
    """CPU ticks of this process and its descendants (ddpkit's helper, its workers), with those
    of the descendants they have reaped (cutime, cstime): found through /proc's children lists,
    or by scanning every process where those are not kept."""
    total, todo, seen = 0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        try:
            todo += _children(pid)
        except OSError:
            return _own_ticks_by_scan()
    return total


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            if not os.path.exists(f"/proc/{pid}/task/{task}"):
                continue
            raise
    return found


def _own_ticks_by_scan() -> int:
    """`_own_ticks` from every process's parent, where /proc keeps no children lists."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(v) for v in fields[11:15])
    mine, changed = {os.getpid()}, True
    while changed:  # descendants, however deep
        before = len(mine)
        mine |= {pid for pid, parent in parents.items() if parent in mine}
        changed = len(mine) != before
    return sum(ticks.get(pid, 0) for pid in mine)


_start = read()  # at `import ddpkit`: the window's start
# torch's own thread count, when torch was imported before ddpkit: a later other count is the
# user's torch.set_num_threads (else torch's own is one per usable core, or per physical core
# where it sizes its pool as MKL does)
_torch_at_import = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None


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
    # Free: the quota's cores, or fewer when other programs keep the cores it runs on busy.
    free = max(0, math.floor(min(cores, cpu_count() - busy) + 0.5))
    threads = max(1, min(share, free // processes))
    if threads < share:
        return threads, f"its share of the {of}, less the {busy:.1f} other programs kept busy over {seconds:.1f} s"
    return threads, f"its share of the {of}; other programs kept {busy:.1f} busy over {seconds:.1f} s"


_ours: int | None = None  # the count apply() set last: not the user's


def users_count(torch: Any) -> bool:
    """Whether torch's thread count was set by the user (torch.set_num_threads), not by torch
    itself or by ddpkit."""
    count = torch.get_num_threads()
    if count == _ours:
        return False
    if _torch_at_import is not None:
        return count != _torch_at_import
    return count not in (cpu_count(), physical_cores())


def apply(processes: int, say: bool = True) -> str:
    """Set this process's torch threads for a CPU run of `processes` per machine, unless the user
    set them (OMP_NUM_THREADS, torch.set_num_threads) or ddpkit's launcher did; returns why the
    count is what it is (and, with `say`, says on stderr when a user's count looks harmful)."""
    global _ours
    import torch  # not at `import ddpkit`, which starts this module

    given = os.environ.get("OMP_NUM_THREADS")
    if given and os.environ.get(CHOSEN):
        return os.environ[CHOSEN]
    if given or users_count(torch):
        count = torch.get_num_threads()
        source = f"OMP_NUM_THREADS={given}" if given else f"torch.set_num_threads({count})"
        cores = usable_cores()
        if count * processes > cores and say:
            print(
                f"ddpkit: {source}: {count} thread{'s' if count != 1 else ''} in each of {processes} "
                f"process{'es' if processes != 1 else ''} on {cores} usable core{'s' if cores != 1 else ''}: "
                f"threads will wait for each other ({'unset it' if given else 'leave it out'} and ddpkit chooses)",
                file=sys.stderr,
            )
        return f"{source} (yours)"
    count, why = choose(processes)
    torch.set_num_threads(count)
    _ours = count
    return why
