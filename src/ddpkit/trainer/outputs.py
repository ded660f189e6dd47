"""Everything `ddpkit train --out DIR` leaves, written by rank 0 only: metrics.jsonl and
metrics.csv (and the trackers' runs: TensorBoard, MLflow, W&B) as the run goes, through
`ddpkit.observe.tracking`, config.yaml, checkpoints/, and at the end model.pt, results.json and
curves.png; and the summary printed after the run.

Every file is written through `files` (a temp file renamed into place: never through a link),
as strict JSON (NaN and infinity as null). A full disk ends the run with one line naming the
file and the newest checkpoint that is intact.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..checkpoint import save_file, state_of
from ..core.files import FULL_DISK, remove, write_json, write_yaml
from ..errors import RunError
from ..observe import plotter, tracking
from ..observe.timeline import Timeline
from ..runtime.ema import EMA
from .config import TrainConfig
from .resume import CHECKPOINT_NAME, checkpoint_names, newest_checkpoint
from .tasks import task_of

# Where a forked rank 0's results carry curves.png still being drawn (see Outputs.finish)
DRAWING = "_curves_drawing"


def complete(out: str, results: dict[str, Any], timeline: Timeline) -> None:
    """The command's last word on rank 0's `results` once the workers have ended: wait for
    curves.png if rank 0 left it drawing, then write results.json (again, if rank 0 wrote it:
    the timeline has grown by the workers' exit)."""
    results["timeline"]["workers_exited"] = round(timeline.now(), 4)
    drawing = results.pop(DRAWING, None)
    if drawing is not None:
        drawing.wait()
        results["timeline"]["curves_drawn"] = round(timeline.now(), 4)
    write_json(os.path.join(out, "results.json"), results)


class Outputs:
    """Everything `ddpkit train --out DIR` leaves; written by rank 0 only."""

    def __init__(self, cfg: TrainConfig, is_main: bool, resumed_step: tuple[int, int] | None = None):
        self.cfg, self.is_main, self.dir = cfg, is_main, cfg.out
        self.task = task_of(cfg)
        ema = self.task.ema_csv_fields if cfg.ema else ()
        self.csv_fields = ("epoch", "step", *self.task.csv_fields, *ema, "epoch_seconds", "lr")
        self._steps: list[dict[str, Any]] = []  # step and loss of metrics.jsonl's step records, for the plot
        self._sinks: tracking.Tracking | None = None
        self._curves: plotter.Drawing | None = None  # curves.png on its way
        if not is_main:
            return
        try:
            self._open(resumed_step)
        except OSError as err:
            self.__exit__(type(err), err, None)  # closes what is open; a full disk becomes one line
            raise

    def _open(self, resumed_step: tuple[int, int] | None) -> None:
        cfg = self.cfg
        os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
        metrics = os.path.join(self.dir, "metrics.jsonl")
        kept = tracking.read_records(metrics, _until(*resumed_step)) if resumed_step is not None else []
        # A resumed run drops what came after its checkpoint; metrics.csv is rewritten from the
        # kept records, so it always agrees with metrics.jsonl. It continues the trackers' runs.
        self._steps = [{"step": r["step"], "loss": r["loss"]} for r in kept if r.get("type") == "step"]
        self._sinks = tracking.Tracking(
            self.dir,
            [name for name in tracking.TRACKERS if getattr(cfg, name)],
            csv_fields=self.csv_fields,
            csv_select=lambda record: record.get("type") == "epoch",
            kept=kept,
            resume_step=resumed_step[0] if resumed_step is not None else None,
            scalars=tracker_scalars,
        )
        self._sinks.log_params(cfg.to_dict())  # the trackers' params; the file is config.yaml
        write_yaml(os.path.join(self.dir, "config.yaml"), cfg.to_dict())

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        sinks, self._sinks = self._sinks, None
        if sinks is not None:
            sinks.close(exc)
        if isinstance(exc, OSError) and exc.errno in FULL_DISK and exc.filename:
            raise RunError(f"no space left on device writing {exc.filename}; {self.intact()}") from None

    def intact(self) -> str:
        """Which checkpoint a failed write left intact, for the message that ends the run."""
        newest = newest_checkpoint(self.dir)
        if newest is None:
            return "no checkpoint was saved before it"
        step = int(CHECKPOINT_NAME.fullmatch(os.path.basename(newest))[1])  # step-N.pt, or (fsdp) step-N
        return f"checkpoint {step} is intact ({newest})"

    def log(self, record: dict[str, Any]) -> None:
        if self._sinks is None:
            return
        self._sinks.log(record)
        if record.get("type") == "step":
            self._steps.append({"step": record["step"], "loss": record["loss"]})

    def progress(self, loader: Any, epoch: int) -> Any:
        """The loader, wrapped in a progress bar on rank 0 when stderr is a terminal."""
        desc = f"epoch {epoch + 1}/{self.cfg.epochs}"
        return tracking.progress(loader, self.is_main and self.cfg.progress, desc=desc, unit="batch", leave=False)

    def checkpoint_path(self, step: int, sharded: bool = False) -> str:
        """Where step `step`'s checkpoint goes: one file, or (`sharded`: fsdp) a directory."""
        return os.path.join(self.dir, "checkpoints", f"step-{step:08d}" + ("" if sharded else ".pt"))

    def prune_checkpoints(self) -> None:
        """Keep the newest --keep-checkpoints; older ones go only after the new one is complete."""
        if not self.is_main:
            return
        folder = os.path.join(self.dir, "checkpoints")
        for name in checkpoint_names(folder)[: -self.cfg.keep_checkpoints]:
            remove(os.path.join(folder, name))

    def draw_curves(self, history: list[dict[str, Any]]) -> None:
        """Rank 0 starts drawing curves.png from the finished run's records, in a helper
        process if the command started one (see `ddpkit.observe.plotter`); `finish` waits for it, or
        leaves it to the command (see `finish`)."""
        if self.is_main and self._curves is None:
            name, args = self.task.curves(self._steps, history)
            path, title = os.path.join(self.dir, "curves.png"), f"{self.cfg.model} on {self.cfg.data}"
            self._curves = plotter.draw_later(name, args, path, title)

    def finish(
        self,
        results: dict[str, Any],
        model: Any,
        history: list[dict[str, Any]],
        ema: EMA | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        """Rank 0 writes model.pt (and with --ema model_ema.pt), the plot, and results.json
        last (with `timeline`'s moments, "outputs_written" included, under "timeline"): once
        it exists, the run's files are complete. Collective: every rank calls it (an fsdp
        model is gathered whole for model.pt).

        A rank 0 forked from the command whose helper draws the plot waits for neither: it
        hands the drawing back under `results[DRAWING]`, and the command waits for it while
        its workers end, then writes results.json (see `complete`)."""
        weights = state_of(model)  # the bare model's state_dict
        ema_weights = _ema_weights(model, ema) if ema is not None else None
        handed = False
        if self.is_main:
            save_file(os.path.join(self.dir, "model.pt"), weights)
            if ema_weights is not None:
                save_file(os.path.join(self.dir, "model_ema.pt"), ema_weights)
            self.draw_curves(history)  # (started already by the built-in loop)
            handed = self._curves.waited_elsewhere
            if handed:
                results[DRAWING] = self._curves
            else:
                self._curves.wait()
        if timeline is not None:
            timeline.mark("outputs_written")
            results["timeline"] = timeline.seconds()
        if self.is_main and not handed:
            write_json(os.path.join(self.dir, "results.json"), results)

    def summary(self, r: dict[str, Any]) -> str:
        """The `done:` line (scripts parse it), then an aligned table of the run's results."""
        done = (
            f"done: {self.task.headline(r)} | "
            f"{r['steps']} steps, {r['samples_per_second']:,.0f} samples/s on {r['world_size']} x {r['device']} | "
            f"{r['wall_seconds']:.1f} s | outputs in {self.dir}"
        )
        rows = self.task.summary_rows(r) + summary_rows(r)
        width = max(len(k) for k, _ in rows)
        return "\n".join([done, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def _ema_weights(model: Any, ema: EMA) -> dict[str, Any]:
    """The bare model's state_dict holding the EMA's weights and the model's own buffers
    (gathered whole under fsdp: collective). Copied: the weights go back when the block ends."""
    with ema.swapped():
        return {name: value.clone() for name, value in state_of(model).items()}


def tracker_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as the trackers' scalars (train/loss, epoch/test_accuracy, ...),
    which they plot against the optimizer step."""
    if record.get("type") == "step":
        return {f"train/{k}": record[k] for k in ("loss", "lr", "samples_per_second")}
    if record.get("type") != "epoch":
        return {}  # a skipped step: metrics.jsonl says so
    scalars = {
        f"epoch/{name}": record[name]
        for split in ("train", "test")
        for metric in ("loss", "accuracy", "perplexity")  # perplexity: language models only
        for name in (f"{split}_{metric}", f"{split}_{metric}_ema")  # _ema: with --ema
        if name in record
    }
    if record.get("lr") is not None:
        scalars["epoch/lr"] = record["lr"]
    return scalars


def summary_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The final summary table of a results dict, as (label, value) rows, after the task's
    own (its test results: `Task.summary_rows`)."""
    rows = [
        ("train loss", f"{r['final_train_loss']:.4f}" if r.get("final_train_loss") is not None else "-"),
        ("epochs", f"{r.get('epochs_completed', r['epochs'])} of {r['epochs']}, {r['steps']} steps"),
        ("samples/s", f"{r['samples_per_second']:,.0f} on {r['world_size']} x {r['device']}"),
    ]
    if r.get("early_stopped_at_epoch"):
        rows.insert(2, ("early stop", f"after epoch {r['early_stopped_at_epoch']}: the test loss stopped improving"))
    if r.get("step_time_ms"):
        t = r["step_time_ms"]
        rows.append(("step time", f"p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f} ms"))
    if r.get("compile_seconds") is not None:
        rows.append(("compile", f"{r['compile_seconds']:.1f} s"))
    if r.get("peak_memory_mib"):
        kind = "GPU memory" if r.get("peak_memory_kind") == "cuda_max_allocated" else "RSS"
        rows.append((f"peak {kind}", " / ".join(f"{m:,.0f}" for m in r["peak_memory_mib"]) + " MiB per rank"))
    if r.get("mfu") is not None:
        rows.append(("MFU", f"{100 * r['mfu']:.1f}%"))
    if r.get("gpu_utilization_percent") is not None:
        rows.append(("GPU busy", f"{r['gpu_utilization_percent']:.0f}%"))
    rows.append(("wall time", f"{r['wall_seconds']:.1f} s"))
    return rows


def _until(step: int, epochs_done: int) -> Callable[[dict[str, Any]], bool]:
    """Which records of metrics.jsonl a run resumed from a checkpoint keeps: step at most
    `step`, and epoch records only of epochs it completed."""
    return lambda r: r.get("step", 0) <= step and (r.get("type") != "epoch" or r["epoch"] <= epochs_done)
