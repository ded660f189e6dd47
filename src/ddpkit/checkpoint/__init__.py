"""Checkpoints: what a state holds and how it is saved and loaded (state.py: one file, or
through shards.py a directory of torch's Distributed Checkpoint in which every rank writes its
own shards). Files are written atomically and read without unpickling code (core/files.py).
Above the core and the strategies; below the Runtime."""

from ..core.files import load_file, save_file, verify_file
from .state import entry_names, load_into, load_state, save, sharded_model, state_of

__all__ = [
    "entry_names",
    "load_file",
    "load_into",
    "load_state",
    "save",
    "save_file",
    "sharded_model",
    "state_of",
    "verify_file",
]
