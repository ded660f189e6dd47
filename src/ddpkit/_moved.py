"""The import paths of ddpkit 0.1 whose modules moved into the layer folders (core/, observe/,
checkpoint/, runtime/). `import ddpkit.dist`, `from ddpkit import dist` and
`from ddpkit.dist import rank` keep working for one release, each with a DeprecationWarning
that names the new path: the old name is the new module itself, not a copy."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    **{m: f"core.{m}" for m in ("allocator", "checks", "device", "dist", "draws", "files", "log")},
    **{m: f"core.{m}" for m in ("precision", "seed", "threads", "tree")},
    **{m: f"observe.{m}" for m in ("env", "metrics", "plots", "plotter", "report", "timeline", "tracking")},
    "shards": "checkpoint.shards",
    **{m: f"runtime.{m}" for m in ("accumulation", "early_stopping", "ema", "evaluation", "gather")},
}


def module(name: str) -> ModuleType:
    """The module that `ddpkit.<name>` was, said to have moved."""
    new = f"ddpkit.{MOVED[name]}"
    warnings.warn(
        f"ddpkit.{name} is now {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3
    )
    return importlib.import_module(new)


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `ddpkit.<old name>` (after every other finder failed) as the moved module."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != "ddpkit" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}  # by the module's own name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        found = module(spec.name.rpartition(".")[2])
        self._specs[found.__name__] = found.__spec__  # importlib sets the alias's spec on it: put its own back
        return found

    def exec_module(self, found: ModuleType) -> None:
        found.__spec__ = self._specs.pop(found.__name__)


def install() -> None:
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder())
