"""`ddpkit plan`: flags into a `plan.Spec` and a `plan.Cluster`, then the plan."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .parsing import ArgumentParser, given

# Imports inside functions: `--help` and a bad flag's one line load no torch.

EFFICIENCY = 0.4  # --efficiency's default

# --activation-checkpointing: the settings each layout is planned with (True: full)
AC = {
    "both": (False, True),
    "on": (True,),
    "off": (False,),
    "selective": ("selective",),
    "all": (False, True, "selective"),
}


def main(argv: Sequence[str]) -> int:
    from ..observe.timeline import gc_paused

    parser = _parser()
    a = parser.parse_args(argv)  # --help and a flag that does not parse end here, before torch loads
    with gc_paused():  # torch's import makes objects that stay: no collection walks them
        from ..plan import output, plan

    spec, cluster = _resolve(a, given(parser, a))
    p = plan(spec, cluster, progress=a.progress)
    print(output.report(p))
    if a.json is not None:
        output.write(p, a.json)
    if a.plot is not None:
        output.plot(p, a.plot)
    if a.verify:
        _verify(p, a.verify_nproc)
    return 0 if p.best is not None else 1  # none fits: as find-batch-size when no size does


def _verify(p: object, nproc: int | None) -> None:
    """Run the recommended layout (or the smallest, where none fits) here, beside its trace."""
    import torch

    from ..core import device as devices
    from ..plan import output, verify

    chosen = p.best or min(p.predictions, key=lambda q: q.trace.peak)
    cuda = torch.cuda.is_available()
    n = nproc or verify.processes(chosen.layout, devices.gpu_count() if cuda else 2)
    case = verify.here(p.spec, chosen.layout, n)
    guessed, real = verify.compare(case, n, "cuda" if cuda else "cpu")
    print()
    print(f"recommended: {chosen.layout.label}; here on {n} process(es) it runs as {case[1].label}")
    print(output.verification(case, n, "cuda" if cuda else "cpu", guessed, real))


def _resolve(a: object, given: list[str]) -> tuple[object, object]:
    import math

    from .. import data, models
    from ..core import checks
    from ..errors import UsageError
    from ..plan import Spec, cluster

    language = a.model in models.LANGUAGE_MODELS
    name = checks.choice("--data", ("text" if language else "cifar10") if a.data is None else a.data, data.DATASETS)
    data.check_pairing(name, a.model, language)
    in_shape, classes = data.shape_of(
        name,
        checks.shape("--synthetic-shape", a.synthetic_shape),
        10 if a.num_classes is None else a.num_classes,
        checks.positive("--seq-len", a.seq_len),
    )
    if language and a.num_classes is not None:  # a vocabulary other than bytes (Llama 3's 128256, say)
        classes = checks.at_least("--num-classes", a.num_classes, 2)
    options = {k: getattr(a, f"gpt_{k}") for k in ("width", "depth", "heads", "kv_heads", "hidden")} if language else {}
    options = {k: checks.positive(f"--gpt-{k.replace('_', '-')}", v) for k, v in options.items() if v is not None}
    if language and a.gpt_style != "gpt2":
        options["style"] = a.gpt_style
    if language:
        w, h = options.get("width", models.GPT_WIDTH), options.get("heads", models.GPT_HEADS)
        shape = models.gpt_shape_error(w, h, options.get("kv_heads"), a.gpt_style, options.get("hidden"))
        if shape:
            raise UsageError(shape)
    ac = AC[checks.choice("--activation-checkpointing", a.activation_checkpointing, tuple(AC))]
    if name == "synthetic":  # one float32 sample at least must fit here, where the model is checked
        checks.memory(f"one sample of --synthetic-shape {a.synthetic_shape}", 4 * math.prod(in_shape))
    if name == "synthetic" and classes < 2:
        raise UsageError(f"--num-classes must be at least 2 (a classifier of one class learns nothing), got {classes}")
    strategies = tuple(s.strip() for s in a.strategy.split(",")) if a.strategy is not None else ()
    spec = Spec(
        a.model,
        in_shape,
        classes,
        a.batch_size,
        a.precision,
        a.optimizer,
        options,
        ac,
        data=name,
        strategies=strategies,
    )
    models.check(a.model, in_shape, classes)  # a model of one's own too: built and run once, as train does
    data.check_applies(name, a.model, language, given, vocabulary=True)
    _check_outputs(a)
    if a.gpu == "cpu":
        return spec, _cpu(a)
    c = cluster(
        a.gpu,
        checks.positive("--gpus-per-node", a.gpus_per_node),
        checks.positive("--nodes", a.nodes),
        EFFICIENCY if a.efficiency is None else a.efficiency,
        memory_gib=a.memory_gib,
        peak_tflops=a.peak_tflops,
        intra_gbps=a.intra_gbps,
        inter_gbps=a.inter_gbps,
    )
    return spec, c


def _cpu(a: object) -> object:
    """This machine's CPU, measured with --gpus-per-node processes (`plan.calibrate`)."""
    from ..core import checks
    from ..errors import UsageError
    from ..plan.calibrate import measure

    given = [f for f in ("memory_gib", "peak_tflops", "intra_gbps", "inter_gbps") if getattr(a, f) is not None]
    given += ["efficiency"] if a.efficiency is not None else []  # measured here, not assumed
    if a.nodes != 1 or given:
        extra = ", ".join(f"--{f.replace('_', '-')}" for f in given) or "--nodes"
        raise UsageError(f"--gpu cpu is this machine, measured: {extra} cannot be given with it")
    n = checks.positive("--gpus-per-node", a.gpus_per_node)
    # each measuring process holds torch, gloo and a small gpt: about 350 MiB (peak RSS, measured)
    checks.memory(f"--gpu cpu with --gpus-per-node {n} (a process each, measured)", 350 * 2**20, n)
    return measure(n).cluster()


def _check_outputs(a: object) -> None:
    """Where the plan is written, checked before it is made: a bad path costs nothing."""
    from ..core import checks
    from ..errors import UsageError

    if a.plot is not None and not a.plot.lower().endswith(".png"):
        raise UsageError(f"--plot {a.plot!r}: expected a .png file name")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if path is not None:
            if not path.strip():
                raise UsageError(f"{flag}: give a file name")
            checks.output_file(flag, path)
    # the same file however spelled (./plan.png, a link to it): the plot would replace the JSON
    if a.json is not None and a.plot is not None and os.path.realpath(a.json) == os.path.realpath(a.plot):
        raise UsageError(f"--json and --plot name the same file ({a.json}, {a.plot})")
    if a.verify_nproc is not None:
        if not a.verify:
            raise UsageError("--verify-nproc goes with --verify")
        checks.positive("--verify-nproc", a.verify_nproc)


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ddpkit plan",
        description="Predict, before booking the GPUs, each layout's per-GPU memory (parameters, gradients, "
        "optimizer state, activations, communication buffers, peak) and step time, which fit, and the "
        "fastest one's ddpkit train command. Memory is traced on fake tensors over a fake process group of "
        "the cluster's size; time is FLOPs at --efficiency plus each collective by a ring model of the links. "
        "Exit code 1 when no layout fits (the table, --json and --plot are written all the same).",
    )
    p.add_argument("--model", default="gpt", help="gpt (default), another built-in model, or package.module:function")
    p.add_argument("--data", help="gives the input shape and classes (default text for gpt, cifar10 otherwise)")
    p.add_argument("--synthetic-shape", default="3,32,32", metavar="C,H,W", help="input shape with --data synthetic")
    p.add_argument(
        "--num-classes",
        type=int,
        help="classes with --data synthetic (default 10); gpt: its vocabulary (default 256, bytes)",
    )
    p.add_argument("--seq-len", type=int, default=1024, help="gpt: tokens per sequence (default 1024)")
    for name, what in (("width", "embedding width"), ("depth", "transformer blocks"), ("heads", "attention heads")):
        p.add_argument(f"--gpt-{name}", type=int, help=f"gpt: {what} (default: ddpkit train's)")
    p.add_argument(
        "--gpt-style", default="gpt2", help="gpt: gpt2 (default) or llama (RMSNorm, SwiGLU, rotary positions)"
    )
    p.add_argument("--gpt-kv-heads", type=int, help="gpt: key/value heads (fewer than --gpt-heads: grouped-query)")
    p.add_argument("--gpt-hidden", type=int, help="gpt: the MLP's hidden width (default 4x the width; llama 8/3x)")
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch: samples per optimizer step (default 64)")
    p.add_argument("--precision", default="bf16", help="fp32, bf16 (default) or fp16")
    p.add_argument("--optimizer", default="adamw", help="adamw (default) or sgd (with momentum)")
    p.add_argument(
        "--activation-checkpointing",
        default="both",
        help="both (default: each layout with and without, in full), on, off, selective (attention's and every "
        "other product's outputs kept), or all three",
    )
    p.add_argument(
        "--strategy",
        help="plan only these, comma-separated: ddp, fsdp, hsdp, tp, pp (default: all; pipelines of a gpt deeper "
        "than 8 blocks only when pp is named: their stages are traced, which takes minutes on large clusters)",
    )
    p.add_argument(
        "--gpu",
        default="h100",
        help="preset: h100 (default), h200, a100-80gb or a100-40gb; or cpu: this machine's CPU with --gpus-per-node "
        "processes, measured first (rates, bandwidth, collectives; see docs/plan.md)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--memory-gib", type=float, help="GPU memory in GiB (default: the preset's)")
    p.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s at --precision (default: the preset's)")
    p.add_argument("--intra-gbps", type=float, help="GB/s per GPU, one direction, within a node (default: preset)")
    p.add_argument("--inter-gbps", type=float, help="GB/s per GPU, one direction, between nodes (default: preset)")
    p.add_argument("--efficiency", type=float, help=f"share of the peak the products reach (default {EFFICIENCY})")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot memory and predicted throughput per layout")
    p.add_argument("--progress", action="store_true", help="a progress bar over the layouts")
    p.add_argument(
        "--verify",
        action="store_true",
        help="then run the recommended layout here for real (one step tracked, a few timed) and print its "
        "predicted and measured memory side by side",
    )
    p.add_argument(
        "--verify-nproc",
        type=int,
        help="--verify: processes here (default: every GPU, or 2 on CPU; a pipeline's stages at most, as it "
        "runs a stage per process, or pipelines side by side where the processes hold them whole); the global "
        "batch is scaled to their data ranks",
    )
    return p
