"""What each micro-batch and each log step leave for the loop's next check, kept with the fewest
operations per step.

The built-in loop reports the epoch's training loss and accuracy (over every rank), writes a
step record with the global batch's loss every --log-every steps, and stops on the first
non-finite loss, naming its step. Adding each micro-batch to running sums and watching for NaN
as it comes cost some twenty small tensor operations a step (on a CPU, 0.1-0.3 ms: a few
percent of a small model's step), and summing each log step's loss over the ranks cost a
collective and a wait for the device. Instead each micro-batch writes one row on the device
(`Tally`), and a log step's record waits (`LogSteps`); both are read at the loop's check, which
reads the device anyway. Nothing per step waits for the device.

The figures are those of the running sums, in the same float64: a non-finite loss counts in
none of the sums, and the first step with one is found among the rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..observe.metrics import seconds_between

# A log step runs the loop's check (a collective, and a read of the device) only when this
# long has passed since the last check; the log steps in between wait for it (see LogSteps).
CHECK_EVERY_S = 0.5

LOSS, CORRECT, COUNT, STEP = range(4)  # a row's columns


class Tally:
    """One row per micro-batch since the last `fold`, on the device: its mean loss, its correct
    predictions, the samples (or tokens) the loss is a mean over, and its step (from 1)."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.rows = torch.zeros((capacity, 4), dtype=torch.float64, device=device)
        self.k = 0  # rows in use
        self.watched = 0  # rows `watch` has looked at
        self._step, self._first = 0, 0  # the last row's step, and that step's first row

    def __len__(self) -> int:
        return self.k

    def add(self, loss: torch.Tensor, correct: torch.Tensor, n: int, step: int) -> None:
        """A micro-batch of `n` samples (or tokens) of step `step`: its mean `loss` and its
        `correct` predictions (0-d tensors, not read: no wait for the device)."""
        k = self.k
        if k == len(self.rows):  # rows are kept until the next fold: grow, never wait
            self.rows = torch.cat([self.rows, torch.zeros_like(self.rows)])
        row = self.rows[k]
        row[LOSS] = loss
        row[CORRECT] = correct
        row[COUNT] = n
        row[STEP] = step
        if step != self._step:
            self._step, self._first = step, k
        self.k = k + 1

    def step_loss(self, step: int) -> torch.Tensor:
        """The loss summed over the samples of step `step`, the last rows' step (0 if it has
        no rows on this rank): a log step's loss, a non-finite one included."""
        rows = self._rows_of(step)
        return (rows[:, LOSS] * rows[:, COUNT]).sum()

    def bad_in(self, step: int) -> torch.Tensor:
        """Whether a row of step `step`, the last rows' step, holds a non-finite loss (0-d bool)."""
        return ~self._rows_of(step)[:, LOSS].isfinite().all()

    def _rows_of(self, step: int) -> torch.Tensor:
        first = self._first if step == self._step else self.k
        return self.rows[first : self.k]

    def watch(self, first_bad: torch.Tensor) -> None:
        """Set `first_bad` (a 0-d long tensor, -1 for none) to the first step whose rows hold
        a non-finite loss, unless it holds one already; rows looked at before are not looked
        at again. Device operations only."""
        rows = self.rows[self.watched : self.k]
        self.watched = self.k
        if not len(rows):
            return
        finite = rows[:, LOSS].isfinite()
        first = torch.where(finite, 2.0**53, rows[:, STEP]).min()  # (steps are exact in float64)
        found = (first_bad < 0) & ~finite.all()
        first_bad.copy_(torch.where(found, first.long(), first_bad))

    def fold(self, sums: torch.Tensor) -> None:
        """Add the rows to `sums` (loss x n, correct, n: rows with a finite loss only), then
        forget them. Called where the run's position decides (an epoch's end, a checkpoint),
        so that every run of the same settings adds the float64 sums up at the same steps.
        Device operations only."""
        if self.k == 0:
            return
        rows = self.rows[: self.k]
        finite = rows[:, LOSS].isfinite().unsqueeze(1)
        kept = torch.where(
            finite, torch.stack([rows[:, LOSS] * rows[:, COUNT], rows[:, CORRECT], rows[:, COUNT]], 1), 0.0
        )
        sums += kept.sum(0)
        self.k = self.watched = 0
        self._step, self._first = 0, 0


@dataclass
class LogSteps:
    """Log steps whose records wait for the next check, and from which step on a log step runs
    that check.

    A check at every log step costs a collective and a wait for the device every --log-every
    steps: on 2 CPU processes about 2 ms each, where the default job's step takes 8 ms. Now a
    log step checks once at least CHECK_EVERY_S have passed since the last check, judged on
    rank 0's clock, whose reading that check shares: every rank decides alike. How many steps
    that is comes from the pace of the steps since the last check, and grows by at most twice
    the last interval at a time. Epoch ends and checkpoints check anyway. The records are
    written at the check, in order, with the values they would have had (each step's own loss
    and learning rate; the speed between two log steps, timed on the device on a GPU); only
    later, by about CHECK_EVERY_S at most while the steps keep their pace. Waiting records are
    lost if the run is interrupted or fails before the next check."""

    every: int  # --log-every
    records: list[tuple[dict[str, Any], torch.Tensor | None, int, tuple | None]] = field(default_factory=list)
    due: int = 0  # a log step at or after this step checks
    checked: int = 0  # the step of the last check
    clock: float = field(default_factory=time.perf_counter)  # this rank's clock at the last check

    def __post_init__(self) -> None:
        self.restart(0)

    def restart(self, step: int) -> None:
        """Start counting at `step` (a run's start, or the step it resumed at): the first log
        step after it checks, and measures the pace."""
        self.checked, self.due, self.clock = step, step + 1, time.perf_counter()

    def add(
        self,
        record: dict[str, Any],
        loss: torch.Tensor | None = None,
        count: int = 1,
        rate: tuple[int, Any, Any] | None = None,
    ) -> None:
        """A record to write at the next check. With `loss`, its "loss" is `loss` summed over
        the ranks, divided by `count`. With `rate` (samples, and the `metrics.stamp`s of the
        moments they ran between), its "samples_per_second"."""
        self.records.append((record, loss, count, rate))

    def losses(self) -> list[torch.Tensor]:
        return [loss.reshape(()) for _, loss, _, _ in self.records if loss is not None]

    def take(self, summed: list[float], before: int | None = None) -> list[dict[str, Any]]:
        """The records, their losses filled from `summed` (the `losses()` summed over the
        ranks, in order) and their rates from their stamps (the device was waited for), those
        of steps before `before` only; none wait afterwards."""
        out, values = [], iter(summed)
        for record, loss, count, rate in self.records:
            if loss is not None:
                record = {**record, "loss": next(values) / count}
            if rate is not None:
                samples, since, at = rate
                record = {**record, "samples_per_second": samples / max(seconds_between(since, at), 1e-9)}
            if before is None or record["step"] < before:
                out.append(record)
        self.records = []
        return out

    def checked_at(self, step: int, seconds: float) -> None:
        """A check ran at `step`, `seconds` after the one before on rank 0's clock: the next
        one runs at the first log step at least CHECK_EVERY_S later at the steps' pace, and at
        most twice as many steps later as this one came after the last."""
        if step > self.checked:
            steps = step - self.checked
            per_step = max(seconds, 0.0) / steps
            ahead = math.ceil(CHECK_EVERY_S / max(per_step, 1e-9) / self.every) * self.every
            self.due = step + max(self.every, min(ahead, 2 * steps))
        self.checked, self.clock = step, time.perf_counter()


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite. A sum per tensor is finite when all its
    elements are (a NaN or an inf carries through it), and costs a tenth of an `isfinite`
    over each element; only a sum that overflowed (16-bit tensors are summed in float32, so
    only values near float32's or float64's largest can) needs the elementwise look. Complex
    tensors are summed as their real and imaginary parts. Reads the device once: call it where
    the loop does anyway."""
    if not tensors:
        return True
    real = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
    sums = [t.sum(dtype=torch.float32 if t.element_size() < 4 else None) for t in real]
    if torch.stack([s.double() for s in sums]).sum().isfinite():
        return True
    return bool(torch.stack([t.isfinite().all() for t in tensors]).all())
