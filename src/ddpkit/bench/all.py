"""Run one benchmark or all of them, and print the results as a table."""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

from . import BENCHES, BenchOptions, run, summary_rows
from .common import RESULTS_DIR


def run_one(name: str, options: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    record = run(BenchOptions(name=name, **options))
    rows = summary_rows(name, record)
    print(f"{name}: {time.perf_counter() - t:.1f} s -> {record['json']}" + (f", {record['plot']}" if "plot" in record else ""))
    for label, value in rows:
        print(f"  {label:<44} {value}")
    return record


def run_all(options: dict[str, Any]) -> int:
    """Every benchmark in turn; a failing one is reported and the others still run."""
    table: list[tuple[str, str, str]] = []
    failed = []
    for name in BENCHES:
        try:
            record = run_one(name, dict(options))
        except Exception as err:  # noqa: BLE001 - one broken benchmark must not hide the rest
            traceback.print_exc()
            print(f"{name}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            failed.append(name)
            continue
        table += [(name, label, value) for label, value in summary_rows(name, record)]
    path = os.path.join(RESULTS_DIR, "SUMMARY.md")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(path, "w") as f:
        f.write(markdown_table(table))
    print(f"\nsummary table: {path}")
    if failed:
        print(f"ddpkit bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| benchmark | measure | value |", "|---|---|---|"]
    lines += [f"| {b} | {m} | {v} |" for b, m, v in rows]
    return "\n".join(lines) + "\n"
