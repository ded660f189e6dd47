"""The built-in networks, each built from the dataset's input shape and number of classes,
and `--model package.module:function`: a network of the user's own, built the same way.

The image classifiers map (B, C, H, W) to logits (B, classes). `gpt`, the language model,
maps byte sequences (B, T) to next-byte logits (B, T, 256): its "input shape" is its context
length (T,) and its "classes" the vocabulary.

Under `--strategy fsdp` every direct child of a model that holds parameters is a shard unit
(see strategy/fsdp.py): so each model is a sequence of its stages, convolutions and blocks,
and `gpt` one of its embedding, each transformer block, and its head.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .core import checks
from .errors import UsageError, usage_errors

Builder = Callable[[tuple[int, ...], int], nn.Module]


def small_cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The default: two 3x3 convolutions, max-pool, then a 4x4 grid of features into a small
    MLP head. Keeping the 4x4 grid (not one global average) keeps where the strokes are, which
    is most of what an 8x8 digit is. Any image size >= 2x2; about 150k parameters. No
    BatchNorm, so its results do not depend on how the global batch is split over processes.
    """
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64 * 16, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def simple_cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The DataParallel tutorial's two convolutions (64 and 128 channels, 3x3), which had no
    classifier; given a ReLU between them and a pooled linear head so it can be trained."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def lenet(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """LeNet-style: conv(20, 5x5) - pool - conv(50, 5x5) - pool - fc 500 - fc classes.

    Padding 2 keeps small inputs (8x8 digits) valid; on 28x28 the head sees 50x7x7.
    """
    c, h, w = in_shape
    return nn.Sequential(
        nn.Conv2d(c, 20, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(50 * (h // 4) * (w // 4), 500),
        nn.ReLU(),
        nn.Linear(500, num_classes),
    )


def mlp(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The DDP tutorial's toy network: two hidden layers of 30 and 20 units."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(in_shape), 30),
        nn.ReLU(),
        nn.Linear(30, 20),
        nn.ReLU(),
        nn.Linear(20, num_classes),
    )


class Residual(nn.Module):
    """d2l's residual block: two 3x3 conv-BN layers, plus a 1x1 convolution on the shortcut
    when the block changes the width or the resolution."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = (
            nn.Conv2d(in_channels, out_channels, 1, stride=stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: Any) -> Any:
        return F.relu(self.body(x) + self.shortcut(x))


def resnet18(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-18 for small images, as in d2l's multi-GPU chapter: a 3x3 stem with no max-pool
    (ImageNet's 7x7 stride-2 stem and pool would shrink 28x28 or 32x32 inputs to nothing),
    four stages of two residual blocks (64, 128, 256, 512 channels), global average pool,
    linear head. About 11 million parameters; BatchNorm (use --sync-batchnorm on GPUs for
    statistics over the global batch)."""
    stages, width = [], 64
    for i, out in enumerate((64, 128, 256, 512)):
        stride = 1 if i == 0 else 2
        stages += [Residual(width, out, stride), Residual(out, out)]
        width = out
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    )


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: Any) -> Any:
        return x * self.factor


def _conv_group(in_channels: int, out_channels: int) -> nn.Sequential:
    # conv, pool, BN, GELU, conv, BN, GELU: pooling early halves the cost of the rest.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.MaxPool2d(2),
        nn.BatchNorm2d(out_channels, momentum=0.4),
        nn.GELU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels, momentum=0.4),
        nn.GELU(),
    )


def fast_cifar(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small residual-free net in the spirit of the CIFAR-10 speed runs (Keller Jordan's
    airbench, after Page's ResNet-9): a 2x2 stem, three conv groups of 64, 256, 256 channels
    that each pool early, a global max-pool and a linear head scaled by 1/9 to keep early
    logits small. About 2 million parameters; made for large batches, label smoothing,
    bf16/fp16 and channels_last (the `--model fast-cifar` recipe sets them)."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 24, 2, bias=False),
        nn.GELU(),
        _conv_group(24, 64),
        _conv_group(64, 256),
        _conv_group(256, 256),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(256, num_classes, bias=False),
        Scale(1 / 9),
    )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only: linear maps to
    queries, keys and values, torch's fused `scaled_dot_product_attention` with its causal mask,
    one linear map back.

    The three maps are separate modules (`q`, `k`, `v`), each a whole number of heads wide, so
    that tensor parallelism can split them column-wise by heads: a rank's share of `q`'s output
    is its heads' queries, and the forward counts the heads it holds from the width it gets
    (`GPT.tp_plan`). A state_dict of ddpkit 0.2 or older held one fused `qkv` map: it loads,
    split into the three (`_split_fused_qkv`).

    `kv_heads` below `heads` is grouped-query attention: `k` and `v` give `kv_heads` heads, each
    shared by `heads / kv_heads` query heads (repeated to their number before the attention, as
    Llama's reference code does). `rope` rotates each query and key head by its position
    (rotary embeddings, in Llama's interleaved pairs, base `ROPE_THETA`), instead of a learned
    position embedding. `bias=False` drops the maps' biases.
    """

    def __init__(self, width: int, heads: int, kv_heads: int | None = None, bias: bool = True, rope: bool = False):
        super().__init__()
        self.head_width = width // heads
        kv_width = (kv_heads or heads) * self.head_width
        self.q = nn.Linear(width, width, bias=bias)
        self.k, self.v = (nn.Linear(width, kv_width, bias=bias) for _ in range(2))
        self.out = nn.Linear(width, width, bias=bias)
        self.rope = rope
        self._register_load_state_dict_pre_hook(_split_fused_qkv, with_module=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_width  # all of them, or this tp rank's
        kv_heads = k.shape[-1] // self.head_width
        # (B, T, heads, head width) -> (B, heads, T, head width)
        q = q.view(b, t, heads, self.head_width)
        k, v = (z.view(b, t, kv_heads, self.head_width) for z in (k, v))
        if self.rope:
            q, k = _rotated(q), _rotated(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if kv_heads != heads:  # each key/value head serves heads / kv_heads query heads
            k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, heads * self.head_width))


ROPE_THETA = 500_000.0  # Llama 3's rotary base


def _rotated(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, T, heads, head width): each pair of features (2i,
    2i + 1) of position t turned by the angle t * ROPE_THETA^(-2i / head width). The angles are
    computed here, in float32, from the sequence length: no buffer (nothing to shard, nothing
    to save, nothing to lose on the meta device)."""
    t, width = x.shape[1], x.shape[-1]
    inv_freq = ROPE_THETA ** -(torch.arange(0, width, 2, device=x.device, dtype=torch.float32) / width)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)  # (T, width / 2)
    cos, sin = (f(angles)[None, :, None, :] for f in (torch.cos, torch.sin))
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), three maps without biases."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate, self.up = (nn.Linear(width, hidden, bias=False) for _ in range(2))
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _split_fused_qkv(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-time: an older checkpoint's fused `qkv` (its rows the queries, then the keys, then
    the values) becomes `q`, `k` and `v`; laid out as their parameters are where a strategy
    split them (a whole state loaded into fsdp's or tp's shards)."""
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}qkv.{kind}", None)
        if fused is None:
            continue
        for name, part in zip("qkv", fused.chunk(3)):
            target = getattr(getattr(module, name), kind)
            if hasattr(target, "device_mesh") and not hasattr(part, "device_mesh"):  # a DTensor's part
                from torch.distributed.tensor import distribute_tensor  # DTensor: loaded where one exists

                part = distribute_tensor(
                    part.to(target.device), target.device_mesh, target.placements, src_data_rank=None
                )
            state[f"{prefix}{name}.{kind}"] = part


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x)).

    `style` "gpt2" (the default) is GPT-2's: LayerNorms, a `hidden`-wide GELU MLP (default 4x
    the width), biases. "llama" is Llama's: RMSNorms, a SwiGLU MLP, rotary positions in the
    attention, no biases; with `kv_heads`, grouped-query attention. Each token is normalized on
    its own either way, so nothing depends on how the batch is split over processes."""

    def __init__(
        self,
        width: int,
        heads: int,
        dropout: float = 0.0,
        style: str = "gpt2",
        kv_heads: int | None = None,
        hidden: int | None = None,
    ):
        super().__init__()
        llama = style == "llama"
        hidden = hidden or mlp_width(width, style)
        self.norm1 = _norm(width, style)
        self.attn = CausalSelfAttention(width, heads, kv_heads, bias=not llama, rope=llama)
        self.norm2 = _norm(width, style)
        self.mlp: nn.Module = (
            SwiGLU(width, hidden)
            if llama
            else nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        )
        # One each: a call site of ddpkit's dropout (rt.setup puts it in their place) per use
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.norm1(x)))
        return x + self.drop2(self.mlp(self.norm2(x)))


GPT_STYLES = ("gpt2", "llama")


def mlp_width(width: int, style: str) -> int:
    """The MLP's hidden width by default: 4x the width (GPT-2), or Llama's 2/3 of that (SwiGLU
    has three maps, not two), rounded up to a multiple of 256."""
    if style == "llama":
        return -(-(8 * width // 3) // 256) * 256
    return 4 * width


def _norm(width: int, style: str) -> nn.Module:
    return nn.RMSNorm(width, eps=1e-5) if style == "llama" else nn.LayerNorm(width)


class Embedding(nn.Module):
    """Token embedding plus a learned embedding of each position (0 .. context - 1); tokens
    only with `positions=False` (rotary positions, applied in the attention instead)."""

    def __init__(self, vocab: int, context: int, width: int, positions: bool = True):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width) if positions else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.positions is None:
            return self.tokens(x)
        positions = torch.arange(x.shape[1], device=x.device)
        return self.tokens(x) + self.positions(positions)


class Head(nn.Module):
    """The final norm (the blocks' kind) and the map to next-token logits (its own weights: not tied to the
    token embedding, which costs 256 x width parameters and keeps every unit's weights its own
    under fsdp)."""

    def __init__(self, width: int, vocab: int, style: str = "gpt2"):
        super().__init__()
        self.norm = _norm(width, style)
        self.logits = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))


class GPT(nn.Sequential):
    """A small decoder-only transformer over bytes: `embed`, then `block0` .. `block{depth-1}`,
    then `head`; (B, T) token ids (T <= context) to logits (B, T, vocab).

    Being a sequence of its stages, each block is a direct child, hence its own shard unit
    under fsdp (the embedding and the head are units too). `dropout` (default none) drops on each
    block's attention and MLP outputs, as GPT-2 does; under a Runtime the masks do not depend on
    the number of processes (see `ddpkit.core.draws`). Weights start as GPT-2's: normal(0, 0.02), the maps back into the residual
    stream scaled by 1/sqrt(2 * depth), biases zero, norms one and zero.

    `style="llama"` makes it Llama-shaped (see `Block`): RMSNorm, SwiGLU, rotary positions (no
    position embedding), no biases, and grouped-query attention with `kv_heads`; `hidden` sets
    the MLP's width. Llama 3 8B is width 4096, depth 32, heads 32, kv_heads 8, hidden 14336 and
    a vocabulary of 128256.
    """

    def __init__(
        self,
        vocab: int,
        context: int,
        width: int,
        depth: int,
        heads: int,
        dropout: float = 0.0,
        style: str = "gpt2",
        kv_heads: int | None = None,
        hidden: int | None = None,
    ):
        shape = gpt_shape_error(width, heads, kv_heads, style, hidden, depth=depth, context=context)
        if shape:
            raise ValueError(f"gpt: {shape}")
        blocks = [(f"block{i}", Block(width, heads, dropout, style, kv_heads, hidden)) for i in range(depth)]
        embed = Embedding(vocab, context, width, positions=style != "llama")
        super().__init__(OrderedDict([("embed", embed), *blocks, ("head", Head(width, vocab, style))]))
        self.context, self.vocab, self.style = context, vocab, style
        self.heads, self.kv_heads = heads, kv_heads or heads
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".norm" in name:
                nn.init.ones_(p)
            else:
                residual = name.endswith(("attn.out.weight", "mlp.2.weight", "mlp.down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * depth) if residual else 0.02)

    def tp_plan(self, tp_size: int) -> dict[str, Any]:
        """How `--strategy tp` splits the model over `tp_size` ranks (torch's tensor-parallel
        styles, by module name): each block's `q`, `k`, `v` and the MLP's first map (Llama's:
        `gate` and `up`) column-wise
        (a rank computes whole heads, a slice of the hidden layer), the maps back into the
        residual stream row-wise (their shares summed: one all-reduce each), the token
        embedding row-wise (a slice of the vocabulary), and the head column-wise with its
        output gathered, so the loss sees whole logits. LayerNorms and the position embedding
        stay whole on every rank."""
        # torch's DTensor and tensor-parallel modules: 0.5 s to import, loaded where tp runs only
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if self.heads % tp_size or self.kv_heads % tp_size or self.vocab % tp_size:
            kv = f", {self.kv_heads} key/value heads" if self.kv_heads != self.heads else ""
            raise UsageError(
                f"--mesh tp={tp_size}: gpt splits whole heads and the vocabulary over the tp ranks; "
                f"its {self.heads} heads{kv} and {self.vocab} tokens must be multiples of {tp_size}"
            )
        mlp = (
            {
                "block*.mlp.gate": ColwiseParallel(),
                "block*.mlp.up": ColwiseParallel(),
                "block*.mlp.down": RowwiseParallel(),
            }
            if self.style == "llama"
            else {"block*.mlp.0": ColwiseParallel(), "block*.mlp.2": RowwiseParallel()}
        )
        return {
            "embed.tokens": RowwiseParallel(input_layouts=Replicate()),
            "block*.attn.q": ColwiseParallel(),
            "block*.attn.k": ColwiseParallel(),
            "block*.attn.v": ColwiseParallel(),
            "block*.attn.out": RowwiseParallel(),
            **mlp,
            "head.logits": ColwiseParallel(output_layouts=Replicate()),
        }


# `--gpt-width`, `--gpt-depth`, `--gpt-heads` defaults: about 0.8 million parameters at a
# context of 256 bytes, a run of a minute or two on two CPU cores.
GPT_WIDTH, GPT_DEPTH, GPT_HEADS = 128, 4, 4


def gpt(
    in_shape: tuple[int, ...],
    num_classes: int,
    width: int = GPT_WIDTH,
    depth: int = GPT_DEPTH,
    heads: int = GPT_HEADS,
    dropout: float = 0.0,
    style: str = "gpt2",
    kv_heads: int | None = None,
    hidden: int | None = None,
) -> nn.Module:
    """The byte-level language model: `in_shape` is (context,), `num_classes` the vocabulary
    (256 for bytes). See `GPT`."""
    return GPT(num_classes, in_shape[0], width, depth, heads, dropout, style, kv_heads, hidden)


def gpt_shape_error(
    width: int,
    heads: int,
    kv_heads: int | None = None,
    style: str = "gpt2",
    hidden: int | None = None,
    **positive: int,
) -> str:
    """What is wrong with a gpt shape, in `ddpkit train`'s flags, or ''."""
    if style not in GPT_STYLES:
        return f"--gpt-style must be one of {', '.join(GPT_STYLES)}, got {style!r}"
    given = {"width": width, "heads": heads, "kv-heads": kv_heads, "hidden": hidden, **positive}
    for name, value in given.items():
        if value is not None and value < 1:
            return f"--gpt-{name} must be positive, got {value}"
    if width % heads:
        return f"--gpt-width {width} must be a multiple of --gpt-heads {heads}"
    if kv_heads is not None and heads % kv_heads:
        return (
            f"--gpt-heads {heads} must be a multiple of --gpt-kv-heads {kv_heads} (query heads share key/value heads)"
        )
    if style == "llama" and (width // heads) % 2:
        return f"--gpt-style llama rotates pairs of features: each head's width ({width // heads}) must be even"
    return ""


def gpt_parameters(
    context: int,
    vocab: int,
    width: int,
    depth: int,
    style: str = "gpt2",
    heads: int = 1,
    kv_heads: int | None = None,
    hidden: int | None = None,
) -> int:
    """How many parameters `gpt` has, without building it."""
    hidden = hidden or mlp_width(width, style)
    kv = width * (kv_heads or heads) // heads  # the keys' (and values') width
    if style == "llama":  # no biases, SwiGLU's three maps, RMSNorms (one weight each), no position embedding
        block = 2 * width * width + 2 * width * kv + 3 * width * hidden + 2 * width
        return vocab * width + depth * block + width + width * vocab
    attention = 2 * width * width + 2 * width * kv + 2 * width + 2 * kv  # q, out; k, v (weights and biases)
    block = attention + 2 * width * hidden + hidden + width + 4 * width  # the MLP, two norms
    return (vocab + context) * width + depth * block + 2 * width + width * vocab


def check_gpt_memory(
    seq_len: int, vocab: int, width: int, depth: int, per_weight: float, processes: int, **shape: Any
) -> None:
    """Refuse a gpt too large for this machine's memory before any process builds it: its
    parameters (`shape`: the rest of `gpt_parameters`'s) times `per_weight` bytes (weights,
    gradients and optimizer state, as the strategy holds them: `Strategy.bytes_per_weight`) in
    each of `processes`."""
    params = gpt_parameters(seq_len, vocab, width, depth, **shape)
    checks.memory(
        f"--model gpt with --gpt-width {width}, --gpt-depth {depth} and --seq-len {seq_len} ({params:,} parameters)",
        params * per_weight,
        processes,
    )


def build_shapes(name: str, in_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    """The model built for its shapes only: on the meta device (no memory), or, for a model of
    one's own that cannot be built there, on the CPU (as `check` probes it). Its builder's
    errors are one line (UsageError) naming `--model`."""
    if not is_custom(name):
        with torch.device("meta"):
            return build(name, in_shape, num_classes, **options)
    with usage_errors(f"--model {name}: "):
        fn = resolve(name)
        try:
            return _build(name, fn, tuple(in_shape), num_classes, "meta")
        except ValueError:  # not buildable on meta (it reads its values, say): for real
            return _build(name, fn, tuple(in_shape), num_classes, "cpu")


MODELS: dict[str, Builder] = {
    "cnn": small_cnn,
    "simple-cnn": simple_cnn,
    "lenet": lenet,
    "mlp": mlp,
    "resnet18": resnet18,
    "fast-cifar": fast_cifar,
    "gpt": gpt,
}
# Models of token sequences, (B, T) -> (B, T, vocab), trained on `--data text`; the rest are
# image (or vector) classifiers.
LANGUAGE_MODELS = ("gpt",)


# The smallest image side each convolutional model takes (its pooling must not reach zero).
MIN_SIZE = {"lenet": 4, "cnn": 2, "resnet18": 8, "fast-cifar": 16}


def is_custom(name: str) -> bool:
    """True for a user's `package.module:function` (built-in names have no ':')."""
    return ":" in name


def _import(module_name: str) -> Any:
    # Like `python -m`: the current directory comes first while importing, so a my_models.py
    # next to where the command runs is found. Removed again after: it must not shadow
    # anything imported later.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def resolve(name: str) -> Builder:
    """The builder for `name`: a built-in one, or `package.module:function` imported.
    Raises ValueError naming what is wrong."""
    if name in MODELS:
        return MODELS[name]
    if not is_custom(name):
        checks.choice("--model", name, [*MODELS, "package.module:function"])
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"expected package.module:function, got {name!r}")
    try:
        module = _import(module_name)
    except ImportError as err:  # includes ModuleNotFoundError, for the module or one it imports
        raise ValueError(
            f"cannot import module {module_name!r} ({err}); is it on PYTHONPATH or in the current directory?"
        ) from None
    except (Exception, SystemExit) as err:  # noqa: BLE001 - whatever the module raised (or exited with) on import
        raise ValueError(f"importing module {module_name!r} failed: {_raised(err)}") from None
    fn = module
    for part in attr.split("."):  # module:Class.method works too
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{attr!r} in module {module_name!r} is not callable")  # noqa: TRY004 - a usage error
    return fn


def _checked(name: str, model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{name}(in_shape, num_classes) must return a torch.nn.Module, "  # noqa: TRY004
            f"got {type(model).__name__}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        # nothing to train: the optimizer (or DDP) failed inside every worker, a traceback each
        raise ValueError(f"{name}(in_shape, num_classes) returned a module with no parameter that requires a gradient")
    return model


def check(name: str, in_shape: tuple[int, ...], num_classes: int = 10, what: str = "--model") -> None:
    """Raise UsageError if model `name` cannot map inputs of `in_shape` (C, H, W) to
    `num_classes` logits.

    A user's `module:function` is imported, called, and run on one sample (see `_probe`), so a
    function that raises or exits, returns something else than a module, or gives logits of
    the wrong width is one line naming `what` before any process starts."""
    if not is_custom(name):
        checks.choice(what, name, [*MODELS, "package.module:function"])
    with usage_errors(f"{what} {name}: "):
        if is_custom(name):
            fn = resolve(name)
            with warnings.catch_warnings():  # a model's warnings belong to the run (its workers), not the probe
                warnings.simplefilter("ignore")
                _probe(name, fn, tuple(in_shape), num_classes)
            return
        if name in LANGUAGE_MODELS:
            if len(in_shape) != 1:
                raise ValueError(f"model {name!r} is a language model of byte sequences: use it with --data text")
            return
        if name != "mlp" and len(in_shape) != 3:
            raise ValueError(f"model {name!r} needs images shaped C,H,W, got {in_shape}")
        smallest = MIN_SIZE.get(name, 1)
        if name != "mlp" and min(in_shape[1:]) < smallest:
            raise ValueError(f"model {name!r} needs images of at least {smallest}x{smallest}, got {in_shape}")


# A user's model at most this large (weights and buffers) is probed on the CPU for real: that
# takes milliseconds, while the first forward on the meta device loads torch's meta kernels
# (seconds). A larger one is probed on meta, where it costs no memory.
PROBE_ON_CPU_BYTES = 256 * 2**20


def _probe(name: str, fn: Builder, in_shape: tuple[int, ...], num_classes: int) -> None:
    """Build the model (on the meta device first: no memory, no weights) and pass one sample
    through it, in eval mode without gradients, on the CPU or, for a large model, on meta.
    A model that cannot be built or run on meta (it loads weights from a file, or uses an
    operation without a meta kernel) is built and run on the CPU. Raises ValueError saying
    what failed; the workers build the model again."""
    try:
        model = _build(name, fn, in_shape, num_classes, "meta")
    except ValueError:  # not buildable on meta; if it cannot be built at all, the CPU build says so
        model = None
    if model is None or _nbytes(model) <= PROBE_ON_CPU_BYTES:
        try:
            out = _forward_one(_build(name, fn, in_shape, num_classes, "cpu"), in_shape, "cpu")
        except ValueError:
            if torch.cuda.is_available():  # it may run on the GPU only (half precision, CUDA kernels)
                return
            raise
    else:
        try:
            out = _forward_one(model, in_shape, "meta")
        except ValueError:  # an operation without a meta kernel in its forward: run it for real
            out = _forward_one(_build(name, fn, in_shape, num_classes, "cpu"), in_shape, "cpu")
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if shape != (1, num_classes):
        raise ValueError(
            f"its forward gives {shape} for one sample of shape {(1, *in_shape)}; expected logits of shape "
            f"(1, {num_classes}), one per class"
        )


def _build(name: str, fn: Builder, in_shape: tuple[int, ...], num_classes: int, device: str) -> nn.Module:
    try:
        with torch.device(device):
            model = fn(in_shape, num_classes)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a user's function: whatever it raises (or exits with)
        raise ValueError(f"{name.partition(':')[2]}({in_shape}, {num_classes}) {_raised(err)}") from None
    return _checked(name, model)


def _nbytes(model: nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(
        t.numel() * t.element_size() for t in tensors if not isinstance(t, nn.parameter.UninitializedTensorMixin)
    )


def _forward_one(model: nn.Module, in_shape: tuple[int, ...], device: str) -> Any:
    try:
        with torch.no_grad(), torch.device(device):
            return model.eval()(torch.zeros((1, *in_shape)))
    except (Exception, SystemExit) as err:  # noqa: BLE001
        raise ValueError(f"its forward on one sample of shape {(1, *in_shape)} {_raised(err)}") from None


def _raised(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"raised {type(err).__name__}: {err}"


def build(name: str, in_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    """A built-in model by name, or a user's from `package.module:function`, which is called
    as function(in_shape, num_classes): `in_shape` a tuple like (3, 32, 32) (one sample, no
    batch dimension), `num_classes` an int; it must return an nn.Module whose forward maps a
    batch (B, *in_shape) to logits (B, num_classes). `options` go to a built-in builder that
    takes them (`gpt`: width, depth, heads)."""
    if not is_custom(name):
        check(name, in_shape, num_classes)
        return MODELS[name](in_shape, num_classes, **options)
    with usage_errors(f"--model {name}: "):
        fn = resolve(name)
    model = fn(tuple(in_shape), num_classes)  # whatever the user's function raises, as it is
    with usage_errors(f"--model {name}: "):
        return _checked(name, model)
