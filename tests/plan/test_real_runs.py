"""The plan's memory against real runs (issue 30's goal 1): each layout's per-rank peak as
traced on fake tensors, against the same tracker's peak over a real step of ddpkit's Runtime on
1, 2 and 4 gloo processes, for gpt and a CNN, and the 3-D pipeline on 8. One job per process count runs all its cases.

Every case within the goal's 5% of the real peak. And within a bound of its own, so that a
change is seen, where the real peak came at the trace's moment of the step (as many gradients
held: it did in every case here), leaving out the collective buffers that the real run holds
at its peak and the trace does not: whether gloo's thread still holds one then is a matter of
timing (gpt fp32 fsdp over 2 once held a 66,048-byte buffer, the size of the root unit's
parameters, and came out 1.6% off; gpt bf16 hsdp 2x2 once 33,024 bytes, 1.8% off, in a run of
the suite one test at a time). Within 1% here, tensor parallel with activation checkpointing
within 3% (8% before the trace warmed DTensor's caches up).

Gloo's worker thread lets a finished collective's work go, and with it the tensors the work
holds, only after it has woken the waiting thread (ProcessGroupGloo::runLoop): for a moment the
real run may hold them beside what comes next. Tensor parallel's gathered logits showed it: the
trace of gpt bf16 tp 4 came out 6% below the real peak in one CI run, gpt fp32 tp 2 12% below
in another, each time by exactly the logits all-gather's input and output (160 KiB; 768 KiB).
Those count as activations (allocated in the forward), so a case matches with or without one
all-gather's tensors (`held`).

The CNN under fsdp and hsdp peaks in the reduce-scatter of its large linear unit, where gloo
(which has no reduce-scatter of its own) all-reduces a whole copy of the unit's gradients: the
trace was 10% and 21% low until it held that copy too (`trace.GlooCopies`, for gloo runs only:
NCCL makes none).
"""

import pytest

from ddpkit.plan.pipeline import stage_ranks
from ddpkit.plan.run import Spec
from ddpkit.plan.trace import Layout
from ddpkit.plan.verify import measured_ranks, predicted

# Not `alone` (tests/parallel.py) since 2026-12-07: a real run's peak depends on when gloo's
# threads let buffers go, which another process's load may move, but tp 2's 13% under --processes
# came with it as without it, and `held` accounts for it; alone, the other process waited and a
# core idled for a fifth of its minute.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
GOAL = 0.05  # issue 30's goal 1: the predicted peak within 5% of the real one


def _gpt(precision):
    return Spec("gpt", (64,), 256, 8, precision, "adamw", {"width": 64, "depth": 2, "heads": 4})


def _cnn(precision):
    return Spec("cnn", (3, 16, 16), 10, 8, precision, "adamw", {})


CASES = {
    1: [
        (_gpt("fp32"), Layout("ddp", "dp=1", True, 4), 0.01),
        (_cnn("fp32"), Layout("ddp", "dp=1", False, 8), 0.01),
    ],
    2: [
        (_gpt("fp32"), Layout("ddp", "dp=2", True, 2), 0.01),  # two micro-batches of 2
        # 0.06% alone and under load; 1.6% once in a whole run: a 66,048-byte collective buffer
        # alive at the real peak (the spawned real run's timing? not explained yet)
        (_gpt("fp32"), Layout("fsdp", "dp=2", False, 4), 0.02),
        (_gpt("fp32"), Layout("tp", "dp=1,tp=2", False, 8), 0.01),
        (_cnn("fp32"), Layout("fsdp", "dp=2", True, 2), 0.01),
        # each stage against its rank (1f1b, four micro-batches of 2): 0.984, 0.996 (2026-12-08;
        # stage 0 0.972 until the trace held what gloo's send works hold: `pipeline.gloo_sends`)
        (_gpt("fp32"), Layout("pp", "pp=2", False, 2), 0.02),
        # gpipe's trace (the plan's schedule where a step's rows are fewer than the stages), at one
        # micro-batch of 8 through 2 stages: 0.998, 0.998 (2026-12-07; four of 2: 0.969, 0.998)
        (_gpt("fp32"), Layout("pp", "pp=2", False, 8, "gpipe"), 0.02),
    ],
    4: [
        (_gpt("bf16"), Layout("ddp", "dp=4", False, 2), 0.01),
        (_gpt("bf16"), Layout("fsdp", "dp=4", True, 1), 0.01),
        (_gpt("bf16"), Layout("hsdp", "replicate=2,dp=2", False, 2), 0.01),
        (_gpt("bf16"), Layout("tp", "dp=2,tp=2", False, 2), 0.01),
        # 0.1% here, every time (30 runs); 6.0% in one CI run: the logits all-gather's 160 KiB held
        (_gpt("bf16"), Layout("tp", "dp=1,tp=4", False, 4), 0.01),
        # 1.2% alone; 2.4% once in a whole run (2026-12-06): its peak 34 KB above the usual, of which
        # 32 KiB the size of the logits all-gather's input
        (_gpt("fp32"), Layout("tp", "dp=2,tp=2", True, 1), 0.03),
        # 0.02% (9.5% and 21% to 24% before the trace held gloo's reduce-scatter copy)
        (_cnn("fp32"), Layout("hsdp", "replicate=2,dp=2", False, 2), 0.01),
        (_cnn("bf16"), Layout("fsdp", "dp=4", False, 2), 0.01),
        # a stage per child (embed, block0, block1, head): 0.983, 0.998, 0.998, 0.992 (2026-12-08;
        # stage 2 0.981 before gloo's sends were held)
        (_gpt("bf16"), Layout("pp", "pp=4", False, 2), 0.02),
        # two pipelines of two stages, each stage under DDP over its two data ranks (ranks 0 and 2)
        (_gpt("fp32"), Layout("pp", "pp=2,dp=2", False, 2), 0.04),
        # one pipeline of two stages, each stage's layers split over its two tp ranks: 0.994, 0.995
        # (2026-12-08; 0.970 for stage 0 before gloo's sends were held)
        (_gpt("bf16"), Layout("pp", "pp=2,tp=2", False, 2), 0.02),
    ],
    8: [
        # 3-D: two pipelines of two stages, each stage's layers split over tp and sharded over dp
        # (ranks 0 and 2 share a stage's shards): 0.996, 0.996 (2026-12-08; stage 0 0.966 before
        # gloo's sends were held)
        (_gpt("bf16"), Layout("pp", "pp=2,dp=2,tp=2", False, 2), 0.02),
    ],
}


def held(trace) -> list[float]:
    """What gloo's worker thread may still hold beside the real peak (see above): nothing, or
    one of the step's all-gathers' input, output, or both (a rank's bytes, and its group's)."""
    gathers = {(op.bytes, len(op.ranks)) for op in trace.ops if op.kind == "all_gather"}
    return [0.0] + sorted(float(b * k) for b, n in gathers for k in (1, n, 1 + n))


def off(trace, real: float) -> float:
    """How far the trace's peak is from `real`, as a fraction: the nearest of it with `held`."""
    return min(abs((trace.peak + extra) / real - 1) for extra in held(trace))


@pytest.mark.parametrize("nproc", [1, 2, 4, 8])
def test_predicted_peak_memory_matches_a_real_run(nproc):
    cases = [(spec, layout) for spec, layout, _ in CASES[nproc]]
    guessed = predicted(cases, nproc)
    ranks = measured_ranks(cases, nproc, timed_steps=1)
    compared = []  # (case, its trace, its real run): rank 0's; a pipeline's stages, each its rank's
    for i, ((spec, layout, bound), g) in enumerate(zip(CASES[nproc], guessed)):
        stages = g if isinstance(g, list) else [g]
        compared += [((spec, layout, bound), t, ranks[stage_ranks(layout, s)[0]][i]) for s, t in enumerate(stages)]
    assert sum(isinstance(g, list) for g in guessed) == sum(layout.strategy == "pp" for _, layout, _ in CASES[nproc])
    for (spec, layout, bound), g, r in compared:
        name = f"{spec.model} {spec.precision} {layout.label} {g.computed[-1] if layout.strategy == 'pp' else ''}"
        assert r["layout"] == layout.label
        # the goal, on the whole peak (or the case's own bound, where that is wider)
        assert off(g, r["peak"]) <= max(GOAL, bound), (name, g.memory, r["memory"])
        # each case's own bound, on the peak without the collective buffers the trace has not
        # (whether gloo's thread still holds one at the real peak is a matter of timing), where
        # the real peak came at the trace's moment of the step: as many gradients held. gpt bf16
        # hsdp 2x2 peaked once in a fresh clone's whole run (2026-12-06) in the backward, with
        # 133 KB of gradients and 300 KB of collective buffers where its trace peaks at the
        # forward's end with none: 3% off on the whole peak, and no like-for-like comparison
        same_moment = abs(g.memory["gradients"] - r["memory"]["gradients"]) <= 0.01 * r["peak"]
        untimed = r["peak"] - max(0.0, r["memory"]["communication"] - g.memory["communication"])
        assert not same_moment or off(g, untimed) <= bound, (name, g.memory, r["memory"])
        # what does not depend on the moment of the peak: the optimizer's state
        assert g.memory["optimizer"] == pytest.approx(r["memory"]["optimizer"], rel=0.01), name
