"""`--tracker wandb,mlflow`: experiment trackers as sinks (wandb_run.py, mlflow_run.py), and what they share.

Rank 0 only (the Recorder's sinks exist there alone). Each tracker gets, from metrics.jsonl's records: the run's
options once (when its tracker run is made), the step records' values and every evaluation's by the tags
TensorBoard uses (`train/loss`, `eval/accuracy`...; `scalars`), each save's stall, each new best checkpoint
(its step and value), and the attempts so far with how each ended and why (attempts.jsonl, at each start).

One tracker run per run folder, across every requeue, restart and rerun: its id is kept in
`<folder>/trackers.json`, and a later start resumes it. A start whose folder has no metrics.jsonl yet (a new
run, or `--resume never --overwrite`, which moves the records aside) makes a new one. Steps: a start that
resumes from a checkpoint trains again the steps after it, which an earlier start may have logged; a tracker
never gets a step at or below the highest one logged before (`Ids.logged`, from the tracker where it can say,
else from the record its last clean end left).

The packages are optional and the user's (`pip install wandb`, `pip install mlflow-skinny`); `missing` is what
every entry point checks before torch, so that an absent one is a usage error at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.run.sinks.base import Sink

# The kit's own trackers, name -> (the module:class of its sink, the package it imports, how to install it,
# where it logs). `--tracker` takes any name of the sinks' registry (hpc_ddp.registry, entry point group
# `hpc_ddp.sinks`: these, then any installed package's); a plugin's sink brings its own imports.
TRACKERS: dict[str, tuple[str, str, str, str]] = {
    "wandb": (
        "hpc_ddp.run.sinks.wandb_run:WandbRun",
        "wandb",
        "pip install wandb",
        "wandb's own settings (WANDB_API_KEY or `wandb login`, WANDB_PROJECT; offline: WANDB_MODE=offline)",
    ),
    "mlflow": (
        "hpc_ddp.run.sinks.mlflow_run:MlflowRun",
        "mlflow",
        "pip install mlflow-skinny (or mlflow)",
        "MLFLOW_TRACKING_URI (a server; offline: sqlite:///path.db with mlflow installed, or file:<dir> with "
        "MLFLOW_ALLOW_FILE_STORE=true), MLFLOW_EXPERIMENT_NAME",
    ),
}
IDS = "trackers.json"  # in the run folder: each tracker's run id


def names(value: str) -> list[str]:
    """--tracker's comma-separated names ("" and "none": no tracker)."""
    return [n.strip() for n in value.split(",") if n.strip() and n.strip() != "none"]


def problem(value: str) -> str | None:
    """Why --tracker `value` cannot work in this Python (the fix included), or None when it can. No import:
    finding the package is enough here, and `--help` stays fast."""
    from hpc_ddp import registry

    installed = registry.sinks.names()
    for name in names(value):
        if name not in installed:
            return f"--tracker {value}: no tracker {name!r}; choose from {', '.join(installed)} (comma-separated)"
        if name not in TRACKERS:
            continue  # a plugin's: its own imports, said in one line when it is opened (registry.PluginError)
        package, install = TRACKERS[name][1], TRACKERS[name][2]
        if importlib.util.find_spec(package) is None:
            return (
                f"--tracker {name} needs the {package} package, which this Python cannot import. Fix: {install}, "
                "or drop --tracker"
            )
    return None


def run_params(config: Mapping[str, Any], optimizer: str = "", scheduler: str = "") -> dict[str, Any]:
    """The run's parameters as every tracker gets them: the kit's options in full (`config`, as run.json holds
    them), each of the task's own settings as `task_args.<key>`, and what the task's own parts replace, said:
    `optimizer` (e.g. "Task.optimizer (AdamW)"), and `lr_schedule` when the task brings its scheduler
    ("Task.scheduler (LambdaLR)"), where --lr-schedule's default would say "constant", which it is not."""
    params = {k: v for k, v in config.items() if k != "task_args"}
    if optimizer:
        params["optimizer"] = optimizer
    if scheduler:
        params["lr_schedule"] = scheduler
    for key, value in (config.get("task_args") or {}).items():
        params[f"task_args.{key}"] = value
    return params


def open_all(value: str, folder: Path, config: Mapping[str, Any]) -> list[Sink]:
    """The sinks of --tracker, each with its tracker run made or resumed."""
    from hpc_ddp import registry
    from hpc_ddp.errors import UsageError

    found: list[Sink] = []
    for name in names(value):
        settings = TRACKERS[name][3] if name in TRACKERS else "its package's settings"
        try:
            found.append(registry.sinks.load(name)(folder, config))
        except Exception as e:  # a store that cannot be reached or written: said before training starts
            for sink in found:
                sink.close()
            if isinstance(e, registry.PluginError):
                raise
            raise UsageError(
                f"--tracker {name}: its run could not be opened ({type(e).__name__}: {str(e)[:300]}). Fix: "
                f"check {settings}; or drop --tracker"
            ) from e
    return found


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's values by the tags TensorBoard uses (empty for a record without any); None and non-numbers
    left out."""
    event = record.get("event")
    values: dict[str, Any] = {}
    if event == "step":
        values = {
            "train/loss": record.get("loss"),
            "train/lr": record.get("lr"),
            "train/samples_per_s": record.get("samples_per_s"),
            "time/step_s": record.get("step_time_s"),
            "time/data_s": record.get("data_s"),
            "train/grad_norm": record.get("grad_norm"),
            **{f"train/{k}": v for k, v in (record.get("metrics") or {}).items()},
        }
    elif event == "eval":
        values = {f"eval/{k}": v for k, v in (record.get("metrics") or {}).items()}
    elif event == "save":
        values = {
            "time/checkpoint_stall_s": record.get("stall_s"),
            "time/checkpoint_write_s": record.get("write_s"),
        }
    elif event == "best":
        values = {f"best/{record.get('metric')}": record.get("value")}
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def attempt_lines(folder: Path) -> list[str]:
    """Every attempt so far, one line each (how it started; how it ended and why, and what came next)."""
    from hpc_ddp.ledger import attempts

    return [attempts.summary(a) for a in attempts.read(folder)]


def sweep_of(folder: Path) -> Path | None:
    """The sweep's folder when `folder` is one of its trials (hpc_ddp.launch.sweep: <sweep>/<trial>, the sweep's
    record beside the trial), else None: its trials' tracker runs are grouped under the sweep's name."""
    from hpc_ddp.run.folder import SWEEP_RECORD

    parent = folder.resolve().parent
    return parent if (parent / SWEEP_RECORD).is_file() else None


def shared_entry(path: Path, make: Any) -> dict[str, Any]:
    """The JSON object in `path`, made by `make()` and written by the first of the trials that ask at once
    (a hard link of a whole file: atomic on every shared file system, and the others read the first's)."""
    try:
        found = json.loads(path.read_text())
        if isinstance(found, dict):
            return found
    except (OSError, ValueError):
        pass
    made = make()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(made) + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        made = json.loads(path.read_text())
    finally:
        tmp.unlink(missing_ok=True)
    return made


class Ids:
    """`<folder>/trackers.json`: {tracker: {"id": ..., "logged": highest step logged, ...}} (rank 0 only)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / IDS
        self.folder = folder
        self.all = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            loaded = {}
        return loaded if isinstance(loaded, dict) else {}

    def continuing(self, name: str) -> dict[str, Any] | None:
        """This tracker's entry when the run goes on (the folder's records are there), else None."""
        from hpc_ddp.run.folder import METRICS

        entry = self.all.get(name)
        metrics = self.folder / METRICS
        if isinstance(entry, dict) and entry.get("id") and metrics.is_file() and metrics.stat().st_size > 0:
            return entry
        return None

    def put(self, name: str, entry: dict[str, Any]) -> None:
        from hpc_ddp.run.folder import atomic_write_bytes

        self.all = {**self._read(), name: entry}  # the other trackers' entries as they are now
        atomic_write_bytes(self.path, (json.dumps(self.all, indent=2) + "\n").encode())


class Tracked(Sink):
    """What both trackers do with the records: steps after the highest logged, the run's end state."""

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        self.folder = folder
        self.ids = Ids(folder)
        entry = self.ids.continuing(self.name)
        self.entry: dict[str, Any] = dict(entry or {})
        self.resumed = entry is not None
        self.after = int(self.entry.get("logged", -1))  # steps up to here were logged by an earlier start
        self.logged = self.after
        self.ended: Mapping[str, Any] | None = None  # this start's "end" record
        self.total = 0

    def record(self, record: Mapping[str, Any]) -> None:
        event = record.get("event")
        if event == "start":
            self.started(record, attempt_lines(self.folder))
            return
        if event == "end":
            self.ended = record
        if event == "step":
            self.total = int(record.get("total_steps") or 0)
        if event == "best":
            self.best(record)
        values = scalars_of(record)
        step = record.get("step")
        if not values or not isinstance(step, int) or step <= self.after:
            return
        self.log(step, values, float(record.get("time") or 0.0))
        self.logged = max(self.logged, step)

    def finished(self) -> bool | None:
        """True: trained to its end; False: stopped to go on later (preempted, a stop); None: failed."""
        if self.ended is None:
            return None
        return bool(self.total) and int(self.ended.get("step") or 0) >= self.total

    def remember(self) -> None:
        """The highest step logged, for the next start (a clean end's: a start killed outright leaves none)."""
        self.entry["logged"] = self.logged
        self.ids.put(self.name, self.entry)

    # ----- each tracker's own -------------------------------------------------------------------------------
    def started(self, record: Mapping[str, Any], attempts: list[str]) -> None:
        """This start: its record, and every attempt so far (this one's start included)."""

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        """Values by tag at `step`."""

    def best(self, record: Mapping[str, Any]) -> None:
        """A new best checkpoint was saved (its step, the metric's name and value)."""
