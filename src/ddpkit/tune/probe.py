"""One trial of `ddpkit find-batch-size` on one rank: probe, agree, then timed steps.

Out-of-memory on one rank must not leave the others waiting in a collective. DDP all-reduces
gradients inside backward (and may broadcast buffers inside forward), so a rank that fails
half-way through a DDP step strands its peers there. A trial therefore runs in two phases:

1. probe: one forward and backward of the bare module, not the DDP wrapper (no collectives at
   all), with out-of-memory caught and the memory released on the rank where it happens;
2. agree: one all-reduce of a per-rank failure code; every rank sees the same verdict, and only
   if every rank fitted do all of them run the timed DDP steps.

So every rank runs the same sequence of collectives whatever happens on any one of them, and
the size chosen fits on every rank (the minimum over ranks).

Under fsdp (and hsdp, tp and pp) no forward is free of collectives (each shard unit all-gathers its parameters), so
there is no step to probe with below the strategy: the ranks agree on a verdict reached before
any step (on CPU, and under fsdp on CUDA too, a size whose memory, extrapolated from the last
size that fitted, would exceed what is available), then run fsdp's real steps on every rank,
each rank as many forwards as the others. An out-of-memory error inside those steps ends the
search with the size to rerun below, as it does in DDP's timed steps.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from .. import models
from ..core import dist
from ..core.memory import available_mib, peak_memory_mib, reset_peak_memory, rss_mib
from ..observe.metrics import time_calls
from ..optim import build_optimizer
from ..strategy import find_ddp, micro_batch_size
from .plan import Settings
from .search import Trial

CPU_MEMORY_HEADROOM = 0.8  # a CPU trial may use at most this share of the available memory
CUDA_MEMORY_HEADROOM = 0.9  # fsdp on CUDA: of the memory this process's allocator could still get

# What a rank reports for a trial in the agreement all-reduce (0: it fitted).
OOM, PREDICTED = 1, 2
REASONS = {OOM: "out of memory", PREDICTED: "predicted to exceed available memory"}


def is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator's RuntimeError that says it ran out."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class Tuner:
    """Runs trials on one rank: probe, agree, then the timed steps.

    `probe_hook(rank, per_device_batch)` runs at the start of every probe, inside the
    out-of-memory handling; tests use it to make one rank fail above a size.
    """

    def __init__(self, rt: Any, settings: Settings, probe_hook: Callable[[int, int], None] | None = None):
        self.rt, self.s, self.hook = rt, settings, probe_hook
        model = models.build(settings.model, settings.in_shape, settings.num_classes, **settings.model_options())
        # The optimizer's state counts in the memory; its learning rate does not matter here.
        lr, decay = (1e-4, 0.01) if settings.optimizer == "adamw" else (1e-3, 0.0)
        opt = build_optimizer(settings.optimizer, model.parameters(), lr, momentum=0.9, weight_decay=decay)
        # BatchNorm cannot train on one sample where its input is 1x1 (one value per channel).
        batchnorms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
        self.smallest, self.smallest_why = 1, ""  # the smallest size that can train, and why if above 1
        if any(isinstance(m, batchnorms) for m in model.modules()):
            self.smallest, self.smallest_why = 2, "the model has BatchNorm, which trains on 2 samples or more"
        stages = rt.layout.spec.size("pp")
        if stages > 1 and settings.pp_schedule == "1f1b":
            self.smallest, self.smallest_why = (
                stages,
                f"1f1b runs one micro-batch per stage at least, {stages}; gpipe runs fewer",
            )
        self.model, self.opt = rt.setup(model, opt)
        # The probe runs the module inside DDP (with its autocast, if any): no collectives.
        ddp = find_ddp(self.model)
        self.bare = ddp.module if ddp is not None else self.model
        self.sharded = rt.sharded  # no probe step (see the module docstring)
        self._allocate_optimizer_state()
        self.cuda = rt.device.type == "cuda"
        self.base_rss = rss_mib()
        self.base_cuda_mib = torch.cuda.memory_allocated(rt.device) / 2**20 if self.cuda else 0.0
        self.last_fit: tuple[int, float] | None = None  # (size, this rank's peak) of the last fit
        self.local: dict[int, str] = {}  # what this rank alone saw: size -> reason it failed here

    def _allocate_optimizer_state(self) -> None:
        """One optimizer step on zero gradients, the same on every rank: momentum (or Adam's
        moments) then exists before the first probe, which so measures a steady-state step."""
        for p in self.bare.parameters():
            p.grad = torch.zeros_like(p.detach())  # fsdp: a DTensor sharded as its parameter
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def batch(self, n: int, key: int | None = None) -> tuple[Any, Any]:
        """`n` synthetic samples, the same on every rank of a data rank (a tensor-parallel group
        or a pipeline reads one batch), or with `key` the same on every rank: images and
        labels, or token sequences and next tokens."""
        g = torch.Generator().manual_seed(n * 1_000_003 + (self.rt.data_rank if key is None else key))
        vocab, shape = self.s.num_classes, (n, *self.s.in_shape)
        x = torch.randint(0, vocab, shape, generator=g) if self.s.language else torch.randn(shape, generator=g)
        y = torch.randint(0, vocab, shape if self.s.language else (n,), generator=g)
        return x.to(self.rt.device), y.to(self.rt.device)

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per sample, or per token of a language model's (B, T, vocabulary) logits."""
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    def __call__(self, size: int, phase: str) -> Trial:
        code = self.probe(size)
        if code:
            self.local[size] = REASONS[code]
        world, samples = self.rt.world_size, size * self.rt.data_world_size  # the global batch
        codes = torch.zeros(world, dtype=torch.float32, device=self.rt.device)
        codes[self.rt.rank] = code
        dist.all_reduce(codes)  # the agreement: every process learns every process's verdict
        failed = [r for r in range(world) if codes[r] > 0]
        if failed:
            reason = REASONS[int(codes[failed[0]].item())]
            return Trial(size, samples, False, failed_ranks=failed, reason=reason, phase=phase)
        step_s, peak = self.timed(size)
        self.last_fit = (size, peak)
        worst = torch.tensor([step_s, peak], dtype=torch.float64, device=self.rt.device)
        dist.all_reduce(worst, op="max")  # the slowest, fullest process
        step_s, peak = worst.tolist()
        return Trial(
            size,
            samples,
            True,
            samples_per_s=samples / step_s,
            step_ms=1000 * step_s,
            peak_memory_mib=round(peak, 1),
            phase=phase,
        )

    def probe(self, size: int) -> int:
        """0 if one forward and backward of `size` samples fits on this rank, else a reason code."""
        if self._predicted_too_big(size):
            return PREDICTED
        reset_peak_memory(self.rt.device)
        try:
            self._probe_step(size)
            code = 0
        except Exception as err:  # anything but out-of-memory is re-raised
            if not is_oom(err):
                raise
            code = OOM
        # Outside the except block: the exception (and the frames holding the batch and the
        # activations) is gone by now, so the memory can actually be released.
        self.opt.zero_grad(set_to_none=True)
        self._release(collect=code == OOM)
        return code

    def _probe_step(self, size: int) -> None:
        if self.hook is not None:
            self.hook(self.rt.rank, size)
        if self.sharded:  # every forward would all-gather: the timed steps run after the agreement
            return
        x, y = self.batch(size)
        self.rt.backward(self.loss(self.bare(x), y))

    def timed(self, size: int) -> tuple[float, float]:
        """(median seconds per step, this rank's peak memory in MiB) over the timed steps."""
        try:
            times = self._time_steps(size)
        except Exception as err:
            if is_oom(err):  # the peers are inside the step's collectives: this run cannot go on
                fitted = "" if self.sharded else ", after a probe of that size fitted"
                rerun = (
                    f"rerun with --max-batch {size - 1}"
                    if size - 1 >= self.smallest
                    else f"no smaller size can train ({self.smallest_why or 'one sample'})"
                )
                raise RuntimeError(
                    f"out of memory in the {self.rt.strategy} step at per-device batch {size}{fitted}; {rerun}"
                ) from None
            raise
        peak = peak_memory_mib(self.rt.device)
        self._release()
        return statistics.median(times), peak

    def _time_steps(self, size: int) -> list[float]:
        if self.rt.pipelined:
            return self._time_pipeline(size)
        x, y = self.batch(size)  # one batch, reused: the timing is of the step, not of data

        def step() -> None:
            self.rt.backward(self.loss(self.model(x), y))
            self.rt.step(self.opt)

        return time_calls(step, self.rt.device, repeats=self.s.steps, warmup=self.s.warmup)

    def _time_pipeline(self, size: int) -> list[float]:
        """Under pp, a step is a data rank's `size` samples as micro-batches through the schedule,
        one per stage (or a few more: `strategy.micro_batch_size`), as ddpkit train cuts them; the
        loader hands them out from one global batch, the same on every rank, as in training."""
        stages, ranks = self.rt.layout.spec.size("pp"), self.rt.data_world_size
        batches = self.rt.loader(
            TensorDataset(*self.batch(size * ranks, key=0)),
            batch_size=size * ranks,
            shuffle=False,
            micro_batch_size=micro_batch_size(size, stages),
        )

        def step() -> None:
            for xs, ys in batches:  # one global batch: one step
                self.rt.forward_backward(self.model, xs, ys, self.loss)
                self.rt.step(self.opt)

        return time_calls(step, self.rt.device, repeats=self.s.steps, warmup=self.s.warmup)

    # -- memory ---------------------------------------------------------------------------------
    def _release(self, collect: bool = False) -> None:
        """Hand freed memory back. Tensors die with their last reference; a full collection
        (a quarter of a second with torch loaded) is for after a failure, in case something
        on the failed path formed a reference cycle."""
        if collect:
            gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def _predicted_too_big(self, size: int) -> bool:
        """Whether `size` would need more than the memory the machine has left, extrapolated
        linearly from the last size that fitted. On CPU: on Linux the alternative is not an
        exception to catch but the kernel's OOM killer ending the worker. On CUDA under fsdp
        only: elsewhere the probe catches the allocator's error below the strategy."""
        if self.last_fit is None:
            return False
        if self.cuda:
            return self.sharded and self._cuda_predicted_too_big(size)
        fitted, peak = self.last_fit
        predicted = self.base_rss + (peak - self.base_rss) * size / fitted
        growth = (predicted - rss_mib()) * self.rt.env.local_world_size  # every local rank grows alike
        available = available_mib()
        return available is not None and growth > CPU_MEMORY_HEADROOM * available

    def _cuda_predicted_too_big(self, size: int) -> bool:
        """The CUDA memory tensors would take at `size` (peak allocated, extrapolated) against what
        this process's allocator holds plus what the device still has free. Not run on a GPU yet."""
        fitted, peak = self.last_fit  # type: ignore[misc]
        predicted = self.base_cuda_mib + (peak - self.base_cuda_mib) * size / fitted
        free, _ = torch.cuda.mem_get_info(self.rt.device)
        reachable = (free + torch.cuda.memory_reserved(self.rt.device)) / 2**20
        return predicted > CUDA_MEMORY_HEADROOM * reachable
