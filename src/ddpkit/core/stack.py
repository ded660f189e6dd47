"""A forked process's work, started on Python's frame stack as a fresh interpreter starts it.

CPython (3.11 on) keeps its frames in chunks of 16 KiB: a call that does not fit in the current
chunk maps a new one (`mmap`), and the return from that call unmaps it again (`munmap`). Code
whose depth goes back and forth across the end of a chunk, such as a training step's calls into
the model's modules, pays a map, an unmap and fresh pages faulted in for each of those calls.

A fresh interpreter starts its program at the foot of its first chunk, with room to spare. A
forked process starts where its parent forked it: under pytest, a notebook or a framework, that
is deep in a chunk, and where its work's depth meets the chunk's end depends on where the
parent was. Measured (CPython 3.11, `tests/test_mesh.py`'s 4-process job, forked from a pytest
fixture): about 100,000 maps and unmaps per worker, 15 times the page faults of the same job
launched from a script, and some 20% more CPU time for the test (docs/testing.md).

`on_fresh_stack` calls the work through a frame too large for any chunk of 16 KiB: CPython then
maps one chunk for it alone, of 64 KiB, in which the work starts with about 40 KiB to go before
the next chunk, wherever the parent was. On Python 3.10, whose frames are objects of their own,
it is a call like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Local variables never assigned, each a slot of the frame (8 bytes): 3,100 make a frame of
# about 24.9 KiB, which CPython (push_chunk: 16 KiB doubled until it holds the frame and 1,000
# slots more) gives a chunk of 64 KiB.
PADDING_SLOTS = 3100


def on_fresh_stack(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, its frames in a chunk of their own (see the module)."""
    return fn(*args, **kwargs)


def _padded(code: Any) -> Any:
    pad = tuple(f"_pad{i}" for i in range(PADDING_SLOTS))
    return code.replace(co_varnames=code.co_varnames + pad, co_nlocals=code.co_nlocals + len(pad))


on_fresh_stack.__code__ = _padded(on_fresh_stack.__code__)
