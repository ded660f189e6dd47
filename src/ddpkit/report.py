"""`ddpkit report DIR [DIR...]`: several `ddpkit train --out DIR` runs compared, their curves
on one plot and their results in one table (and optionally one JSON file)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .errors import UsageError
from .files import write_json

# (column header, results.json key or row key, format)
COLUMNS = (
    ("run", "run", "{}"),
    ("model", "model", "{}"),
    ("data", "data", "{}"),
    ("world", "world_size", "{}"),
    ("batch", "global_batch_size", "{}"),
    ("epochs", "epochs", "{}"),
    ("test acc", "test_accuracy", "{:.4f}"),
    ("samples/s", "samples_per_second", "{:,.0f}"),
    ("wall s", "wall_seconds", "{:.1f}"),
)


# Written into every plot's PNG text: the plot that `ddpkit report` may replace by default.
MARK = {"Software": "ddpkit report"}


def wrote(path: str) -> bool:
    """Whether the file at `path` is a PNG that ddpkit report drew: its text chunk, which
    matplotlib writes before the image data, names it."""
    chunk = b"tEXtSoftware\x00" + MARK["Software"].encode()
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and chunk in head


def load_run(path: str) -> dict[str, Any]:
    """One run directory: its results, epoch records and a label. UsageError when it is not one."""
    for name in ("metrics.jsonl", "results.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise UsageError(f"{path}: no {name} (not the --out directory of a finished `ddpkit train` run)")
    try:
        with open(os.path.join(path, "results.json")) as f:
            results = json.load(f)
        with open(os.path.join(path, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except ValueError as err:
        raise UsageError(f"{path}: unreadable results.json or metrics.jsonl ({err})") from None
    if not isinstance(results, dict):
        raise UsageError(f"{path}/results.json: expected a JSON object")
    epochs = [r for r in records if isinstance(r, dict) and r.get("type") == "epoch"]
    return {"dir": path, "label": _label(path, results), "results": results, "epochs": epochs}


def _label(path: str, results: dict[str, Any]) -> str:
    """The directory's name, with what the run trained when results.json says it."""
    name = os.path.basename(os.path.normpath(os.path.abspath(path)))
    what = [str(results[k]) for k in ("model", "data") if results.get(k)]
    if results.get("world_size"):
        what.append(f"{results['world_size']} proc")
    return f"{name} ({', '.join(what)})" if what else name


def table_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"run": run["dir"], **{key: run["results"].get(key) for _, key, _ in COLUMNS[1:]}} for run in runs]


def render(rows: list[dict[str, Any]]) -> str:
    cells = [[h for h, _, _ in COLUMNS]]
    cells += [["-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    # text columns to the left, numbers to the right
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def report(dirs: Sequence[str], out: str = "report.png", json_path: str | None = None) -> None:
    """Print the runs' table, draw their curves to `out`, and write the table to `json_path`."""
    from .plots import plot_runs

    if not out.lower().endswith(".png"):
        raise UsageError(f"--out {out}: expected a .png file name")
    for flag, path in (("--out", out), ("--json", json_path)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: no such directory {folder}")
    runs = [load_run(d) for d in dirs]
    rows = table_rows(runs)
    print(render(rows))
    plot_runs([(run["label"], run["epochs"]) for run in runs], out, title="ddpkit report", metadata=MARK)
    print(f"plot: {out}", file=sys.stderr)
    if json_path:
        write_json(json_path, {"runs": rows, "plot": out})
