"""Run one benchmark or all of a registry's, write their records, and print them as a table.

A registry maps a benchmark's name to its module (see `ddpkit.bench` for what a module
defines). `ddpkit bench` runs `ddpkit.bench.BENCHES`; the repository's comparison benchmarks
(`python -m benchmarks`) run their own registry through the same functions.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time
import traceback
from types import ModuleType
from typing import Any

from ..core import device as devices
from ..core.files import write_text
from .common import RESULTS_DIR, BenchOptions, default_paths, load_average, write


def module(name: str, registry: dict[str, str]) -> ModuleType:
    return importlib.import_module(registry[name])


def run(opts: BenchOptions, registry: dict[str, str]) -> dict[str, Any]:
    """Run one benchmark, write its JSON (and plot); returns the written record."""
    mod = module(opts.name, registry)
    device = devices.device_type(opts.device)
    if opts.json_path is None and hasattr(mod, "RESULT_NAME"):  # its files named apart from a namesake's
        opts = dataclasses.replace(opts, json_path=default_paths(mod.RESULT_NAME, device)[0])
    before = load_average()
    result = mod.run(opts, device)
    return write(opts, device, result, getattr(mod, "plot", None), load_before=before)


def summary_rows(name: str, record: dict[str, Any], registry: dict[str, str]) -> list[tuple[str, str]]:
    mod = module(name, registry)
    return list(mod.summary(record["result"])) if hasattr(mod, "summary") else []


def run_one(name: str, options: dict[str, Any], registry: dict[str, str]) -> dict[str, Any]:
    t = time.perf_counter()
    record = run(BenchOptions(name=name, **options), registry)
    rows = summary_rows(name, record, registry)
    plot = f", {record['plot']}" if "plot" in record else ""
    print(f"{name}: {time.perf_counter() - t:.1f} s -> {record['json']}{plot}")
    for label, value in rows:
        print(f"  {label:<44} {value}")
    return record


def run_all(
    options: dict[str, Any], registry: dict[str, str], table: str = "bench-all", command: str = "ddpkit bench all"
) -> int:
    """Every benchmark of `registry` in turn; a failing one is reported and the others still
    run. The summary table goes to benchmarks/results/ and between the `table` markers of
    benchmarks/README.md."""
    rows: list[tuple[str, str, str]] = []
    failed = []
    meta: dict[str, Any] = {}
    for name in registry:
        try:
            record = run_one(name, dict(options), registry)
        except Exception as err:  # noqa: BLE001 - one broken benchmark must not hide the rest
            traceback.print_exc()
            print(f"{name}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            failed.append(name)
            continue
        rows += [(name, label, value) for label, value in summary_rows(name, record, registry)]
        meta = meta or record
    text = _where(meta, command) + markdown_table(rows)
    path = os.path.join(RESULTS_DIR, "SUMMARY.md" if table == "bench-all" else f"SUMMARY-{table}.md")
    write_text(path, text)
    print(f"\nsummary table: {path}")
    readme = os.path.join(os.path.dirname(RESULTS_DIR), "README.md")
    if _replace_between_markers(readme, text, table):
        print(f"updated the table in {readme}")
    if failed:
        print(f"{command}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _replace_between_markers(path: str, text: str, table: str) -> bool:
    """Put `text` between the `table` markers of `path` (benchmarks/README.md), if it has
    them, so the table there is always the latest run."""
    start, end = f"<!-- {table}:start -->", f"<!-- {table}:end -->"
    try:
        with open(path) as f:
            doc = f.read()
    except OSError:
        return False
    if start not in doc or end not in doc:
        return False
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    write_text(path, f"{head}{start}\n{text}{end}{tail}")
    return True


def _where(record: dict[str, Any], command: str) -> str:
    if not record:
        return ""
    cpu, gpu, v = record["cpu"], record.get("gpu"), record["versions"]
    device = f"{gpu['count']} x {gpu['name']}" if gpu else f"{cpu['model']}, {cpu['usable_cores']} cores, no GPU"
    return (
        f"`{command}` on {record['date'][:10]}: {device}; PyTorch {v['torch']}, Python {v['python']}, "
        f"ddpkit {v['ddpkit']} ({record.get('git_commit') or 'no git'}). Per-benchmark JSON (with medians, "
        f"spread and the full record) and plots are beside this table in benchmarks/results/.\n\n"
    )


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| benchmark | measure | value |", "|---|---|---|"]
    lines += [f"| {b} | {m} | {v} |" for b, m, v in rows]
    return "\n".join(lines) + "\n"
