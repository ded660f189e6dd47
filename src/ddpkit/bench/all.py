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
    meta: dict[str, Any] = {}
    for name in BENCHES:
        try:
            record = run_one(name, dict(options))
        except Exception as err:  # noqa: BLE001 - one broken benchmark must not hide the rest
            traceback.print_exc()
            print(f"{name}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            failed.append(name)
            continue
        table += [(name, label, value) for label, value in summary_rows(name, record)]
        meta = meta or record
    path = os.path.join(RESULTS_DIR, "SUMMARY.md")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    text = _where(meta) + markdown_table(table)
    with open(path, "w") as f:
        f.write(text)
    print(f"\nsummary table: {path}")
    readme = os.path.join(os.path.dirname(RESULTS_DIR), "README.md")
    if _replace_between_markers(readme, text):
        print(f"updated the table in {readme}")
    if failed:
        print(f"ddpkit bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


START, END = "<!-- bench-all:start -->", "<!-- bench-all:end -->"


def _replace_between_markers(path: str, text: str) -> bool:
    """Put `text` between the START and END markers of `path` (benchmarks/README.md), if it
    has them, so the table there is always the latest `bench all` run."""
    try:
        with open(path) as f:
            doc = f.read()
    except OSError:
        return False
    if START not in doc or END not in doc:
        return False
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{text}{END}{tail}")
    return True


def _where(record: dict[str, Any]) -> str:
    if not record:
        return ""
    cpu, gpu, v = record["cpu"], record.get("gpu"), record["versions"]
    device = f"{gpu['count']} x {gpu['name']}" if gpu else f"{cpu['model']}, {cpu['usable_cores']} cores, no GPU"
    return (f"`ddpkit bench all` on {record['date'][:10]}: {device}; PyTorch {v['torch']}, Python {v['python']}, "
            f"ddpkit {v['ddpkit']} ({record.get('git_commit') or 'no git'}). Per-benchmark JSON (with medians, "
            f"spread and the full record) and plots are beside this table in benchmarks/results/.\n\n")


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| benchmark | measure | value |", "|---|---|---|"]
    lines += [f"| {b} | {m} | {v} |" for b, m, v in rows]
    return "\n".join(lines) + "\n"
