"""PNG plots. matplotlib is imported here only, with the file-only Agg backend (no display)."""

from __future__ import annotations

import math
import os
from typing import Any

from ..core.files import atomic_write

# Imports inside functions: matplotlib (0.1 s) loads with the first plot, in the plotter
# helper or a command that draws; training processes never import it.


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (imported on first use: it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_margins(title: str) -> dict[str, float]:
    """The margins of the two-panel curves a run draws (curves.png), fixed: matplotlib's tight
    layout draws the whole figure once more to measure it, half of the drawing's time, and this
    figure is drawn at the end of every run. Room for tick labels up to 6 characters and a title."""
    return {"left": 0.08, "right": 0.985, "bottom": 0.12, "top": 0.88 if title else 0.96, "wspace": 0.26}


def save_figure(
    fig: Any,
    path: str,
    dpi: int = 100,
    margins: dict[str, float] | None = None,
    close: bool = True,
    metadata: dict[str, str] | None = None,
) -> None:
    """Lay out (tightly, or with the given `margins`: fractions of the figure), write
    (atomically, never through a link: see files.atomic_write) in the format the file name says
    (PNG without one), and free the figure (pyplot keeps every open one alive) unless `close`
    is False (a figure to draw again). `metadata`: text to keep in the file (matplotlib's
    savefig metadata)."""
    if margins is None:
        fig.tight_layout()
    else:
        fig.subplots_adjust(**margins)
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=os.path.splitext(path)[1][1:].lower() or "png", dpi=dpi, metadata=metadata)
    finally:
        if close:
            pyplot().close(fig)


class Curves:
    """curves.png's figure: loss and accuracy per epoch, train and test, side by side; kept to
    be drawn again. Drawn again with other records, it takes about half the time of a new
    figure (its artists, fonts and text layout are made already: 70 against 135 ms measured) and
    writes the same bytes a new one would. The plot helper keeps one from its warm-up, so the
    curves.png drawn at the end of a run comes sooner (see `ddpkit.observe.plotter`)."""

    def __init__(self) -> None:
        self.fig, axes = pyplot().subplots(1, 2, figsize=(10, 4))
        self.lines = []
        for ax, key in zip(axes, ("loss", "accuracy")):
            (train,) = ax.plot([], [], "o-", label="train")
            (test,) = ax.plot([], [], "s-", label="test")
            ax.set_xlabel("epoch")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
            ax.legend()
            self.lines.append((ax, key, train, test))
        axes[0].set_yscale("log")
        self.title = self.fig.suptitle("")

    @staticmethod
    def redraws(history: list[dict[str, Any]]) -> bool:
        """Whether a kept figure draws `history` as a new one would: every panel has a point it
        can show (a finite value; a positive one on the loss's log axis). An axis with nothing
        to show keeps the limits of the figure's previous drawing, where a new one has its
        defaults (an empty history: --max-steps inside the first epoch)."""

        def shown(key: str, low: float) -> bool:
            values = (h.get(f"{part}_{key}") for h in history for part in ("train", "test"))
            return any(isinstance(v, (int, float)) and math.isfinite(v) and v > low for v in values)

        return shown("loss", 0.0) and shown("accuracy", -math.inf)

    def draw(self, history: list[dict[str, Any]], path: str, title: str = "") -> None:
        epochs = [h["epoch"] for h in history]
        for ax, key, train, test in self.lines:
            train.set_data(epochs, [h[f"train_{key}"] for h in history])
            test.set_data(epochs, [h[f"test_{key}"] for h in history])
            ax.relim()
            ax.autoscale_view()
        self.title.set_text(title)
        save_figure(self.fig, path, dpi=100, margins=curves_margins(title), close=False)

    def close(self) -> None:
        pyplot().close(self.fig)


def plot_curves(history: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Loss and accuracy per epoch, train and test, side by side (a `Curves` drawn once)."""
    curves = Curves()
    try:
        curves.draw(history, path, title)
    finally:
        curves.close()


def plot_token_curves(steps: list[dict[str, Any]], history: list[dict[str, Any]], path: str, title: str = "") -> None:
    """A language model's loss per token and perplexity against the optimizer step: training
    at every logged step (`steps`, metrics.jsonl's step records), test at each epoch's end
    (`history`). A run of one epoch still shows how it learned."""
    plt = pyplot()

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(10, 4))
    train_x, train_loss = [r["step"] for r in steps], [r["loss"] for r in steps]
    test_x, test_loss = [h["step"] for h in history], [h["test_loss"] for h in history]
    for ax, f, label in ((ax_loss, lambda v: v, "loss per token (nats)"), (ax_ppl, math.exp, "perplexity")):
        ax.plot(train_x, [f(v) for v in train_loss], "-", label="train (logged steps)")
        ax.plot(test_x, [f(v) for v in test_loss], "s", markersize=7, label="test (epoch ends)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_ppl.set_yscale("log")
    if title:
        fig.suptitle(title)
    save_figure(fig, path, dpi=100, margins=curves_margins(title))


def plot_runs(
    runs: list[tuple[str, list[dict[str, Any]]]], path: str, title: str = "", metadata: dict[str, str] | None = None
) -> None:
    """Several runs' loss and accuracy per epoch on one figure: one color per run, train
    dashed, test solid. `runs` is (label, epoch records) per run."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, history) in enumerate(runs):
        color = colors[i % len(colors)]
        epochs = [h["epoch"] for h in history]
        for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
            for split, style, marker in (("train", "--", "o"), ("test", "-", "s")):
                values = [h[f"{split}_{key}"] for h in history]
                ax.plot(epochs, values, style, color=color, marker=marker, markersize=3, label=f"{label} {split}")
    for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    ax_loss.set_yscale("log")
    ax_acc.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    save_figure(fig, path, dpi=100, metadata=metadata)


def plot_steps(
    runs: list[tuple[str, list[dict[str, Any]]]],
    names: list[str],
    path: str,
    title: str = "",
    metadata: dict[str, str] | None = None,
) -> None:
    """Several runs' logged metrics against the step: one panel per metric in `names`, one
    color per run. `runs` is (label, step records) per run; a run that did not log a metric is
    absent from its panel."""
    plt = pyplot()
    columns = min(3, max(1, len(names)))
    rows = max(1, math.ceil(len(names) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, names):
        for i, (label, records) in enumerate(runs):
            points = [(r["step"], r[name]) for r in records if type(r.get(name)) in (int, float)]  # not bools
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, color=colors[i % len(colors)], marker="o", markersize=2, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if names:
        axes.flat[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    save_figure(fig, path, dpi=100, metadata=metadata)
