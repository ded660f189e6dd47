"""Which collectives a piece of work dispatches: every c10d operation on this thread, by kind,
with the bytes handed to it and the ranks of its group (`ddpkit bench layouts` on real runs,
`ddpkit plan` on fake ones)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Imports inside functions: torch's dispatch and c10d modules load when counting starts (this
# module is imported by `ddpkit bench --help`).

KINDS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "broadcast": "broadcast",
    "send": "send",  # a pipeline's activations forward, their gradients back
}


@dataclass(frozen=True)
class Op:
    """One collective call: its kind, the bytes this rank handed to it, its group's ranks; and
    how many such calls it stands for (`calls`: a plan's micro-batch repeated over the
    accumulation, or a block's over the depth, held as one entry and not as a list that long)."""

    kind: str
    bytes: int
    ranks: tuple[int, ...]
    calls: int = 1


class Collectives:
    """Inside: every c10d operation dispatched on this thread, its count and the bytes of the
    tensors handed to it, by kind (all_reduce, all_gather, reduce_scatter, broadcast, ...), and
    each call (`ops`)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.ops: list[Op] = []
        self._mode: Any = None

    def __enter__(self) -> Collectives:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func.namespace in ("c10d", "_c10d_functional"):
                    kind = _kind(func.__name__.split(".")[0])
                    if kind:
                        counter.add(Op(kind, _payload(func.namespace, kind, args), _ranks(args)))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def add(self, op: Op) -> None:
        self.ops.append(op)
        self.bytes[op.kind] = self.bytes.get(op.kind, 0) + op.bytes * op.calls
        self.calls[op.kind] = self.calls.get(op.kind, 0) + op.calls


def _kind(op: str) -> str:
    """'all_reduce', 'all_gather', 'reduce_scatter', 'broadcast' or 'send' for a c10d operation's name
    (`allreduce_`, `_allgather_base_`, `all_gather_into_tensor`, ...); '' for the rest (waits)."""
    name = op.replace("_", "")
    return next((kind for prefix, kind in KINDS.items() if name.startswith(prefix)), "")


def _payload(namespace: str, kind: str, args: Any) -> int:
    """The bytes a rank hands to the operation: its input tensors. c10d's gathers and
    reduce-scatters take (outputs, inputs, ...), its all-reduce and broadcast (tensors, ...);
    the functional collectives (input, ...)."""
    import torch

    given = args[1] if namespace == "c10d" and kind in ("all_gather", "reduce_scatter") else args[0]
    return tensor_bytes(t for t in _flat(given) if isinstance(t, torch.Tensor))


def _ranks(args: Any) -> tuple[int, ...]:
    """The global ranks of the operation's group: c10d's operations take the group itself, the
    functional ones its name; () where neither is found."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    for arg in args:
        try:
            if isinstance(arg, torch.ScriptObject):
                return tuple(dist.get_process_group_ranks(ProcessGroup.unbox(arg)))
            if isinstance(arg, str):
                return tuple(dist.get_process_group_ranks(_resolve_process_group(arg)))
        except (RuntimeError, ValueError, KeyError):
            continue  # a ReduceOp, or a string that names no group ("sum")
    return ()


def local(t: Any) -> Any:
    """A DTensor's local part (the tensor itself otherwise)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def tensor_bytes(tensors: Any) -> int:
    """The bytes of `tensors` this rank holds (DTensors: their local parts)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _flat(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value
