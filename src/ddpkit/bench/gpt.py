"""`ddpkit bench gpt`: tokens/s, step time and MFU of the `gpt` language model at a size of
your choosing.

One process, one device. The model trains through ddpkit's runtime (`rt.setup`, `rt.loader`
over random byte sequences resident on the device, `rt.backward`, `rt.step`, AdamW) at
`--precision` (default bf16 on CUDA, fp32 on CPU). After warm-up steps, `repeats` blocks of
steps are timed (CUDA events on a GPU) and reported as median and spread of the step time and
tokens/s.

Two FLOP counts per token are given, and MFU against the device's dense peak for the precision
(`metrics.peak_tflops`; a CPU has none, so MFU is n/a there):

- `counted`: torch's FlopCounterMode over forward and backward of one sequence (matrix
  products and attention, as `ddpkit train` counts them for its `mfu`);
- `6N+12LdT`: the usual analytic estimate (PaLM, appendix B): 6 FLOPs per parameter outside
  the embeddings per token, plus attention's 12 x depth x width x sequence length. Where the
  counter misses attention (torch's CPU attention kernel is not among the ones it counts), the
  two differ by about that term.

The default size on CUDA (width 1024, depth 12, 16 heads, 1024 tokens, batch 16: about 153M
parameters) is large enough for the matrix products to fill a data-center GPU; on CPU it is
small enough for a few seconds.
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass
from typing import Any

from .common import cycle

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "the gpt language model: tokens/s, step time, FLOPs per token, achieved TFLOP/s and MFU"

VOCAB = 256  # bytes
# (width, depth, heads, seq_len, batch): on CUDA, then on CPU, then on CPU with --quick.
SIZES = {"cuda": (1024, 12, 16, 1024, 16), "cpu": (128, 2, 4, 128, 8), "quick": (64, 1, 2, 64, 4)}


@dataclass(frozen=True)
class Work:
    width: int
    depth: int
    heads: int
    seq_len: int
    batch_size: int
    precision: str
    compile: bool
    steps_per_repeat: int
    warmup_steps: int
    lr: float = 3e-4
    seed: int = 0
    activation_checkpointing: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def add_arguments(parser: Any) -> None:
    parser.add_argument("--gpt-width", type=int, default=0, help="model width (default 1024 on CUDA, 128 on CPU)")
    parser.add_argument("--gpt-depth", type=int, default=0, help="transformer blocks (default 12 on CUDA, 2 on CPU)")
    parser.add_argument("--gpt-heads", type=int, default=0, help="attention heads (default 16 on CUDA, 4 on CPU)")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default 1024 on CUDA, 128 on CPU)")
    parser.add_argument("--batch-size", type=int, default=0, help="sequences per step (default 16 on CUDA, 8 on CPU)")
    parser.add_argument(
        "--precision", default="", choices=("", "fp32", "bf16", "fp16"), help="default bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (the first steps compile)")
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="each block keeps only its inputs for the backward and recomputes the rest there",
    )


def run(opts: Any, device: str) -> dict[str, Any]:
    from ..errors import UsageError
    from ..launcher import launch

    extra, cuda = opts.extra, device == "cuda"
    width, depth, heads, seq, batch = SIZES["cuda" if cuda else ("quick" if opts.quick else "cpu")]
    work = Work(
        width=extra.get("gpt_width") or width,
        depth=extra.get("gpt_depth") or depth,
        heads=extra.get("gpt_heads") or heads,
        seq_len=extra.get("seq_len") or seq,
        batch_size=extra.get("batch_size") or batch,
        precision=extra.get("precision") or ("bf16" if cuda else "fp32"),
        compile=bool(extra.get("compile")),
        activation_checkpointing=bool(extra.get("activation_checkpointing")),
        steps_per_repeat=5 if cuda else 1,
        warmup_steps=3 if cuda else (1 if opts.quick else 2),
    )
    if work.width % work.heads:
        raise UsageError(f"--gpt-width {work.width} must be a multiple of --gpt-heads {work.heads}")
    reps = opts.reps(10 if cuda else 5, 2)
    row = launch(_worker, work, device, reps, nproc=1, device=device)[0]
    return _result(work, device, reps, row)


# -- inside the worker ----------------------------------------------------------------------------


def _worker(work: Work, device: str, reps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from ..models import build
    from ..observe.metrics import flops_per_sample, peak_tflops, sync, time_calls
    from ..runtime import Runtime

    gc.collect()
    with Runtime(
        strategy="single",
        precision=work.precision,
        device=device,
        seed=work.seed,
        compile=work.compile,
        activation_checkpointing=work.activation_checkpointing or None,
    ) as rt:
        g = torch.Generator().manual_seed(work.seed)
        tokens = torch.randint(0, VOCAB, (work.batch_size * 4, work.seq_len + 1), generator=g)
        data = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        model = build("gpt", (work.seq_len,), VOCAB, width=work.width, depth=work.depth, heads=work.heads)
        params = sum(p.numel() for p in model.parameters())
        counted = flops_per_sample(model, (work.seq_len,), rt.device, vocab=VOCAB)
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=work.lr))
        batches = cycle(rt.loader(data, batch_size=work.batch_size, resident=True))
        losses: list[Any] = []
        saved = _saved_for_backward(model, data.tensors, work.batch_size)
        opt.zero_grad(set_to_none=True)

        def steps() -> None:
            for _ in range(work.steps_per_repeat):
                x, y = next(batches)
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                rt.backward(loss)
                rt.step(opt)
                losses.append(loss.detach())

        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = time_calls(steps, rt.device, repeats=reps, warmup=work.warmup_steps)
        sync(rt.device)
        out = {
            "parameters": params,
            "flops_per_token_counted": counted / work.seq_len if counted else None,
            "step_seconds": [s / work.steps_per_repeat for s in seconds],
            "first_loss": losses[0].item(),
            "final_loss": losses[-1].item(),
            "peak_tflops": peak_tflops(rt.device, work.precision),
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if rt.device.type == "cuda" else None,
            "saved_for_backward_bytes": saved,
            "device_name": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
        }
        batches.close()
    return out


def _saved_for_backward(model: Any, tensors: tuple[Any, Any], batch: int) -> int:
    """The bytes autograd keeps for the backward of one step's forward (counted as each tensor is
    saved, through `saved_tensors_hooks`): the activations, which checkpointing trades for
    compute. The step's gradients are left for the caller to drop."""
    import torch
    import torch.nn.functional as F

    total = 0

    def pack(t: Any) -> Any:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    x, y = (t[:batch].to(next(model.parameters()).device) for t in tensors)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    return total


# -- assembling the result ------------------------------------------------------------------------


def analytic_flops_per_token(parameters: int, work: Work) -> float:
    """6N + 12 L d T: forward and backward of every weight outside the embeddings (a lookup
    multiplies nothing), plus attention's scores and weighted sums."""
    embeddings = (VOCAB + work.seq_len) * work.width
    return 6 * (parameters - embeddings) + 12 * work.depth * work.width * work.seq_len


def _result(work: Work, device: str, reps: int, row: dict[str, Any]) -> dict[str, Any]:
    import statistics

    from .common import stats

    tokens = [work.tokens_per_step / s for s in row["step_seconds"]]
    rate = statistics.median(tokens)
    peak = row["peak_tflops"]
    flops = {"counted": row["flops_per_token_counted"], "6N+12LdT": analytic_flops_per_token(row["parameters"], work)}
    achieved = {k: (v * rate / 1e12 if v else None) for k, v in flops.items()}
    return {
        "method": (
            f"one process on {device} ({row['device_name']}, {row['threads']} threads); gpt (width {work.width}, "
            f"depth {work.depth}, {work.heads} heads) trains through ddpkit's Runtime ({work.precision}"
            + (", torch.compile" if work.compile else "")
            + (", each block's activations checkpointed" if work.activation_checkpointing else "")
            + f", AdamW) on random byte sequences of {work.seq_len} tokens resident on the device, batch "
            f"{work.batch_size}; {work.warmup_steps} warm-up call(s), then {reps} blocks of {work.steps_per_repeat} "
            "step(s) timed (" + ("CUDA events" if device == "cuda" else "host clock") + "). saved_for_backward_mib: "
            "the bytes autograd keeps for one step's backward, counted as they are saved. flops_per_token: torch "
            "FlopCounterMode (counted) and 6N + 12 x depth x width x seq_len (analytic); achieved_tflops = "
            "flops_per_token x median tokens/s; mfu = achieved / the device's dense peak for the precision."
        ),
        "work": asdict(work),
        "repeats": reps,
        "parameters": row["parameters"],
        "tokens_per_step": work.tokens_per_step,
        "step_ms": stats([s * 1e3 for s in row["step_seconds"]]),
        "tokens_per_second": stats(tokens),
        "flops_per_token": flops,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "mfu": {k: (v / peak if v is not None and peak else None) for k, v in achieved.items()},
        "mfu_note": None if peak else "n/a (no peak known for this device): ddpkit knows dense peaks of GPUs only",
        "first_loss": row["first_loss"],
        "final_loss": row["final_loss"],
        "loss_finite": math.isfinite(row["final_loss"]),
        "peak_memory_mib": row["peak_memory_mib"],
        "saved_for_backward_mib": row["saved_for_backward_bytes"] / 2**20,
    }


# -- report ---------------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    ms = r["step_ms"]
    ax.bar(["step time"], [ms["median"]], yerr=[[ms["median"] - ms["q1"]], [ms["q3"] - ms["median"]]], capsize=4)
    ax.set_ylabel("ms per optimizer step (median, quartiles)")
    w = r["work"]
    mfu = r["mfu"]["counted"]
    ax.set_title(
        f"gpt {r['parameters'] / 1e6:.1f}M params (w{w['width']} d{w['depth']}, {w['seq_len']} tokens x "
        f"{w['batch_size']}), {w['precision']} on {record.get('device', '')}\n"
        f"{r['tokens_per_second']['median']:,.0f} tokens/s, "
        + (f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a (no device peak)"),
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    mfu, tflops = result["mfu"]["counted"], result["achieved_tflops"]["counted"]
    return [
        ("parameters", f"{result['parameters']:,}"),
        ("kept for backward", f"{result['saved_for_backward_mib']:.1f} MiB"),
        (
            "tokens/s, step",
            f"{result['tokens_per_second']['median']:,.0f}, {result['step_ms']['median']:.1f} ms",
        ),
        (
            "achieved TFLOP/s, MFU (counted FLOPs)",
            (f"{tflops:.2f}" if tflops is not None else "n/a")
            + ", "
            + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a (no device peak)"),
        ),
    ]
