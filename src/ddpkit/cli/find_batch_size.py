"""`ddpkit find-batch-size`: flags into `tune.Settings` and a process topology, then the search."""

from __future__ import annotations

from collections.abc import Sequence

from .parsing import ArgumentParser, given

# Imports inside functions: a command's --help and its flags' checks load no torch; what runs
# the command loads when it runs.

KNEE_PERCENT = 90  # tune.search.KNEE_FRACTION, for the help text without importing torch


def main(argv: Sequence[str]) -> int:
    from ..observe.timeline import gc_paused

    parser = _parser()
    a = parser.parse_args(argv)  # --help and a bad flag end here, before torch loads
    with gc_paused():  # torch's import makes objects that stay: no collection walks them
        from ..tune import find, resolve

    settings, topology = resolve(a, given(parser, a))
    return find(settings, topology, a.json, a.plot)


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ddpkit find-batch-size",
        description="Find the largest per-device batch that fits on every rank (doubling, then "
        "bisection; out-of-memory caught), with the throughput of each size tried. On CPU "
        f"the pick is the knee: the smallest size reaching {KNEE_PERCENT}% of the best "
        "throughput.",
    )
    p.add_argument(
        "--model",
        default="cnn",
        help="a built-in model, or package.module:function (default cnn; see ddpkit train --help)",
    )
    p.add_argument(
        "--data",
        help="gives the input shape and number of classes (default digits, and text for --model gpt); batches "
        "are synthetic either way",
    )
    p.add_argument("--synthetic-shape", default="3,32,32", metavar="C,H,W", help="input shape with --data synthetic")
    p.add_argument("--num-classes", type=int, default=10, help="classes with --data synthetic")
    p.add_argument("--seq-len", type=int, default=128, help="--data text: tokens per sequence (default 128)")
    for name, what in (("width", "embedding width"), ("depth", "transformer blocks"), ("heads", "attention heads")):
        p.add_argument(f"--gpt-{name}", type=int, help=f"--model gpt: {what} (default: ddpkit train's)")
    p.add_argument(
        "--gpt-style",
        help="--model gpt: gpt2 (LayerNorm, GELU MLP, learned positions; the default) or llama (RMSNorm, SwiGLU, "
        "rotary positions, no biases), as ddpkit train's",
    )
    p.add_argument("--gpt-kv-heads", type=int, help="--model gpt: key/value heads (fewer: grouped-query attention)")
    p.add_argument("--gpt-hidden", type=int, help="--model gpt: the MLP's hidden width (default: the style's)")
    p.add_argument("--nproc", default="auto", help="processes: N, or auto (one per GPU; on CPU one per 4 cores)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    p.add_argument("--optimizer", default="sgd", help="sgd or adamw: its state counts in the memory")
    p.add_argument(
        "--strategy",
        default="ddp",
        help="ddp, fsdp (parameters, gradients and optimizer state sharded over the processes), hsdp "
        "(sharded inside each replica), tp (--model gpt's layers split) or pp (its blocks in stages); default ddp",
    )
    p.add_argument(
        "--mesh",
        help="the processes' layout, e.g. replicate=2,dp=2 (hsdp), dp=1,tp=2 or pp=2; the sizes multiply to the "
        "process count. Under tp and pp a size is a data rank's samples per step (a pipeline cuts them into one "
        "micro-batch per stage, as ddpkit train does)",
    )
    p.add_argument("--pp-schedule", default="1f1b", help="under pp: 1f1b or gpipe (default 1f1b)")
    p.add_argument("--start", type=int, help="first per-device batch (default 8 on CUDA, 1 on CPU)")
    p.add_argument("--max-batch", type=int, default=65536, help="largest per-device batch to try (default 65536)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per size (default 5; the median counts)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per size before those (default 2)")
    p.add_argument(
        "--criterion",
        default="auto",
        help="which size to recommend: largest (that fits) or knee; auto: largest on CUDA, knee on CPU",
    )
    p.add_argument(
        "--plateau",
        type=int,
        default=2,
        help="knee search: stop doubling after N sizes in a row without 5%% more throughput (0: never)",
    )
    p.add_argument("--json", metavar="FILE", help="write the result and the trials here")
    p.add_argument("--plot", metavar="FILE.png", help="draw throughput against per-device batch here")
    return p
