"""What the built-in loop trains and measures: a classifier (the image models) or a language
model (`--model gpt`). The loop is the same; a task says what the loss of a micro-batch is,
what a micro-batch adds to the epoch's sums, how the test set is evaluated, and how an epoch
and a run are reported.

Both keep the epoch's sums as (loss x count, correct, count), where the count is samples for
a classifier and real (non-padding) tokens for a language model: the loss of a micro-batch is
the mean over its count, and `MicroBatch.count` is that count (see data/samplers.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import models
from ..data import IGNORE, DistributedLoader
from ..runtime import Runtime
from ..runtime.evaluation import evaluate_tokens, perplexity
from .config import TrainConfig


class Classification:
    """Logits (B, classes) against labels (B,): cross-entropy per sample, accuracy."""

    unit = "samples"
    csv_fields = ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_samples")
    ema_csv_fields = ("test_loss_ema", "test_accuracy_ema")

    def __init__(self, cfg: TrainConfig):
        self.label_smoothing = cfg.label_smoothing

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss per sample."""
        return F.cross_entropy(out, y, label_smoothing=self.label_smoothing)

    def correct(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.argmax(1) == y).sum()

    def evaluate(self, rt: Runtime, model: torch.nn.Module, loader: DistributedLoader) -> dict[str, Any]:
        return rt.evaluate(model, loader)

    def epoch_fields(self, loss: float, correct: float, count: float, ev: dict[str, Any]) -> dict[str, Any]:
        return {
            "train_loss": loss / count,
            "train_accuracy": correct / count,
            "test_loss": ev["loss"],
            "test_accuracy": ev["accuracy"],
            "test_samples": ev["samples"],
        }

    def ema_fields(self, ev: dict[str, Any]) -> dict[str, Any]:
        """The EMA weights' evaluation, named as the raw weights' results with `_ema`."""
        return {"test_loss_ema": ev["loss"], "test_accuracy_ema": ev["accuracy"]}

    def epoch_line(self, r: dict[str, Any]) -> str:
        ema = (
            f"  |  ema loss {r['test_loss_ema']:.4f}  acc {r['test_accuracy_ema']:.4f}" if "test_loss_ema" in r else ""
        )
        return (
            f"train loss {r['train_loss']:.4f}  acc {r['train_accuracy']:.4f}"
            f"  |  test loss {r['test_loss']:.4f}  acc {r['test_accuracy']:.4f}  ({r['test_samples']} samples){ema}"
        )

    def result_fields(self, ev: dict[str, Any], last: dict[str, Any], basis: dict[str, Any]) -> dict[str, Any]:
        return {"test_accuracy": ev["accuracy"], "test_loss": ev["loss"], "test_samples": ev["samples"]}

    def curves(self, steps: list[dict[str, Any]], history: list[dict[str, Any]]) -> tuple[str, list[Any]]:
        """curves.png: loss and accuracy per epoch (`ddpkit.observe.plots` function, its data)."""
        return "plot_curves", [history]

    def headline(self, r: dict[str, Any]) -> str:
        """The start of the `done:` line (scripts parse it)."""
        return f"test accuracy {r['test_accuracy']:.4f} on {r['test_samples']} samples"

    def summary_rows(self, r: dict[str, Any]) -> list[tuple[str, str]]:
        rows = [
            ("test accuracy", f"{r['test_accuracy']:.4f} ({r['test_samples']} samples)"),
            ("test loss", f"{r['test_loss']:.4f}" if r.get("test_loss") is not None else "-"),
        ]
        if r.get("ema") is not None:
            rows.append(
                (
                    "EMA weights",
                    f"test accuracy {r['test_accuracy_ema']:.4f}, loss {r['test_loss_ema']:.4f} (decay {r['ema']:g})",
                )
            )
        return rows


class LanguageModel:
    """Logits (B, T, vocab) against next tokens (B, T), padding marked `IGNORE`: cross-entropy
    per token, perplexity (exp of it), and next-token top-1 accuracy (kept under the
    `accuracy` keys every run's outputs have)."""

    unit = "tokens"
    csv_fields = (
        "train_loss",
        "train_perplexity",
        "train_accuracy",
        "test_loss",
        "test_perplexity",
        "test_accuracy",
        "test_tokens",
        "test_samples",
    )
    ema_csv_fields = ("test_loss_ema", "test_perplexity_ema", "test_accuracy_ema")

    def __init__(self, cfg: TrainConfig):
        self.label_smoothing = cfg.label_smoothing

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss per real token (NaN when it has none: it is then weighed
        by zero, see accumulation.py)."""
        return F.cross_entropy(
            out.flatten(0, 1), y.flatten(), ignore_index=IGNORE, label_smoothing=self.label_smoothing
        )

    def correct(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out.argmax(-1) == y) & (y != IGNORE)).sum()

    def evaluate(self, rt: Runtime, model: torch.nn.Module, loader: DistributedLoader) -> dict[str, Any]:
        return evaluate_tokens(model, loader, rt.precision)

    def epoch_fields(self, loss: float, correct: float, count: float, ev: dict[str, Any]) -> dict[str, Any]:
        return {
            "train_loss": loss / count,
            "train_perplexity": perplexity(loss / count),
            "train_accuracy": correct / count,
            "test_loss": ev["loss"],
            "test_perplexity": ev["perplexity"],
            "test_accuracy": ev["accuracy"],
            "test_tokens": ev["tokens"],
            "test_samples": ev["samples"],
        }

    def ema_fields(self, ev: dict[str, Any]) -> dict[str, Any]:
        return {
            "test_loss_ema": ev["loss"],
            "test_perplexity_ema": ev["perplexity"],
            "test_accuracy_ema": ev["accuracy"],
        }

    def epoch_line(self, r: dict[str, Any]) -> str:
        ema = (
            f"  |  ema loss {r['test_loss_ema']:.4f}  ppl {r['test_perplexity_ema']:.3f}"
            if "test_loss_ema" in r
            else ""
        )
        return (
            f"train loss {r['train_loss']:.4f}  ppl {r['train_perplexity']:.3f}"
            f"  |  test loss {r['test_loss']:.4f}  ppl {r['test_perplexity']:.3f}  acc {r['test_accuracy']:.4f}"
            f"  ({r['test_tokens']:,} tokens){ema}"
        )

    def result_fields(self, ev: dict[str, Any], last: dict[str, Any], basis: dict[str, Any]) -> dict[str, Any]:
        return {
            "test_accuracy": ev["accuracy"],  # per token: the next byte's top-1
            "test_loss": ev["loss"],  # per token, in nats
            "test_perplexity": ev["perplexity"],
            "test_tokens": ev["tokens"],
            "test_samples": ev["samples"],  # sequences
            "final_train_perplexity": last.get("train_perplexity"),
            "tokens_per_second": basis.get("tokens", 0) / max(basis["train_seconds"], 1e-9),
        }

    def curves(self, steps: list[dict[str, Any]], history: list[dict[str, Any]]) -> tuple[str, list[Any]]:
        """curves.png: loss per token and perplexity by step (one epoch is a whole run here)."""
        return "plot_token_curves", [steps, history]

    def headline(self, r: dict[str, Any]) -> str:
        return f"test perplexity {r['test_perplexity']:.3f} (loss {r['test_loss']:.4f} per token) on {r['test_tokens']:,} tokens"

    def summary_rows(self, r: dict[str, Any]) -> list[tuple[str, str]]:
        return [
            ("test perplexity", f"{r['test_perplexity']:.3f}"),
            (
                "test loss",
                f"{r['test_loss']:.4f} per token ({r['test_tokens']:,} tokens in {r['test_samples']:,} sequences)",
            ),
            ("test accuracy", f"{r['test_accuracy']:.4f} (next byte, top-1)"),
            *(
                [("EMA weights", f"test perplexity {r['test_perplexity_ema']:.3f} (decay {r['ema']:g})")]
                if r.get("ema") is not None
                else []
            ),
            ("tokens/s", f"{r['tokens_per_second']:,.0f}"),
        ]


Task = Classification | LanguageModel


def task_of(cfg: TrainConfig) -> Task:
    """The task `--model` trains."""
    return LanguageModel(cfg) if cfg.model in models.LANGUAGE_MODELS else Classification(cfg)
