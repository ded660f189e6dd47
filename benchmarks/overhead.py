"""`python -m benchmarks overhead`: what ddpkit's runtime costs per step, in microseconds.

A model so small that a step is mostly Python (an MLP 32 -> 64 -> 10, batch 32, one thread,
SGD) is trained, in ONE process and alternating, by

  (a) a hand-written loop over tensors held in memory: one permutation per epoch, then per step
      `x[idx]`, the model, `cross_entropy`, `backward`, `opt.step()`,
      `opt.zero_grad(set_to_none=True)`;
  (b) ddpkit's runtime on one process: `rt.loader` over a TensorDataset (resident: batches are
      index gathers, as in (a)), `rt.backward`, `rt.step`;
  (c) the loop (a) with its gathers written `x.index_select(0, idx)`, as ddpkit's loader writes
      them: the same rows, without Python's indexing machinery, which costs (a) a few µs per
      step. The runtime's own bookkeeping is (b) - (c); (b) - (a) is what a user of the loop
      the tutorials write gains or pays.

Both loops are written alike, `loss = ...` then its backward: where the loss tensor (and its
graph's nodes) is freed changes the step by itself, by about 2 to 4 µs on the machine this was
written on (`rt.backward(F.cross_entropy(...))`, which frees it inside the call, is that much
slower than the same runtime with `loss` held to the next step, and so is a hand-written loop
written that way), which is no cost of the runtime.

All read the same samples in the same order (ddpkit's global order for epoch e is
`randperm(n, seed + e)`, which (a) and (c) draw too). Three models, built alike, take turns with
the loops (which loop trains which model rotates every other round), each going through the same
epochs: so a model's place in memory, which moves a step by a µs or more in either direction,
favours no loop; and the models end bitwise equal only if the loops make bitwise the same
updates, which is checked. The rounds are cut into `layouts` groups, each with a fresh set of
models built after a spacer allocation of a random (seeded) size that is kept until the group
ends: so the run averages over several places in memory instead of the one a process happens
to give, which moved whole runs by about a µs.

Each round runs a few epochs of each loop, interleaved one by one (the order rotated every epoch
and every round); every epoch is one block timed with `time.perf_counter` (the permutation
included on every side). A round's value per loop is the median µs/step of its blocks; the
result is the median over all rounds of the paired difference ddpkit - hand-written (and
ddpkit - (c)), with a 95% bootstrap interval of that median that resamples the layouts, then the
rounds within each (so it is as wide as the layouts differ, not only as the rounds do). Paired, interleaved
blocks cancel most of the drift a shared machine adds, which a comparison of separate runs
cannot. No round is left out.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from .paired import bootstrap_median

TARGET_OVERHEAD_US = 2.0  # ddpkit's step minus the hand-written step, µs (median over rounds)
DESCRIPTION = "µs per step of ddpkit's runtime over a hand-written loop on a tiny MLP, one process, alternating"
# (a) the loop tutorials write, (b) ddpkit, (c) (a) gathering as ddpkit's loader does
SIDES = ("hand_written", "ddpkit", "hand_written_select")


@dataclass(frozen=True)
class Work:
    """What both loops train."""

    features: int = 32
    hidden: int = 64
    classes: int = 10
    batch: int = 32
    steps_per_epoch: int = 64  # one timed block
    epochs_per_round: int = 3  # blocks of each side per round
    lr: float = 0.01
    seed: int = 0

    @property
    def samples(self) -> int:
        return self.batch * self.steps_per_epoch


def add_arguments(parser: Any) -> None:
    parser.add_argument("--rounds", type=int, default=0, help="alternating rounds (default 320; --quick 6)")
    parser.add_argument(
        "--layouts", type=int, default=8, help="fresh sets of models the rounds are shared over (default 8)"
    )
    parser.add_argument("--steps", type=int, default=64, help="steps per timed block, one epoch (default 64)")
    parser.add_argument("--note", default="", help="where it ran, in words (kept in the JSON): a shared machine, say")


def run(opts: Any, device: str) -> dict[str, Any]:
    import torch

    from ddpkit.errors import UsageError

    extra = opts.extra
    rounds = extra.get("rounds") or opts.reps(320, 6)
    layouts = min(extra.get("layouts", 8), rounds // 2)
    work = Work(steps_per_epoch=extra.get("steps", 64))
    if rounds < 2 or work.steps_per_epoch < 1 or layouts < 1:
        raise UsageError("--rounds must be at least 2, --steps and --layouts at least 1")
    threads = torch.get_num_threads()
    try:
        return {**_measure(work, rounds, layouts, device), "note": extra.get("note", "")}
    finally:
        torch.set_num_threads(threads)


def _measure(work: Work, rounds: int, layouts: int, device: str) -> dict[str, Any]:
    import torch

    from ddpkit.runtime import Runtime

    with Runtime(strategy="ddp", device=device, seed=work.seed, cudnn_benchmark=False) as rt:
        torch.set_num_threads(1)  # after the Runtime, which sets its own thread count
        loops, spacers = _loops(work, rt), random.Random(work.seed)
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        layout_of, equal = [], True
        for layout, count in enumerate(_shares(rounds, layouts)):
            # Where the new models land in memory: after a spacer of a random size, held until
            # they are done with (freed at once, the models would take its place).
            spacer = torch.empty(spacers.randrange(1, 1 << 15), dtype=torch.uint8, device=device)
            models = [_pair(work, rt) for _ in SIDES]
            for i, side in enumerate(SIDES):  # warm-up: allocator, autograd, the optimizer's state
                loops[side](*models[i])
            for r in range(count):
                _round(work, loops, models, r, times)
            layout_of += [layout] * count
            equal = equal and _equal(*(model for model, _ in models))
            del spacer, models
        return _result(work, rounds, times, layout_of, equal, device)


def _shares(rounds: int, layouts: int) -> list[int]:
    """`rounds` cut into `layouts` shares, as even as can be."""
    base, extra = divmod(rounds, layouts)
    return [base + (i < extra) for i in range(layouts)]


def _round(work: Work, loops: dict[str, Any], models: list[Any], r: int, times: dict[str, list[float]]) -> None:
    """Round `r` of a layout: the loops' epochs interleaved one by one (the order rotated every
    epoch and every round, and reversed every other round, so that each loop follows each other
    one as often), each loop on the model that is its turn (rotated every other round, so that
    no loop keeps the one that happens to sit better in memory)."""
    gc.collect()
    n = len(SIDES)
    blocks: dict[str, list[float]] = {s: [] for s in SIDES}
    for e in range(work.epochs_per_round):
        turn = (r + e) % n
        order = SIDES[turn:] + SIDES[:turn]
        for side in order if r % 2 == 0 else order[::-1]:
            i = SIDES.index(side)
            blocks[side].append(loops[side](*models[(i + r // 2) % n]))
    for side in SIDES:
        times[side].append(statistics.median(blocks[side]) / work.steps_per_epoch * 1e6)


def _pair(work: Work, rt: Any) -> tuple[Any, Any]:
    """A fresh model (the same initial weights every time) and its optimizer, set up by `rt`
    (on one process: moved to the device, not wrapped)."""
    import torch

    model = _model(work)
    return rt.setup(model, torch.optim.SGD(model.parameters(), lr=work.lr))


def _timed(epoch: Any) -> Any:
    """`epoch(model, opt)`, returning its seconds."""

    def run(model: Any, opt: Any) -> float:
        t = time.perf_counter()
        epoch(model, opt)
        return time.perf_counter() - t

    return run


def _loops(work: Work, rt: Any) -> dict[str, Any]:
    """Each loop as a function that trains (model, opt) for one timed epoch. Both count
    epochs alike (one per call), so the models, which take turns with each loop, see the same
    epochs in the same order."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(work.seed)
    x = torch.randn(work.samples, work.features, generator=g).to(rt.device)
    y = torch.randint(0, work.classes, (work.samples,), generator=g).to(rt.device)
    loader = rt.loader(TensorDataset(x, y), batch_size=work.batch, seed=work.seed)
    epoch = [0, 0]  # (a)'s and (c)'s epochs; ddpkit's loader counts its own

    def hand_epoch(model: Any, opt: Any) -> None:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(work.seed + epoch[0])).to(x.device)
        epoch[0] += 1
        for k in range(0, len(x), work.batch):
            idx = order[k : k + work.batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def select_epoch(model: Any, opt: Any) -> None:  # hand_epoch, gathering as (c) says: written out, as a user would
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(work.seed + epoch[1])).to(x.device)
        epoch[1] += 1
        for k in range(0, len(x), work.batch):
            idx = order[k : k + work.batch]
            loss = F.cross_entropy(model(x.index_select(0, idx)), y.index_select(0, idx))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def kit_epoch(model: Any, opt: Any) -> None:
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)  # held to the next step, as (a) holds it (see above)
            rt.backward(loss)
            rt.step(opt)

    return {
        "hand_written": _timed(hand_epoch),
        "ddpkit": _timed(kit_epoch),
        "hand_written_select": _timed(select_epoch),
    }


def _model(work: Work) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(work.seed)
    return nn.Sequential(nn.Linear(work.features, work.hidden), nn.ReLU(), nn.Linear(work.hidden, work.classes))


def _equal(first: Any, *others: Any) -> bool:
    """Whether every model's weights are bitwise those of the first."""
    import torch

    sa = first.state_dict()
    for other in others:
        sb = other.state_dict()
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


def _result(
    work: Work, rounds: int, times: dict[str, list[float]], layout_of: list[int], equal: bool, device: str
) -> dict[str, Any]:
    from ddpkit.bench.common import stats

    layouts = sorted(set(layout_of))

    def paired(base: str) -> dict[str, Any]:
        """ddpkit - `base`, per round: the median, its interval and its median per layout."""
        diffs = [k - h for h, k in zip(times[base], times["ddpkit"])]
        low, high = bootstrap_median(diffs, groups=layout_of)
        per_layout = [statistics.median(d for d, g in zip(diffs, layout_of) if g == k) for k in layouts]
        return {
            "median": statistics.median(diffs),
            "interval95": [low, high],
            "per_round": diffs,
            "per_layout": per_layout,
        }

    over, own = paired("hand_written"), paired("hand_written_select")
    low, high = over["interval95"]
    return {
        "method": (
            f"one process ({device}, 1 thread); {rounds} rounds over {len(layouts)} layouts (a fresh set of models "
            "each, placed after a spacer allocation of a random size), each round running "
            f"{work.epochs_per_round} epochs of {work.steps_per_epoch} steps with each of three loops, interleaved "
            "one by one (the order rotated every epoch and every round), the models rotated between the loops every "
            "other round. An epoch is one block timed with time.perf_counter (the epoch's permutation included on "
            "every side); a round's value per loop is the median µs/step of its blocks. overhead_us: the median over "
            "all rounds of the paired difference ddpkit - hand-written (the loop tutorials write, gathering x[idx]), "
            "with a 95% two-level percentile-bootstrap interval (4000 resamples: the layouts, then the rounds within "
            "each). bookkeeping_us: the same against the hand-written loop gathering with index_select, as ddpkit's "
            "loader does: the runtime's own per-step work. No round is left out."
        ),
        "work": {**asdict(work), "samples": work.samples, "model": "MLP 32-64-10 (Linear, ReLU, Linear), SGD"},
        "rounds": rounds,
        "us_per_step": {side: stats(times[side]) for side in SIDES},
        "us_per_step_per_round": times,
        "overhead_us": over["median"],
        "overhead_us_interval95": over["interval95"],
        "overhead_us_per_round": stats(over["per_round"]),
        "bookkeeping_us": own["median"],
        "bookkeeping_us_interval95": own["interval95"],
        "bookkeeping_us_per_layout": own["per_layout"],
        "layouts": len(layouts),
        "layout_per_round": layout_of,
        "overhead_us_per_layout": over["per_layout"],
        "weights_equal": equal,
        "target_overhead_us": TARGET_OVERHEAD_US,
        "meets_target": high <= TARGET_OVERHEAD_US,
        "resolved": high <= TARGET_OVERHEAD_US or low > TARGET_OVERHEAD_US,
    }


def _verdict(low: float, high: float) -> str:
    return "met" if high <= TARGET_OVERHEAD_US else ("missed" if low > TARGET_OVERHEAD_US else "not resolved")


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    hand, kit, select = (result["us_per_step"][s]["median"] for s in SIDES)
    low, high = result["overhead_us_interval95"]
    own_low, own_high = result["bookkeeping_us_interval95"]
    return [
        ("µs/step hand-written x[idx] / index_select / ddpkit (median)", f"{hand:.1f} / {select:.1f} / {kit:.1f}"),
        (
            "ddpkit overhead per step over x[idx] (median, 95% CI)",
            f"{result['overhead_us']:+.2f} µs [{low:+.2f}, {high:+.2f}] "
            f"(target <= {TARGET_OVERHEAD_US:g}: {_verdict(low, high)})",
        ),
        (
            "its bookkeeping: over index_select (median, 95% CI)",
            f"{result['bookkeeping_us']:+.2f} µs [{own_low:+.2f}, {own_high:+.2f}] "
            f"(<= {TARGET_OVERHEAD_US:g}: {_verdict(own_low, own_high)})",
        ),
        ("final weights bitwise equal", "yes" if result["weights_equal"] else "NO"),
    ]


LABELS = {
    "hand_written": "hand-written, x[idx]",
    "ddpkit": "ddpkit",
    "hand_written_select": "hand-written, index_select",
}


def plot(record: dict[str, Any], path: str) -> None:
    from ddpkit.observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    per_round = r["us_per_step_per_round"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side in SIDES:
        if side in per_round:  # records made before the third loop have two
            left.plot(per_round[side], ".", markersize=3, label=LABELS[side])
    left.set_xlabel("round")
    left.set_ylabel("µs per step (median of the round's epochs)")
    left.legend()
    shown: list[float] = []
    for base, color in (("hand_written", "C0"), ("hand_written_select", "C2")):
        if base not in per_round:
            continue
        diffs = [k - h for h, k in zip(per_round[base], per_round["ddpkit"])]
        shown += diffs
        key = "overhead_us" if base == "hand_written" else "bookkeeping_us"
        low, high = r[f"{key}_interval95"]
        right.hist(diffs, bins=40, color=color, alpha=0.5, label=f"ddpkit - {LABELS[base]}")
        right.axvline(r[key], color=color, label=f"median {r[key]:+.2f} µs [{low:+.2f}, {high:+.2f}]")
        right.axvspan(low, high, color=color, alpha=0.15)
    right.axvline(TARGET_OVERHEAD_US, color="C3", linestyle="--", label=f"target {TARGET_OVERHEAD_US:g} µs")
    if len(shown) >= 100:  # the middle 98% of the rounds: a round or two a burst of other work slowed stay off
        shown.sort()
        low, high = shown[len(shown) // 100], shown[-len(shown) // 100 - 1]
        right.set_xlim(min(low, -TARGET_OVERHEAD_US) - 2, max(high, 2 * TARGET_OVERHEAD_US) + 2)
    right.set_xlabel("ddpkit - hand-written, µs per step, per round")
    right.legend(fontsize=8)
    fig.suptitle(f"runtime overhead per step, tiny MLP, one process ({r['rounds']} rounds)", fontsize=10)
    save_figure(fig, path, dpi=110)
