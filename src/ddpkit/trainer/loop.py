"""The built-in training loop behind `ddpkit train`, on top of `Runtime`.

`train(cfg)` runs in the launching process: it resolves the plan (every check, exit 2), then
runs `fit` in this process (one process) or on the plan's workers. `fit` reads top to bottom:
build, resume, epochs of train + exact evaluation + checkpoint, outputs.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from typing import Any

import torch

from .. import data
from ..checkpoint.shards import Pending
from ..core import dist
from ..core.memory import peak_memory_mib
from ..errors import Interrupted, NotSaveState
from ..launcher import restart_note, run_function
from ..observe.metrics import GpuUtilization, StepTimer, flops_per_sample, peak_tflops, stamp
from ..observe.timeline import Timeline, gc_paused
from ..optim import build_optimizer, warmup_cosine
from ..runtime import Runtime
from ..runtime.early_stopping import EarlyStopping
from ..runtime.ema import EMA
from ..strategy import local, unwrap
from ..version import __version__
from .config import TrainConfig
from .outputs import Outputs, complete
from .plan import RunPlan, build_model, make_plan
from .resume import RunState, after_restart, last_checkpoint, runtime_entry
from .tally import LogSteps, Tally, all_finite
from .tasks import task_of


def train(cfg: TrainConfig, timeline: Timeline | None = None) -> dict[str, Any]:
    """Resolve the plan for `cfg`, then run `fit` on this process or on the plan's workers.
    `timeline`: where the run marks its moments (results.json's "timeline"); `ddpkit train`
    passes one that starts with its process, by default it starts with this call."""
    t0 = time.time()
    timeline = timeline if timeline is not None else Timeline(time.monotonic())
    plan = make_plan(cfg)
    timeline.mark("checks_done")
    try:
        if plan.topology.in_process:  # no agent needed: nothing to restart, no one to coordinate
            return fit(plan, t0, timeline)
        # fit says why a restart happened itself, with where it resumes
        results = run_function(plan.topology, fit, plan, t0, timeline, announce_restarts=False)
        if 0 in results:  # this machine holds rank 0: curves.png and results.json are finished here
            complete(plan.out, results[0], timeline)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: say where --resume auto would carry on
        raise Interrupted(getattr(err, "signum", signal.SIGINT), last_checkpoint(plan.out)) from None
    return next(iter(results.values()))  # every rank returns the same results (but its timeline)


def fit(plan: RunPlan, t0: float, timeline: Timeline | None = None) -> dict[str, Any]:
    """One worker's whole run. Every rank returns the same results dict (its "timeline" is
    the rank's own: rank 0's is written). `timeline`: the launching process's, or a new one."""
    cfg = plan.cfg
    timeline = timeline if timeline is not None else Timeline(time.monotonic())
    if not plan.topology.in_process:
        timeline.mark("workers_started")
    with Runtime(
        cfg.strategy,
        cfg.precision,
        plan.topology.device_type,
        seed=cfg.seed,
        timeout_s=cfg.timeout,
        channels_last=cfg.channels_last,
        compile=cfg.compile,
        ddp=plan.ddp,
        fsdp=plan.fsdp,
        activation_checkpointing=cfg.activation_checkpointing,
        activation_checkpointing_mode=cfg.activation_checkpointing_mode,
        mesh=cfg.mesh,
        pp_schedule=cfg.pp_schedule,
    ) as rt:
        timeline.mark("process_group_ready")
        # Under torchrun each rank made its own plan and clock: rank 0's win.
        if rt.is_main and (restart := after_restart(cfg, plan.in_shape, plan.num_classes)):
            plan = dataclasses.replace(plan, resume=restart)
        plan = rt.broadcast_object(plan)
        with gc_paused():  # the first optimizer imports torch's compiler: objects that stay
            loop = Loop(rt, plan, timeline)  # rt.setup() inside gives each rank its own random stream
        rt.print(
            f"ddpkit train: {cfg.model} on {cfg.data} ({len(loop.splits.train)} train / "
            f"{len(loop.splits.test)} test), {rt.world_size} x {rt.device.type} {rt.strategy}, "
            f"global batch {cfg.batch_size}, {cfg.precision}"
        )
        # After a restart, one line: why it happened (rank 0 reads the failed attempt's records) and where it resumes.
        note = restart_note() if rt.is_main else None
        if plan.resume is not None:
            loop.restore(plan.resume, note)
        elif note:
            rt.print(f"ddpkit train: {note}; no checkpoint was written yet: starting again from step 0")
        resumed_at = (loop.run.step, loop.run.epoch) if plan.resume else None
        with Outputs(plan.cfg, rt.is_main, resumed_step=resumed_at) as out:
            results = loop.run_all(out, t0)
        rt.print(out.summary(results))
        dist.wait_for_main()  # rank 0 wrote model.pt, results.json and the plot alone
        return results


class Loop:
    """The built-in loop's parts, built once per worker: data, model, optimizer, schedule."""

    def __init__(self, rt: Runtime, plan: RunPlan, timeline: Timeline | None = None):
        cfg = plan.cfg
        self.rt, self.plan, self.cfg = rt, plan, cfg
        self.timeline = timeline if timeline is not None else Timeline(time.monotonic())
        # (For --data synthetic the input shape is the synthetic shape; other sets ignore it.)
        self.splits = data.load(
            cfg.data,
            data_dir=cfg.data_dir,
            synthetic_shape=plan.in_shape,
            synthetic_size=cfg.synthetic_size,
            num_classes=plan.num_classes,
            seed=cfg.seed,
            text_path=cfg.text_path,
            seq_len=cfg.seq_len,
        )
        self.timeline.mark("data_loaded")
        if isinstance(self.splits.train, data.ImageSet):
            self.splits.train.augment = plan.augment
        self.task = task_of(cfg)
        # Under fsdp, ranks other than 0 build on the meta device; setup() fills them from rank 0.
        model = rt.build(lambda: build_model(cfg, plan.in_shape, plan.num_classes))
        if cfg.sync_batchnorm and rt.world_size > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        opt = build_optimizer(cfg.optimizer, model.parameters(), plan.peak_lr, cfg.momentum, cfg.weight_decay)
        self.model, self.opt = rt.setup(model, opt)
        self.ema = EMA(self.model, cfg.ema) if cfg.ema else None  # after setup: fsdp's shards
        self.train_loader = rt.loader(
            self.splits.train,
            cfg.batch_size,
            micro_batch_size=cfg.micro_batch_size,
            num_workers=cfg.num_workers,
            resident=plan.resident,
        )
        self.test_loader = rt.eval_loader(
            self.splits.test, cfg.eval_batch_size, num_workers=cfg.num_workers, resident=plan.resident
        )
        self.timer = StepTimer(rt.device)
        self.gpu_util: GpuUtilization | None = None
        steps = self.train_loader.steps_per_epoch
        total = cfg.epochs * steps
        factor = warmup_cosine(total, min(total, round(cfg.warmup_epochs * steps)), plan.warmup_start)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor)
        self.run = RunState(cfg, rt.device)
        self.samples = 0  # trained on by this attempt (these worker processes), all ranks together
        self.tokens = 0  # the same in tokens (language models)
        self.train_seconds = 0.0  # this attempt's time in finished train_epoch calls
        self.epoch_t0: float | None = None  # when the train_epoch under way started
        self.carried: dict[str, Any] | None = None  # a checkpoint's throughput figures (see throughput)
        # What each micro-batch adds to the epoch's sums, read at the next check (see tally).
        self.tally = Tally(rt.device)
        self.log_steps = LogSteps(cfg.log_every)  # their records wait for the next check
        self.progress_note: str | None = None  # the last step record's loss and speed, for the bar
        self.progress_said = time.monotonic()  # when the last progress line was printed (no terminal)
        # First step whose loss was not finite, on this rank (-1: none; not watched with
        # --on-nonfinite skip). On the device, filled from the tally: no synchronization per step.
        self.first_bad = torch.full((), -1, dtype=torch.long, device=rt.device)
        self.pending: Pending | None = None  # a checkpoint still being written (fsdp)
        self.checkpoint_seconds = 0.0  # training's time waiting on checkpoints, this attempt
        # The last epoch end's step, test results and (with --ema) the EMA weights' test results.
        self.last_eval: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self.checked_at: int | None = None  # the step check_finite last passed at
        self.closed_at: int | None = None  # the step the last epoch ended at (its sums then zeroed)
        self.timeline.mark("model_ready")

    def flops_on_meta(self) -> float | None:
        """FLOPs per sample counted on a copy of the model built on the meta device: FLOPs depend
        on shapes only, and under fsdp no rank should make a full copy in memory."""
        try:
            with torch.device("meta"):
                net = build_model(self.cfg, self.plan.in_shape, self.plan.num_classes)
        except Exception:  # noqa: BLE001 - a user's model that cannot be built on meta: not counted
            return None
        return flops_per_sample(net, self.plan.in_shape, torch.device("meta"), self.vocab())

    def vocab(self) -> int | None:
        """The vocabulary of a model of token ids (what its FLOPs are counted on), else None."""
        return self.plan.num_classes if self.task.unit == "tokens" else None

    def restore(self, path: str, restart: str | None = None) -> None:
        """Continue from the checkpoint at `path`; `restart` says why, after a restart."""
        try:
            state = self.rt.load_state(path, **self.checkpointed())
        except NotSaveState:  # ddpkit 0.1's trainer kept the step count and streams in its run state
            state = None  # (loaded again outside the handler, whose traceback holds the first read)
        if state is None:
            state = self.rt.load(path, **self.checkpointed(), **self.rt._entries())
            self.rt._resume(runtime_entry(state["run"]))
        self.run.restore(state, self.rt)
        self.carried = state["run"].get("throughput")
        why = f"ddpkit train: {restart}; " if restart else ""
        self.rt.print(f"{why}resumed from {path} at step {self.run.step} ({self.position()})")

    def checkpointed(self) -> dict[str, Any]:
        """What a checkpoint holds besides rt.save_state's own entries (model, optimizer,
        loader, precision, the step count and random streams) and the run state (see save)."""
        return {"scheduler": self.sched, **({"ema": self.ema} if self.ema is not None else {})}

    def position(self) -> str:
        if self.run.epoch >= self.cfg.epochs or self.stopped() or self.early_stopped():
            # A restart after the last checkpoint: no epoch is left to train (nor to print).
            return "training had finished; evaluating and writing the outputs"
        loader = self.train_loader
        return f"epoch {self.run.epoch + 1}, step {loader.position} of {loader.steps_per_epoch}"

    def stopped(self) -> bool:
        return self.cfg.max_steps is not None and self.run.step >= self.cfg.max_steps

    def early_stopped(self) -> bool:
        """--early-stop-patience said stop (the same on every rank: see EarlyStopping.step)."""
        return self.run.early_stop is not None and self.run.early_stop.stopped

    def run_all(self, out: Outputs, t0: float) -> dict[str, Any]:
        self.gpu_util = GpuUtilization(self.rt.device) if self.rt.is_main else None
        self.log_steps.restart(self.run.step)  # (a resumed run: the pace is measured again)
        started = time.monotonic()
        while self.run.epoch < self.cfg.epochs and not self.stopped() and not self.early_stopped():
            self.epoch_t0 = t_epoch = time.perf_counter()
            done = self.train_epoch(out)
            self.train_seconds += time.perf_counter() - t_epoch
            self.epoch_t0 = None
            if done:
                self.end_epoch(out, time.perf_counter() - t_epoch)
            self.save(out)
        self.mark_training(started)
        if self.checked_at != self.run.step:  # (the last checkpoint checked these weights)
            self.check_finite(out)
        self.wait_for_checkpoint()
        out.draw_curves(self.run.history)  # the records are final: drawn while the run ends
        ev, ema = self.final_evaluation()
        basis = self.throughput()
        rate = basis["samples"] / max(basis["train_seconds"], 1e-9)
        results = {**self.results(ev, rate, time.time() - t0, basis), **ema}
        results["samples_per_second_basis"] = basis
        # How long training stood still for checkpoints (fsdp writes them in the background).
        results["checkpoint_seconds"] = round(self.checkpoint_seconds, 4)
        results.update(self.performance(rate))
        out.finish(results, self.model, self.run.history, self.ema, self.timeline)
        return results

    def final_evaluation(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The final weights' test results, and the EMA weights' ({} without --ema): those of
        the last epoch's end when no step came after it (the same weights: evaluating them
        changes nothing), else new evaluations. Collective."""
        if self.last_eval is not None and self.last_eval[0] == self.run.step:
            return self.last_eval[1], self.last_eval[2]
        return self.task.evaluate(self.rt, self.model, self.test_loader), self.evaluate_ema()

    def mark_training(self, started: float) -> None:
        """The timeline's first step (its end from the step timer: no clock read in the loop;
        on a GPU, device time) and the end of training; `started`: before the first epoch."""
        self.timer.flush()
        if self.timer.warmup:  # the first step is always a warm-up step (its shape is new)
            self.timeline.mark("first_step_done", started + self.timer.warmup[0])
        self.timeline.mark("training_done")

    def figures(self) -> dict[str, Any]:
        """The samples this attempt trained on and its training seconds so far (evaluation
        and end-of-epoch checkpoints apart)."""
        seconds = self.train_seconds + (time.perf_counter() - self.epoch_t0 if self.epoch_t0 else 0.0)
        tokens = {"tokens": self.tokens} if self.task.unit == "tokens" else {}
        return {"samples": self.samples, **tokens, "train_seconds": seconds}

    def throughput(self) -> dict[str, Any]:
        """What samples_per_second divides: this attempt's figures; or, when it trained nothing
        (the workers were restarted after the last checkpoint), the figures of the attempt that
        trained, saved in that checkpoint, rather than a rate of 0."""
        if self.samples == 0 and self.carried:
            return {**self.carried, "measured_by": "the attempt before the restart"}
        return {**self.figures(), "measured_by": "this attempt"}

    def say_progress(self, batches: Any) -> None:
        """Without a progress bar (stderr is not a terminal: a log file, a batch job), rank 0
        prints a line with the bar's facts every --progress-every seconds, at a log step."""
        every = self.cfg.progress_every
        if not (self.rt.is_main and self.cfg.progress and every and self.progress_note):
            return
        if not getattr(batches, "disable", True):  # the bar is shown: it says all this
            return
        now = time.monotonic()
        if now - self.progress_said >= every:
            self.progress_said = now
            print(
                _progress_line(self.cfg, self.run, self.train_loader, self.progress_note), file=sys.stderr, flush=True
            )

    def train_epoch(self, out: Outputs) -> bool:
        """Train until the epoch ends (True) or --max-steps is reached (False). The epoch's
        loss and accuracy stay on the device, a row per micro-batch (see tally); the check at
        its end adds them up over the ranks."""
        rt, cfg, run = self.rt, self.cfg, self.run
        self.model.train()
        tally, skip = self.tally, cfg.on_nonfinite == "skip"
        batches = out.progress(self.train_loader, run.epoch)
        cuda = rt.device.type == "cuda"
        t_log, logged = stamp(cuda), self.samples  # on a GPU an event: read at the check
        self.timer.start()
        for x, y in batches:
            n = self.train_loader.current.count  # what the loss is a mean over: samples, or tokens
            if rt.pipelined:  # the step's micro-batches go through the schedule at its last one
                for loss, correct, count in rt.forward_backward(self.model, x, y, self.task.loss, self._measure):
                    tally.add(loss, correct, count, run.step + 1)
            else:
                try:
                    logits = self.model(x)
                    loss = self.task.loss(logits, y)
                except torch.cuda.OutOfMemoryError:
                    raise torch.cuda.OutOfMemoryError(self._oom_advice(len(x))) from None
                rt.backward(loss)
                if n:
                    tally.add(loss.detach(), self.task.correct(logits.detach(), y), n, run.step + 1)
            if skip and rt.step_ready and self._skip_step():
                pass  # no update on any rank: the step's data is spent, the schedule moves on
            elif not rt.step(self.opt, max_grad_norm=cfg.max_grad_norm):
                continue  # more micro-batches of this global batch to come
            elif self.ema is not None:
                self.ema.update()
            self.sched.step()
            self.timer.mark(tuple(x.shape))
            run.step += 1
            self.samples += self.train_loader.current.step_size
            self.tokens += self.train_loader.current.step_count
            if run.step % cfg.log_every == 0:  # every rank: the loss is summed over all of them
                now = stamp(cuda)
                lr = self.sched.get_last_lr()[0]  # loss and speed are filled in at the check (LogSteps.take)
                record = {
                    "type": "step",
                    "epoch": run.epoch + 1,
                    "step": run.step,
                    "loss": None,
                    "lr": lr,
                    "samples_per_second": None,
                }
                rate = (self.samples - logged, t_log, now)  # the samples since (this epoch's)
                self.log_steps.add(record, tally.step_loss(run.step), self.train_loader.current.step_count, rate)
                t_log, logged = now, self.samples
                if run.step >= self.log_steps.due:
                    self.check_finite(out)
                    if self.progress_note and hasattr(batches, "set_postfix"):
                        batches.set_postfix_str(self.progress_note)
                    self.say_progress(batches)
            if self.stopped() and self.train_loader.position < self.train_loader.steps_per_epoch:
                return False  # stopped inside the epoch; at its last step the loop ends it as usual
            if cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
                self.save(out)
        return True

    def _measure(self, logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipelined micro-batch's correct predictions and count: its samples, or its real
        tokens (a language model's padding is `data.IGNORE`)."""
        return self.task.correct(logits, y), (y != data.IGNORE).sum() if self.task.unit == "tokens" else len(y)

    def _skip_step(self) -> bool:
        """True (and the gradients dropped) if any rank saw a non-finite loss in this step.
        Collective: one scalar all-reduce per step, paid only with --on-nonfinite skip."""
        bad = self.rt.any_rank(bool(self.tally.bad_in(self.run.step + 1).item()))  # every process decides
        if bad:
            self.opt.zero_grad(set_to_none=True)
            self.run.skipped += 1
            # written at the next check, after the step records before it
            self.log_steps.add(
                {"type": "skip", "epoch": self.run.epoch + 1, "step": self.run.step + 1, "reason": "non-finite loss"}
            )
        return bad

    def _oom_advice(self, n: int) -> str:
        micro = max(1, n // 2)
        return (
            f"CUDA out of memory on rank {self.rt.rank} with {n} samples per forward (global batch "
            f"{self.cfg.batch_size} over {self.rt.world_size} processes). The global batch can stay: add "
            f"--micro-batch-size {micro} to accumulate gradients over smaller forwards (same result), "
            f"or use --precision bf16"
        )

    def check_finite(self, out: Outputs, epoch_sums: bool = False) -> list[float]:
        """Stop the run, on every rank alike, if any rank has seen a non-finite loss (naming the
        first step and the rank(s)) or the weights are no longer finite. Collective; runs at log
        steps (see `LogSteps`) and before anything is saved, so no file ever holds weights
        trained on NaN. Writes the log steps' records that waited for it to `out` (those before
        a bad step). With `epoch_sums`, the tally's rows are added to the epoch's sums first,
        and the sums added up over the ranks are returned (loss x n, correct, n)."""
        # One all-gather (float64: a step count is exact to 2**53) of each rank's first bad
        # step (+1; 0: none), whether its weights (its shards, under fsdp) are all finite, its
        # clock since the last check (rank 0's is the one used), the epoch's sums, the log
        # steps' losses. They are added up here, exactly rounded: the same whatever the number
        # of records waiting or the collective's order of additions.
        rt, logs = self.rt, self.log_steps
        if self.cfg.on_nonfinite != "skip":
            self.tally.watch(self.first_bad)
        if epoch_sums:
            self.tally.fold(self.run.sums)
        finite = all_finite([local(p) for p in self.model.parameters()])
        own = torch.tensor([float(finite), time.perf_counter() - logs.clock], dtype=torch.float64, device=rt.device)
        facts = torch.cat([(self.first_bad + 1).double().reshape(1), own])
        sums, k = ([self.run.sums], len(self.run.sums)) if epoch_sums else ([], 0)
        losses = logs.losses()
        rows = dist.gather_rows(torch.cat([facts, *sums, *(loss.double().reshape(1) for loss in losses)]))
        firsts = [int(row[0]) - 1 for row in rows]
        finite_ranks, n = sum(int(row[1]) for row in rows), len(rows)
        # The sums and losses of each data rank once (tensor-parallel ranks share their samples).
        counted = [row for r, row in enumerate(rows) if rt.layout.leads(r)]
        totals = [_total(column) for column in zip(*counted)][3:]
        logs.checked_at(self.run.step, rows[0][2])
        seen = [f for f in firsts if f >= 0]
        for record in logs.take(totals[k:], before=min(seen) if seen else None):
            out.log(record)
            if record["type"] == "step":
                self.progress_note = progress_label(record["loss"], record["samples_per_second"])
        if not seen and finite_ranks < n:
            raise FloatingPointError(
                f"the weights hold NaN or inf after step {self.run.step}; stopped before "
                f"saving them. Try a lower --lr or --warmup-epochs"
            )
        if seen:
            step = min(seen)
            ranks = ", ".join(str(r) for r, f in enumerate(firsts) if f == step)
            hint = "a lower --lr or --warmup-epochs" + (", or --precision fp32" if self.cfg.precision != "fp32" else "")
            raise FloatingPointError(
                f"non-finite training loss at step {step} on rank {ranks} (peak lr "
                f"{self.plan.peak_lr:g}); stopped before saving it. Try {hint}"
            )
        self.checked_at = self.run.step
        return totals[:k]

    def end_epoch(self, out: Outputs, seconds: float) -> None:
        rt, run = self.rt, self.run
        loss, correct, count = self.check_finite(out, epoch_sums=True)  # in the check's collective
        run.sums.zero_()
        self.closed_at = run.step
        count = count or float("nan")  # every step skipped: say so rather than divide by zero
        ev, ema = self.task.evaluate(rt, self.model, self.test_loader), self.evaluate_ema()
        self.last_eval = (run.step, ev, ema)
        record = {
            "type": "epoch",
            "epoch": run.epoch + 1,
            "step": run.step,
            **self.task.epoch_fields(loss, correct, count, ev),
            **ema,
            "epoch_seconds": seconds,
            "lr": self.sched.get_last_lr()[0],
        }
        run.history.append(record)
        run.epoch += 1
        out.log(record)
        rt.print(f"epoch {run.epoch:>3}/{self.cfg.epochs}  {self.task.epoch_line(record)}")
        if run.early_stop is not None and run.early_stop.step(ev["loss"], rt) and run.epoch < self.cfg.epochs:
            rt.print(early_stop_line(run.early_stop, run.epoch))

    def evaluate_ema(self) -> dict[str, Any]:
        """The EMA weights' test results (`test_loss_ema`, ...), or {} without --ema."""
        if self.ema is None:
            return {}
        with self.ema.swapped():
            return self.task.ema_fields(self.task.evaluate(self.rt, self.model, self.test_loader))

    def save(self, out: Outputs) -> None:
        """A checkpoint of everything the run needs to continue, on any number of processes.
        Collective: every rank calls it at the same step. Never saves weights trained on NaN.
        Under fsdp every rank writes its own shards in the background while training goes
        on; the next save (and the end of the run) waits for it first."""
        if self.checked_at == self.run.step and self.closed_at == self.run.step:
            sums = [0.0] * len(self.run.sums)  # checked as the epoch ended: its sums start again at 0
        else:
            sums = self.check_finite(out, epoch_sums=True)  # the epoch's sums so far, over all ranks
        self.wait_for_checkpoint()
        t0 = time.perf_counter()
        run_state = {**self.run.state_dict(self.rt, sums), "throughput": self.figures()}
        sharded = self.rt.sharded
        self.pending = self.rt.save_state(
            out.checkpoint_path(self.run.step, sharded),
            background=sharded,
            on_complete=out.prune_checkpoints,
            **self.checkpointed(),
            run=run_state,
        )
        self.checkpoint_seconds += time.perf_counter() - t0

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint being written in the background (if any) is complete."""
        if self.pending is not None:
            t0 = time.perf_counter()
            pending, self.pending = self.pending, None
            pending.wait()
            self.checkpoint_seconds += time.perf_counter() - t0

    def performance(self, rate: float) -> dict[str, Any]:
        """Step-time percentiles (rank 0's; warm-up and compilation apart), peak memory of
        every rank, and on GPUs the model FLOP utilization and the GPU's own utilization.
        Collective: every rank calls it."""
        rt, cfg = self.rt, self.cfg
        timing = self.timer.summary()
        memory = [round(m, 1) for m in rt.gather_objects(peak_memory_mib(rt.device))]
        perf: dict[str, Any] = {
            **timing,
            "peak_memory_mib": memory,
            "peak_memory_kind": "cuda_max_allocated" if rt.device.type == "cuda" else "rss",
        }
        if cfg.compile and "step_time_ms" in timing:
            # Warm-up steps cost a step plus the compilation of their shape.
            perf["compile_seconds"] = max(
                0.0, timing["warmup_seconds"] - timing["warmup_steps"] * timing["step_time_ms"]["p50"] / 1e3
            )
        flops = None
        if rt.is_main and not rt.sharded:
            flops = flops_per_sample(unwrap(self.model), self.plan.in_shape, rt.device, self.vocab())
        elif rt.is_main:  # a sharded forward on rank 0 alone would wait for the others: count a copy
            flops = self.flops_on_meta()
        flops = rt.broadcast_object(flops)
        perf["flops_per_sample"] = flops
        perf["achieved_tflops"] = flops * rate / 1e12 if flops else None
        peak = peak_tflops(rt.device, cfg.precision)
        perf["peak_tflops_per_device"] = peak
        perf["mfu"] = perf["achieved_tflops"] / (peak * rt.devices) if peak and flops else None
        util = self.gpu_util.stop() if self.gpu_util is not None else None
        perf["gpu_utilization_percent"] = rt.broadcast_object(util)
        return perf

    def results(self, ev: dict[str, Any], rate: float, wall: float, basis: dict[str, Any]) -> dict[str, Any]:
        cfg, run, rt = self.cfg, self.run, self.rt
        last = run.history[-1] if run.history else {}
        return {
            **self.task.result_fields(ev, last, basis),
            "train_samples": len(self.splits.train),
            "world_size": rt.world_size,
            "global_batch_size": cfg.batch_size,
            "micro_batch_size": cfg.micro_batch_size,
            "epochs": cfg.epochs,
            "epochs_completed": run.epoch,
            "steps": run.step,
            "stopped_early": (self.stopped() or self.early_stopped()) and run.epoch < cfg.epochs,
            "early_stopped_at_epoch": run.epoch if self.early_stopped() and run.epoch < cfg.epochs else None,
            "ema": cfg.ema,
            "final_train_loss": last.get("train_loss"),
            "final_train_accuracy": last.get("train_accuracy"),
            "samples_per_second": rate,
            "wall_seconds": wall,
            "device": rt.device.type,
            "threads": torch.get_num_threads(),
            "threads_why": rt.threads,
            "strategy": rt.strategy,
            "mesh": str(rt.layout.spec),
            "precision": cfg.precision,
            "seed": cfg.seed,
            "lr": cfg.lr,
            "peak_lr": self.plan.peak_lr,
            "max_grad_norm": cfg.max_grad_norm,
            "model": cfg.model,
            "data": cfg.data,
            "resumed_from_step": run.start_step,
            "skipped_steps": run.skipped,
            "ddpkit_version": __version__,
            "torch_version": torch.__version__,
        }


def _total(values: tuple[float, ...]) -> float:
    """The exactly rounded sum (the same whatever the order), or nan where +inf meets -inf."""
    try:
        return math.fsum(values)
    except ValueError:
        return math.nan


def early_stop_line(stopper: EarlyStopping, epoch: int) -> str:
    """What rank 0 prints when --early-stop-patience ends the run."""
    by = f" by more than {stopper.min_delta:g}" if stopper.min_delta else ""
    return (
        f"early stop after epoch {epoch}: the test loss has not improved{by} for {stopper.bad_checks} "
        f"epoch{'s' if stopper.bad_checks != 1 else ''} (best {stopper.best:.4f})"
    )


def _progress_line(cfg: Any, run: Any, loader: Any, note: str) -> str:
    """'ddpkit train: epoch 2/10, step 120/230 of it (52%), loss 0.8123, 7,041 samples/s'."""
    of = loader.steps_per_epoch  # ddpkit train's loaders are map-style: the epoch's length is known
    where = f"step {loader.position}/{of} of it ({100 * loader.position / max(1, of):.0f}%)"
    return f"ddpkit train: epoch {run.epoch + 1}/{cfg.epochs}, {where}, {note}"


def progress_label(loss: float, rate: float) -> str:
    """What the progress bar shows after the batch count: the loss and the throughput, with
    its unit (tqdm's set_postfix would print a key, samples_s=...)."""
    return f"loss {loss:.4f}, {rate:,.0f} samples/s"
