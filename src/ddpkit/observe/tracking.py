"""Where a run's metrics go, written by rank 0 only: metrics.jsonl and metrics.csv always, and
TensorBoard, MLflow and Weights & Biases when asked; and the rank-0 progress bar. `ddpkit train`
(`trainer.outputs`) and a user's own loop (`Runtime(log_dir=..., log_with=...)`, `rt.log`) both
write through a `Tracking`.

ddpkit's own files go through `files`: a temp file renamed into place, never through a link,
strict JSON (NaN and infinity as null). The trackers keep their own stores, by default inside
the run directory and without the network:

- TensorBoard: event files in DIR/tensorboard (torch.utils.tensorboard);
- MLflow: a SQLite tracking store, DIR/mlflow/mlflow.db, unless MLFLOW_TRACKING_URI names one;
- W&B: an offline run in DIR/wandb, unless WANDB_MODE (or WANDB_DIR, WANDB_PROJECT) says otherwise.

Their packages are imported only when asked for: `ddpkit train`'s start-up pays for none of them.
The ids of the MLflow and W&B runs are kept in DIR/trackers.json, so that a resumed run
continues them.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import logging
import operator
import os
import posixpath
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..core import checks
from ..core.files import check_writable, json_line, json_safe, naming_full_disk, replace_with_log, write_json
from ..errors import UsageError

# Imports inside functions: each tracker's library (tensorboard 0.2 s, mlflow, wandb: optional
# installs) and tqdm load only when that tracker or bar is used.

TRACKERS = ("tensorboard", "mlflow", "wandb")
IDS = "trackers.json"  # the MLflow and W&B runs of a run directory, for a resumed run to continue
Record = dict[str, Any]


# -- checks, on every rank (a bad name or a missing package fails on all of them alike) ---------


def check_installed(name: str, what: str) -> None:
    """UsageError (`what` needs ...: pip install ...) when tracker `name`'s packages are missing."""
    for module in _modules(name):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"{what} needs the {module} package: pip install 'ddpkit[{name}]'")


def _modules(name: str) -> tuple[str, ...]:
    # MLflow's local store is SQLite through SQLAlchemy and Alembic, which mlflow-skinny leaves out.
    if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        return ("mlflow", "sqlalchemy", "alembic")
    return (name,)


def check_log_with(log_dir: str | os.PathLike | None, log_with: str | Sequence[str]) -> tuple[str, ...]:
    """`Runtime(log_with=...)`'s trackers: known, installed, and with a `log_dir` to write in."""
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise UsageError(f"Runtime(log_dir=...): a directory path, not {type(log_dir).__name__}")
    if not isinstance(log_with, (str, list, tuple)):
        raise UsageError(f"Runtime(log_with=...): a list of tracker names, not {type(log_with).__name__}")
    names = (log_with,) if isinstance(log_with, str) else tuple(log_with)  # "mlflow" is one name, not six
    for name in names:
        if name not in TRACKERS:
            raise UsageError(
                f"Runtime(log_with=...): unknown tracker {checks.shown(name)}; choose from {', '.join(TRACKERS)}"
            )
        check_installed(name, f"Runtime(log_with=[{name!r}])")
    if names and log_dir is None:
        raise UsageError("Runtime(log_with=...) needs log_dir=..., the directory the trackers write in")
    return tuple(dict.fromkeys(names))


def need_dir(log_dir: str | os.PathLike | None, call: str) -> None:
    """UsageError when `call` (rt.log, rt.log_params) has no directory to write in."""
    if log_dir is None:
        raise UsageError(f"{call} needs Runtime(log_dir=...): the directory metrics.jsonl and metrics.csv go to")


def metrics_record(step: int, metrics: dict[str, Any], trackers: Sequence[str] = ()) -> Record:
    """`rt.log`'s record, {"step": step, **metrics}, checked without waiting for the device
    (names too, against the rules of `trackers`)."""
    try:
        index = -1 if isinstance(step, bool) else operator.index(step)  # ints, NumPy's, integer tensors
    except TypeError:
        index = -1
    if index < 0:
        raise UsageError(f"rt.log: step must be an integer >= 0, got {checks.shown(step)}")
    for key, value in metrics.items():
        _check_value(key, value)
    check_names(metrics, trackers, "rt.log")
    return {"step": index, **metrics}


# MLflow's rule for metric and param names (mlflow.utils.validation, 3.x): these characters
# only, and no name a path would normalize into another one. Checked by every rank before
# anything is written, so that MLflow's refusal on rank 0 alone cannot leave a half-written record.
MLFLOW_NAME = re.compile(r"[\w.\- :/]+")


def check_names(values: dict[str, Any], trackers: Sequence[str], call: str) -> None:
    """Refuse names a tracker in `trackers` would refuse (MLflow's)."""
    if "mlflow" not in trackers:
        return
    for name in values:
        if not MLFLOW_NAME.fullmatch(name) or posixpath.normpath(name) != name or name.startswith(("/", "..")):
            raise UsageError(
                f"{call}: MLflow refuses the name {checks.shown(name)} (letters, digits, _ - . : / and spaces, "
                "not a path that normalizes to another name)"
            )


def _check_value(key: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    count = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)  # a tensor, a NumPy value
    if count != 1 or not hasattr(value, "item"):
        shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
        raise UsageError(f"rt.log: {key} must be a number or a one-element tensor, got {type(value).__name__}{shape}")


def plain(record: Record) -> Record:
    """The record with tensors and NumPy values as Python numbers (`.item()`: for a tensor on a
    GPU this waits for the device)."""
    return {k: v.item() if hasattr(v, "item") else v for k, v in record.items()}


def numbers(record: Record) -> dict[str, float]:
    """What the trackers get of an `rt.log` record: its numbers but the step (text and flags stay
    in metrics.jsonl and metrics.csv)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def progress(iterable: Any, is_main: bool, **tqdm_kwargs: Any) -> Any:
    """`iterable` in a tqdm progress bar on rank 0, shown when its stream (stderr) is a terminal
    unless `disable` says otherwise; the other ranks get `iterable` itself. The bar's len() is
    the iterable's."""
    if not is_main:
        return iterable
    from tqdm.auto import tqdm

    tqdm_kwargs.setdefault("disable", None)  # None: off when the stream is not a terminal (a log file)
    return tqdm(iterable, **tqdm_kwargs)


def open_for_runtime(log_dir: str | os.PathLike, names: Sequence[str], resume_step: int | None = None) -> Tracking:
    """`Runtime(log_dir=..., log_with=...)`'s sinks, on rank 0. A run that went on from a full
    state (`resume_step`: the optimizer steps it had taken) keeps the records of metrics.jsonl
    up to that step and continues the trackers' runs; otherwise the directory begins anew."""
    kept = []
    if resume_step is not None:
        kept = read_records(os.path.join(log_dir, "metrics.jsonl"), lambda r: r.get("step", 0) <= resume_step)
    return Tracking(log_dir, names, params_file="params.json", kept=kept, resume_step=resume_step)


class RunLog:
    """A Runtime's `log` and `log_params`: checked on every rank alike, written on rank 0 to
    sinks opened at the first record, fresh or (after `resume_at`) going on from a restored
    step. `logged`: a record was written, too late for a resume to say where the log goes on."""

    def __init__(self, log_dir: str | os.PathLike | None, log_with: str | Sequence[str], is_main: bool) -> None:
        self.names = check_log_with(log_dir, log_with)  # every rank: all fail alike
        if log_dir is not None and is_main:
            check_writable("Runtime(log_dir=...)", log_dir)
        self.log_dir, self.is_main = log_dir, is_main
        self.sinks: Tracking | None = None
        self.resume_step: int | None = None
        self.params: dict[str, Any] = {}  # log_params's, until the sinks open
        self.logged = False

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        need_dir(self.log_dir, "rt.log")
        record = metrics_record(step, metrics, self.names)
        self.logged = True
        if self.is_main:
            self._open().log(plain(record))

    def log_params(self, params: dict[str, Any]) -> None:
        need_dir(self.log_dir, "rt.log_params")
        check_names(params, self.names, "rt.log_params")
        self.params.update(params)  # written when the sinks open (the first log), or now if they are
        if self.is_main and self.sinks is not None:
            self.sinks.log_params(params)

    def resume_at(self, step: int) -> None:
        """The log keeps its records up to `step`, and goes on (with a directory to log in)."""
        if self.log_dir is not None:
            self.resume_step = step

    def close(self, exc: BaseException | None) -> None:
        sinks, self.sinks = self.sinks, None
        if sinks is not None:
            sinks.close(exc)  # the trackers' runs end as finished, or failed after `exc`

    def _open(self) -> Tracking:
        if self.sinks is None:
            self.sinks = open_for_runtime(self.log_dir, self.names, self.resume_step)
            if self.params:
                self.sinks.log_params(self.params)
        return self.sinks


def read_records(path: str, keep: Callable[[Record], bool]) -> list[Record]:
    """The records of an existing metrics.jsonl that `keep` accepts. A torn last line (a full
    disk) is dropped. (Read without following a link: a run refuses links in its directory, and
    a file of its own is all it may take records from.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return []
    kept = []
    with open(fd) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and keep(record):
                kept.append(record)
    return kept


# -- the sinks, on rank 0 -----------------------------------------------------------------------


class Tracking:
    """The sinks of one run directory, on rank 0: metrics.jsonl, metrics.csv and `trackers`.

    Args:
        directory: the run directory (made if need be).
        trackers: names among TRACKERS, checked by `check_installed` before.
        csv_fields: metrics.csv's columns (`ddpkit train`'s epoch table); None: every key seen
            so far, and a record with a new key rewrites the file with the wider header.
        csv_select: which records become rows of metrics.csv (default: all).
        kept: records of an earlier attempt that a resumed run keeps, written first.
        resume_step: the step a resumed run continues after (None: a fresh run). The trackers'
            runs in trackers.json are continued, and TensorBoard hides its events after it.
        scalars: a record -> {tag: number}, what the trackers get (default `numbers`).
        params_file: where `log_params` also writes its params, in the directory (None: nowhere).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        trackers: Sequence[str] = (),
        *,
        csv_fields: Sequence[str] | None = None,
        csv_select: Callable[[Record], bool] = lambda record: True,
        kept: Sequence[Record] = (),
        resume_step: int | None = None,
        scalars: Callable[[Record], dict[str, float]] = numbers,
        params_file: str | None = None,
    ):
        self.dir, self.scalars, self.params_file = os.fspath(directory), scalars, params_file
        self.params: dict[str, Any] = {}
        self._sinks: list[Any] = []  # closed in reverse order of opening
        try:
            self._sinks.append(JsonLines(os.path.join(self.dir, "metrics.jsonl"), kept))
            self._sinks.append(CsvTable(os.path.join(self.dir, "metrics.csv"), csv_fields, csv_select, kept))
            self._open_trackers(trackers, resume_step)
        except BaseException as err:
            self.close(err)  # what is open is closed; the error stays the one to report
            raise

    def _open_trackers(self, trackers: Sequence[str], resume_step: int | None) -> None:
        previous = _read_ids(os.path.join(self.dir, IDS)) if resume_step is not None else {}
        for name in trackers:
            self._sinks.append(OPENERS[name](self.dir, previous.get(name), resume_step))
        ids = {name: sink.ids for name, sink in zip(trackers, self._sinks[2:]) if sink.ids}
        if ids:
            write_json(os.path.join(self.dir, IDS), ids)

    def log(self, record: Record) -> None:
        """One record to metrics.jsonl and metrics.csv, and its scalars to the trackers."""
        values = self.scalars(record)
        for sink in self._sinks:
            sink.write(record, values, record.get("step", 0))

    def log_params(self, params: dict[str, Any]) -> None:
        """Hyperparameters: MLflow params, W&B config, and `params_file` (merged over calls)."""
        self.params.update(params)
        if self.params_file:
            write_json(os.path.join(self.dir, self.params_file), self.params)
        for sink in self._sinks:
            sink.log_params(params)

    def close(self, exc: BaseException | None = None) -> None:
        """Close every sink; the trackers' runs end as finished, or (after `exc`) failed or killed.
        An error while closing is raised after all are closed, unless the run failed already."""
        status = "FINISHED" if exc is None else "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        sinks, self._sinks, errors = self._sinks, [], []
        for sink in reversed(sinks):
            try:
                sink.close(status)
            except Exception as err:  # noqa: BLE001 - every sink gets closed first
                errors.append(err)
        if errors and exc is None:
            raise errors[0]


class JsonLines:
    """metrics.jsonl: one strict-JSON object per record, a line each, flushed as written."""

    ids = None

    def __init__(self, path: str, kept: Sequence[Record]):
        self.path = path
        self.file = replace_with_log(path, "".join(json_line(r) + "\n" for r in kept))

    def write(self, record: Record, values: dict[str, float], step: int) -> None:
        with naming_full_disk(self.path):
            self.file.write(json_line(record) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        self.file.close()


class CsvTable:
    """metrics.csv: a row per selected record. With fixed `fields` other keys are left out;
    without, the columns are every key seen so far (in order of appearance), and a new key
    rewrites the file with the wider header (reading back the rows written: they are not kept
    in memory). NaN is an empty cell, as it reads back from metrics.jsonl."""

    ids = None

    def __init__(
        self, path: str, fields: Sequence[str] | None, select: Callable[[Record], bool], kept: Sequence[Record]
    ):
        self.path, self.select, self.fixed = path, select, fields is not None
        rows = [json_safe(r) for r in kept if select(r)]
        self.fields = list(fields) if fields is not None else list(dict.fromkeys(k for r in rows for k in r))
        self._start(rows)

    def _start(self, rows: Iterable[dict[str, Any]]) -> None:
        buffer = io.StringIO(newline="")
        head = csv.DictWriter(buffer, self.fields, extrasaction="ignore")
        head.writeheader()
        head.writerows(rows)
        self.file = replace_with_log(self.path, buffer.getvalue(), newline="")
        self.writer = csv.DictWriter(self.file, self.fields, extrasaction="ignore")

    def write(self, record: Record, values: dict[str, float], step: int) -> None:
        if not self.select(record):
            return
        new = [k for k in record if k not in self.fields]
        if new and not self.fixed:
            self.file.close()
            rows = _read_csv(self.path)
            self.fields += new
            self._start(rows)
        with naming_full_disk(self.path):
            self.writer.writerow(json_safe(record))

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        self.file.close()


class TensorBoard:
    """Event files in DIR/tensorboard: each scalar against the step."""

    ids = None

    def __init__(self, directory: str, previous: dict | None, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides the events an earlier attempt wrote after the step resumed from
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(os.path.join(directory, "tensorboard"), purge_step=purge)

    def write(self, record: Record, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def log_params(self, params: dict[str, Any]) -> None:
        pass  # TensorBoard's hparams want final metrics too; the run directory holds the params

    def close(self, status: str) -> None:
        self.writer.close()


class MLflow:
    """A run in MLflow's tracking store (experiment MLFLOW_EXPERIMENT_NAME, default "ddpkit";
    named after the run directory): metrics against the step, hyperparameters as params."""

    def __init__(self, directory: str, previous: dict | None, resume_step: int | None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or _local_store(directory)
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self._continued(previous) or self._new_run(directory)
        self.ids = {"run_id": self.run_id, "tracking_uri": uri}

    def _continued(self, previous: dict | None) -> str | None:
        """The run of an earlier attempt, running again, if this store holds it."""
        from mlflow.exceptions import MlflowException

        if not previous or not isinstance(previous.get("run_id"), str):
            return None
        try:
            self.client.update_run(previous["run_id"], status="RUNNING")
        except MlflowException:  # another store, or the run was deleted: start a new one
            return None
        return previous["run_id"]

    def _new_run(self, directory: str) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ddpkit")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # in the local store, artifacts (ddpkit logs none) would go beside it, not to ./mlruns
            local = None if os.environ.get("MLFLOW_TRACKING_URI") else Path(directory, "mlflow", "artifacts")
            experiment_id = self.client.create_experiment(name, artifact_location=local and local.absolute().as_uri())
        run_name = os.path.basename(os.path.abspath(directory))
        return self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def write(self, record: Record, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), ms, step) for k, v in values.items()]
        for chunk in _chunks(metrics, 1000):  # MLflow's most metrics per call
            self._log_batch(metrics=chunk)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow refuses to change a param within a run: a continued run keeps its first values.
        have = self.client.get_run(self.run_id).data.params
        new = [Param(k, v if isinstance(v, str) else json_line(v)) for k, v in params.items() if k not in have]
        for chunk in _chunks(new, 100):  # MLflow's most params per call
            self._log_batch(params=chunk)

    def _log_batch(self, **entities: Any) -> None:
        """client.log_batch; a name MLflow refuses (a character it does not allow) is a UsageError."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_batch(self.run_id, **entities)
        except MlflowException as err:
            if err.error_code != "INVALID_PARAMETER_VALUE":
                raise
            raise UsageError(f"MLflow: {err.message}") from None

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _local_store(directory: str) -> str:
    """DIR/mlflow/mlflow.db as a tracking URI (MLflow's file store is deprecated)."""
    folder = os.path.abspath(os.path.join(directory, "mlflow"))
    os.makedirs(folder, exist_ok=True)
    # Creating the tables logs a few INFO lines that would land among the run's own output.
    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return "sqlite:///" + os.path.join(folder, "mlflow.db")


class WandB:
    """A Weights & Biases run: offline in DIR/wandb unless WANDB_MODE says otherwise (`wandb
    sync DIR/wandb/offline-run-*` uploads it later); project WANDB_PROJECT, default "ddpkit"."""

    def __init__(self, directory: str, previous: dict | None, resume_step: int | None):
        import wandb

        run_id = previous.get("id") if previous else None
        env = os.environ
        self.run = wandb.init(
            project=None if "WANDB_PROJECT" in env else "ddpkit",
            dir=None if "WANDB_DIR" in env else directory,
            mode=None if "WANDB_MODE" in env else "offline",  # never the network unless asked
            name=os.path.basename(os.path.abspath(directory)),
            id=run_id if isinstance(run_id, str) else None,
            resume="allow" if isinstance(run_id, str) else None,
            settings=wandb.Settings(console="off", silent=True),  # leave the run's own output alone
        )
        self.ids = {"id": self.run.id}

    def write(self, record: Record, values: dict[str, float], step: int) -> None:
        if values:  # an empty dict would still make a history row
            self.run.log(values, step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


OPENERS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


def _chunks(items: list, size: int) -> Iterable[list]:
    return (items[i : i + size] for i in range(0, len(items), size))


def _read_ids(path: str) -> dict[str, dict]:
    """trackers.json of an earlier attempt ({} if absent or unreadable), read without
    following a link, as every file a run takes from its directory."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
            ids = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, dict)} if isinstance(ids, dict) else {}


def _read_csv(path: str) -> list[dict[str, str]]:
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), newline="") as f:
        return list(csv.DictReader(f))
