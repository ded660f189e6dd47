"""`ddpkit report DIR [DIR...]`: several `ddpkit train --out DIR` runs compared, their curves
on one plot and their results in one table (and optionally one JSON file)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..core.files import write_json
from ..errors import UsageError
from .plots import plot_runs, plot_steps
from .tracking import read_records

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
    matplotlib writes before the image data, names it. A link is not (replacing it would put a
    file in its place and leave what it points to as it was)."""
    if os.path.islink(path):
        return False
    chunk = b"tEXtSoftware\x00" + MARK["Software"].encode()
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and chunk in head


def load_run(path: str) -> dict[str, Any]:
    """One run directory: its results, its records and a label. UsageError when it is none.

    A `ddpkit train --out` directory has results.json and metrics.jsonl (its epoch records are
    plotted); a Runtime's `log_dir` has metrics.jsonl alone, the `rt.log` records, {"step": N,
    **metrics} (its metrics are plotted against the step)."""
    if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
        raise UsageError(
            f"{path}: no metrics.jsonl (neither the --out directory of a `ddpkit train` run nor a Runtime's log_dir)"
        )
    trained = os.path.isfile(os.path.join(path, "results.json"))
    try:
        results = {}
        if trained:
            with open(os.path.join(path, "results.json")) as f:
                results = json.load(f)
    except ValueError as err:
        raise UsageError(f"{path}: unreadable results.json ({err})") from None
    if not isinstance(results, dict):
        raise UsageError(f"{path}/results.json: expected a JSON object")
    # As a run reads its own log back: a line that is not a JSON object (a torn last one, of a
    # run still going or stopped by a full disk) is left out.
    records = read_records(os.path.join(path, "metrics.jsonl"), lambda r: True)
    epochs = [r for r in records if r.get("type") == "epoch"]
    # a train run's step records have a type; a Runtime's are rt.log's, whatever their names
    steps = [r for r in records if _is_count(r.get("step")) and (not trained or r.get("type") == "step")]
    if not trained and not steps:
        raise UsageError(f"{path}/metrics.jsonl: no records of rt.log (each a JSON object with a step)")
    label = _label(path, results)
    return {"dir": path, "label": label, "results": results, "epochs": epochs, "steps": steps, "trained": trained}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_names(runs: list[dict[str, Any]], most: int = 6) -> list[str]:
    """The numeric metrics of the runs' step records, in the order first seen, at most `most`
    (the step is not one, nor a train run's record type and epoch)."""
    names: list[str] = []
    for run in runs:
        for record in run["steps"]:
            for key, value in record.items():
                internal = key == "step" or (run["trained"] and key in ("epoch", "type"))
                if _number(value) and not internal and key not in names:
                    names.append(key)
    return names[:most]


def _label(path: str, results: dict[str, Any]) -> str:
    """The directory's name, with what the run trained when results.json says it."""
    name = os.path.basename(os.path.normpath(os.path.abspath(path)))
    what = [str(results[k]) for k in ("model", "data") if results.get(k)]
    if results.get("world_size"):
        what.append(f"{results['world_size']} proc")
    return f"{name} ({', '.join(what)})" if what else name


def table_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"run": run["dir"], **{key: run["results"].get(key) for _, key, _ in COLUMNS[1:]}} for run in runs]


def _log_row(run: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A run's last step and each metric's last logged value: under "last", so that a metric
    may have any name. A last value that was not finite (rt.log writes NaN and inf as null) is
    NaN, not the finite one before it; a metric the run never logged is absent."""
    last: dict[str, Any] = {}
    for name in names:
        logged = [r[name] for r in run["steps"] if name in r and (r[name] is None or _number(r[name]))]
        if logged:
            last[name] = math.nan if logged[-1] is None else logged[-1]
    return {"run": run["dir"], "last_step": max((r["step"] for r in run["steps"]), default=None), "last": last}


def _render_log(rows: list[dict[str, Any]], names: list[str]) -> str:
    header = ["run", "last step", *(f"{n} (last)" for n in names)]
    cells = [header]
    for row in rows:
        values = [row["last_step"], *(row["last"].get(n) for n in names)]
        shown = ["-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in values]
        cells.append([row["run"], *shown])
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def render(rows: list[dict[str, Any]]) -> str:
    cells = [[h for h, _, _ in COLUMNS]]
    cells += [["-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    # text columns to the left, numbers to the right
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def report(
    dirs: Sequence[str], out: str = "report.png", json_path: str | None = None, runs: list[dict[str, Any]] | None = None
) -> None:
    """Print the runs' table, draw their curves to `out`, and write the table to `json_path`.
    `runs`: the directories already read with `load_run` (else they are read here)."""

    if not out.lower().endswith(".png"):
        raise UsageError(f"--out {out}: expected a .png file name")
    for flag, path in (("--out", out), ("--json", json_path)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: no such directory {folder}")
    runs = runs if runs is not None else [load_run(d) for d in dirs]
    if all(run["trained"] for run in runs):
        rows = table_rows(runs)
        print(render(rows))
        plot_runs([(run["label"], run["epochs"]) for run in runs], out, title="ddpkit report", metadata=MARK)
    else:  # a Runtime's log among them: what every run logged, against the step
        names = metric_names(runs)
        if not names:
            raise UsageError(f"{', '.join(dirs)}: no number was logged with rt.log, nothing to plot")
        rows = [_log_row(run, names) for run in runs]
        print(_render_log(rows, names))
        plot_steps([(run["label"], run["steps"]) for run in runs], names, out, "ddpkit report", MARK)
    print(f"plot: {out}", file=sys.stderr)
    if json_path:
        write_json(json_path, {"runs": rows, "plot": out})
