"""`ddpkit bench NAME`: benchmarks as programs. Each writes JSON (hardware, versions, date,
median and spread of every timing) and, where a picture says it better, a PNG plot.

Every benchmark module defines:

    DESCRIPTION: str                         one line for `ddpkit bench --help`
    add_arguments(parser) -> None            optional: its own flags
    run(opts, device) -> dict                measure on device 'cpu' or 'cuda'; returns the result payload
    plot(record, path) -> None               optional: draw the PNG (record['result'] is run's payload)
    summary(result) -> list[tuple[str, str]] (label, value) rows for the `bench all` table

Modules are imported only when their benchmark runs, so `ddpkit --help` stays fast.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module under ddpkit.bench, in the order `ddpkit bench all` runs them
BENCHES: dict[str, str] = {
    "parity": "parity",
    "loader": "loader",
    "workers": "workers",
    "precision": "precision",
    "comm": "comm",
    "strategies": "strategies",
    "models": "models",
    "fast-cifar": "fast_cifar",
    "startup": "startup",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{BENCHES[name]}")


def run(opts: "BenchOptions") -> dict:
    """Run one benchmark, write its JSON (and plot); returns the written record."""
    from .common import load_average, resolve_device, write

    mod = module(opts.name)
    device = resolve_device(opts.device)
    before = load_average()
    result = mod.run(opts, device)
    return write(opts, device, result, getattr(mod, "plot", None), load_before=before)


def summary_rows(name: str, record: dict) -> list[tuple[str, str]]:
    mod = module(name)
    return list(mod.summary(record["result"])) if hasattr(mod, "summary") else []


from .common import BenchOptions  # noqa: E402  (re-exported for callers)
