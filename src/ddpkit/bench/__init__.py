"""`ddpkit bench NAME`: benchmarks of ddpkit's own parts, as programs. Each writes JSON
(hardware, versions, date, median and spread of every timing) and, where a picture says it
better, a PNG plot.

The comparisons with hand-written loops and other frameworks (`parity`, `overhead`, and the
`startup` comparison with other launchers) are not part of the installed package: they live in
the repository's benchmarks/ folder and run with `python -m benchmarks NAME` from its root,
through the same runner. `ddpkit bench startup` measures ddpkit's own start-up phases; its files
are startup-phases-DEVICE.*, beside the comparison's startup-DEVICE.*.

Every benchmark module defines:

    DESCRIPTION: str                         one line for `ddpkit bench --help`
    add_arguments(parser) -> None            optional: its own flags
    run(opts, device) -> dict                measure on device 'cpu' or 'cuda'; returns the result payload
    plot(record, path) -> None               optional: draw the PNG (record['result'] is run's payload)
    summary(result) -> list[tuple[str, str]] (label, value) rows for the `bench all` table
    RESULT_NAME: str                         optional: the stem of its default files, when not its name

Modules are imported only when their benchmark runs, so `ddpkit --help` stays fast.
"""

from __future__ import annotations

# name -> module, in the order `ddpkit bench all` runs them
BENCHES: dict[str, str] = {
    "loader": "ddpkit.bench.loader",
    "workers": "ddpkit.bench.workers",
    "precision": "ddpkit.bench.precision",
    "comm": "ddpkit.bench.comm",
    "strategies": "ddpkit.bench.strategies",
    "layouts": "ddpkit.bench.layouts",
    "checkpoint": "ddpkit.bench.checkpoint",
    "models": "ddpkit.bench.models",
    "gpt": "ddpkit.bench.gpt",
    "fast-cifar": "ddpkit.bench.fast_cifar",
    "startup": "ddpkit.bench.startup",
}
