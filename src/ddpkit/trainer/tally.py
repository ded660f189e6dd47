"""What each micro-batch adds to the epoch's figures, kept with the fewest operations per step.

The built-in loop reports the epoch's training loss and accuracy (over every rank) and stops
on the first non-finite loss, naming its step. Adding each micro-batch to running sums and
watching for NaN as it comes costs some twenty small tensor operations a step: on a CPU,
0.1-0.3 ms, a few percent of a small model's step. Instead each micro-batch writes one row on
the device, its loss and correct predictions (the loss's sample or token count and the step it
belongs to stay on the host, as Python numbers), and the rows are read only where the loop
reads the device anyway: the finiteness check at log steps, epoch ends and checkpoints. Nothing
per step waits for the device.

The figures are those of the running sums, in the same float64: a non-finite loss counts in
none of the sums, and the first step with one is found among the rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# A log step runs the loop's check (a collective, and a read of the device) only when this
# long has passed since the last check; the log steps in between wait for it (see LogSteps).
CHECK_EVERY_S = 0.5


class Tally:
    """Rows of (loss, correct) per micro-batch since the last `fold`, on the device."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.rows = torch.zeros((capacity, 2), dtype=torch.float64, device=device)
        self.counts: list[int] = []  # the samples (or tokens) each row's loss is a mean over
        self.steps: list[int] = []  # the step (counted from 1) each row belongs to

    def __len__(self) -> int:
        return len(self.counts)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, n: int, step: int) -> None:
        """A micro-batch of `n` samples (or tokens) of step `step`: its mean `loss`, its
        `correct` predictions (0-d tensors; nothing is read from the device)."""
        k = len(self.counts)
        if k == len(self.rows):  # rows are kept until the next check: grow, never wait
            self.rows = torch.cat([self.rows, torch.zeros_like(self.rows)])
        row = self.rows[k]
        row[0] = loss
        row[1] = correct
        self.counts.append(n)
        self.steps.append(step)

    def step_loss(self, step: int) -> torch.Tensor:
        """The loss summed over the samples of step `step`'s rows, the last ones (0 without
        any): a log step's loss, a non-finite one included."""
        first, k = self._span(step)
        loss = self.rows[first:k, 0]
        return (loss * loss.new_tensor(self.counts[first:k])).sum()

    def bad_in(self, step: int) -> torch.Tensor:
        """Whether a row of step `step`, the last ones, holds a non-finite loss (0-d bool)."""
        first, k = self._span(step)
        return ~self.rows[first:k, 0].isfinite().all()

    def _span(self, step: int) -> tuple[int, int]:
        k = first = len(self.steps)
        while first > 0 and self.steps[first - 1] == step:
            first -= 1
        return first, k

    def watch(self, first_bad: torch.Tensor) -> None:
        """Set `first_bad` (a 0-d long tensor, -1 for none) to the first step whose rows hold
        a non-finite loss, unless it holds one already. Device operations only (on a GPU,
        copying the steps to it waits for it: call it where the loop reads the device anyway)."""
        k = len(self.steps)
        if k == 0:
            return
        finite = self.rows[:k, 0].isfinite()
        steps = torch.tensor(self.steps, dtype=torch.long, device=first_bad.device)
        first = torch.where(finite, steps.new_tensor(torch.iinfo(torch.long).max), steps).min()
        found = (first_bad < 0) & ~finite.all()
        first_bad.copy_(torch.where(found, first, first_bad))

    def fold(self, sums: torch.Tensor) -> None:
        """Add the rows to `sums` (loss x n, correct, n: rows with a finite loss only), then
        forget them. Only where the run's position decides (an epoch's end, a checkpoint), so
        that the float64 sums are added up in the same order in every run of the same
        settings, resumed or not. Device operations (as in `watch`)."""
        k = len(self.counts)
        if k == 0:
            return
        loss, correct = self.rows[:k, 0], self.rows[:k, 1]
        n = loss.new_tensor(self.counts)
        finite = loss.isfinite()
        zero = loss.new_zeros(())
        sums += torch.stack(
            [torch.where(finite, loss * n, zero).sum(), torch.where(finite, correct, zero).sum(), (finite * n).sum()]
        )
        self.counts.clear()
        self.steps.clear()


@dataclass
class LogSteps:
    """Log steps whose records wait for the next check: their loss, summed over the ranks by
    that check's all-reduce, stays on the device until then; and from which step on a log
    step runs the check.

    A check at every log step costs a collective and a wait for the device every --log-every
    steps: on 2 CPU processes about 2 ms each, where the default job's step takes 8 ms. Now a
    log step checks when at least CHECK_EVERY_S have passed since the last check, judged on
    rank 0's clock, whose reading that check shares: every rank decides alike. Epoch ends
    and checkpoints check anyway. The records are written at the check, in order, with the
    values they would have had (each step's own loss, the learning rate and the speed at that
    step); only later, by at most about CHECK_EVERY_S."""

    every: int  # --log-every
    records: list[tuple[dict[str, Any], torch.Tensor | None, int]] = field(default_factory=list)
    due: int = 0  # a log step at or after this step checks
    checked: int = 0  # the step of the last check
    clock: float = field(default_factory=time.perf_counter)  # this rank's clock at the last check

    def __post_init__(self) -> None:
        self.due = self.every

    def add(self, record: dict[str, Any], loss: torch.Tensor | None = None, count: int = 1) -> None:
        """A record to write at the next check; with `loss`, its "loss" is `loss` summed over
        the ranks, divided by `count`."""
        self.records.append((record, loss, count))

    def losses(self) -> list[torch.Tensor]:
        return [loss.reshape(()) for _, loss, _ in self.records if loss is not None]

    def take(self, summed: list[float], before: int | None = None) -> list[dict[str, Any]]:
        """The records, their losses filled from `summed` (the `losses()` summed over the
        ranks, in order), those of steps before `before` only; none wait afterwards."""
        out, values = [], iter(summed)
        for record, loss, count in self.records:
            if loss is not None:
                record = {**record, "loss": next(values) / count}
            if before is None or record["step"] < before:
                out.append(record)
        self.records = []
        return out

    def checked_at(self, step: int, seconds: float) -> None:
        """A check ran at `step`, `seconds` after the one before on rank 0's clock: the next
        one runs at the first log step at least CHECK_EVERY_S later, at the steps' pace."""
        if step > self.checked:
            per_step = max(seconds, 0.0) / (step - self.checked)
            ahead = math.ceil(CHECK_EVERY_S / max(per_step, 1e-9) / self.every) * self.every
            self.due = step + max(self.every, ahead)
        self.checked, self.clock = step, time.perf_counter()


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite. A sum per tensor is finite when all its
    elements are (a NaN or an inf carries through it), and costs a tenth of an `isfinite`
    over each element; only a sum that overflowed (16-bit tensors are summed in float32, so
    only values near float32's or float64's largest can) needs the elementwise look. Reads
    the device once: call it where the loop does anyway."""
    if not tensors:
        return True
    sums = [t.sum(dtype=torch.float32 if t.element_size() < 4 else None) for t in tensors]
    if torch.stack([s.double() for s in sums]).sum().isfinite():
        return True
    return bool(torch.stack([t.isfinite().all() for t in tensors]).all())
