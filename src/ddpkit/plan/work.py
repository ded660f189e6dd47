"""What a traced step asks of the processor, operation by operation: the FLOPs of each (torch's
own formulas) and the bytes it reads and writes, for a time model in which an operation takes
the longer of its FLOPs over the peak and its bytes over the memory bandwidth, plus a fixed cost
for being dispatched at all (`Ops.seconds`). On a CPU the last two are most of a small model's
step; the GPU presets leave them out (their plans count FLOPs alone, see predict.py).

Counted on rank 0's own step, as traced: its shards and slices (a DTensor's local part), FSDP2's
copies in and out of its buffers, the recomputation under checkpointing, the optimizer's step.
Views (no data moved) and collectives (timed by the ring model instead) are not operations here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# Imports inside functions: torch's FLOP formulas load when a trace counts.


class OpKind(NamedTuple):
    """One kind of operation: its FLOPs and bytes, whether on DTensors, whether attention's
    fused kernel, and its name (torch's operator overload, e.g. "aten.mm.default"; ddpkit's for
    work it adds itself, e.g. "ddp.bucket_copy")."""

    flops: int
    bytes: int
    distributed: bool
    attention: bool
    name: str


@dataclass
class Ops:
    """The operations of a step: each kind of operation (`OpKind`) -> how many there were."""

    counts: Counter = field(default_factory=Counter)

    @property
    def calls(self) -> int:
        return sum(self.counts.values())

    @property
    def distributed_calls(self) -> int:
        return sum(n for op, n in self.counts.items() if op.distributed)

    @property
    def flops(self) -> float:
        return float(sum(op.flops * n for op, n in self.counts.items()))

    def seconds(
        self,
        flops_per_s: float,
        bytes_per_s: float,
        per_op_s: float,
        per_dtensor_op_s: float = 0.0,
        attention_flops_per_s: float | None = None,
    ) -> float:
        """Every operation at the longer of its FLOPs at `flops_per_s` (attention's at
        `attention_flops_per_s`, where given: its fused kernel is no matrix product) and its
        bytes at `bytes_per_s`, plus `per_op_s` each, and `per_dtensor_op_s` more for one on
        DTensors (DTensor's dispatch, in Python, works out the shardings)."""
        attention = attention_flops_per_s or flops_per_s
        busy = sum(
            n * max(op.flops / (attention if op.attention else flops_per_s), op.bytes / bytes_per_s)
            for op, n in self.counts.items()
        )
        return busy + self.calls * per_op_s + self.distributed_calls * per_dtensor_op_s

    def extrapolated(self, other: Ops, n: int) -> Ops:
        """These operations with `n` more of what `other` has beyond them (a model `n` blocks
        deeper, `other` being it one block deeper).

        Most of a block's operations are the same in every block: their kinds are in both, and
        each is `n` times as many more. An operation over the whole model (the optimizer's
        multi-tensor step over every parameter, DDP's copies into its buckets) is one of a
        larger size in `other`: of one kind in this, another in that. Each such pair, matched by
        name (`_resized`), is one operation whose FLOPs and bytes grow by the pair's difference
        `n` times."""
        grown = Counter()
        for op in {*self.counts, *other.counts}:
            grown[op] = self.counts[op] + n * (other.counts[op] - self.counts[op])
        for was, now in _resized(self, other):  # each counted above as 1 - n of `was` and n of `now`
            grown[was] += n - 1
            grown[now] -= n
            grown[
                was._replace(
                    flops=max(0, was.flops + n * (now.flops - was.flops)),
                    bytes=max(0, was.bytes + n * (now.bytes - was.bytes)),
                )
            ] += 1
        return Ops(Counter({op: c for op, c in grown.items() if c > 0}))

    def to_json(self) -> dict[str, float]:
        moved = float(sum(op.bytes * n for op, n in self.counts.items()))
        return {"operations": self.calls, "on_dtensors": self.distributed_calls, "flops": self.flops, "bytes": moved}


class Counting(TorchDispatchMode):
    """Counts every operation dispatched under it into `ops` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = Ops()
        self._formulas = _formulas()
        from torch.distributed.tensor import DTensor  # 0.5 s to import: when a trace counts, once

        from ..strategy.activations import attention_ops

        self._attention = attention_ops()
        self._dtensor = DTensor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False) or func.namespace in ("_c10d_functional", "c10d", "prim"):
            return out
        distributed = any(isinstance(x, self._dtensor) for x in tree_leaves((args, kwargs)))
        local_args, local_kwargs, local_out = (self._local(x) for x in (args, kwargs, out))
        moved = sum(_nbytes(t) for t in tree_leaves((local_args, local_kwargs, local_out)))
        formula = self._formulas.get(func._overloadpacket) or self._formulas.get(func)
        flops = int(formula(*local_args, **local_kwargs, out_val=local_out)) if formula is not None else 0
        self.ops.counts[OpKind(flops, moved, distributed, func in self._attention, str(func))] += 1
        return out

    def _local(self, tree: Any) -> Any:
        """DTensors as their local parts: what this rank computes on."""
        return tree_map(lambda x: x._local_tensor if isinstance(x, self._dtensor) else x, tree)


def _resized(one: Ops, two: Ops) -> list[tuple[OpKind, OpKind]]:
    """The operations of `one` that are of another size in `two`: of each name (on DTensors or
    not, attention or not), those fewer in `two` beside those only in `two`, paired in order of
    size where they are as many. (Two of one name whose sizes cross between the depths would be
    paired wrong: their sizes, not their total, would be off. None was seen in ddpkit's models.)"""
    fewer: dict[tuple, list[OpKind]] = {}
    new: dict[tuple, list[OpKind]] = {}
    for op, c in one.counts.items():
        fewer.setdefault(op[2:], []).extend([op] * (c - two.counts[op]))
    for op, c in two.counts.items():
        if op not in one.counts:
            new.setdefault(op[2:], []).extend([op] * c)
    pairs = []
    for kind, larger in new.items():
        smaller = fewer.get(kind, [])
        if len(smaller) == len(larger):  # else which became which is not known: they grow in number
            pairs += zip(sorted(smaller, key=_size), sorted(larger, key=_size))
    return pairs


def _size(op: OpKind) -> tuple[int, int]:
    return op.bytes, op.flops


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _formulas() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry

    return {**flop_registry, **cpu_attention_formulas()}


def cpu_attention_formulas() -> dict[Any, Any]:
    """FLOP formulas for the CPU's fused attention kernels, which the trace runs into on fake CPU
    tensors: FlopCounterMode knows only the CUDA kernels' (torch 2.13), and counted CPU attention
    as 0. Their arguments begin as those kernels' do (grad_out, query, key, value, ...), so
    CUDA's flash-attention formulas count them."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    pairs = {
        "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
    }
    formulas = {}
    for cpu, cuda in pairs.items():
        if hasattr(aten, cpu) and getattr(aten, cuda) in flop_registry:
            formula = flop_registry[getattr(aten, cuda)]  # registered: it takes the tensors' shapes itself

            def counted(*args: Any, formula: Any = formula, **kwargs: Any) -> int:
                return formula(*args, **kwargs)

            counted._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: do not wrap it again
            formulas[getattr(aten, cpu)] = counted
    return formulas
