"""Where rank 0's metrics go: sinks behind one interface, as torchtitan's BaseLogger and LoggerContainer.

The Recorder (hpc_ddp.run.records.metrics) decides what is recorded and when; each sink only writes it somewhere:

    jsonl        <folder>/metrics.jsonl: every record, one JSON line each (jsonl.py)
    tensorboard  --tensorboard: every step's scalars in <folder>/tb/ (hpc_ddp.run.records.tblog)
    trackers     --tracker wandb,mlflow: experiment trackers, one run per run folder (trackers.py,
                 wandb_run.py, mlflow_run.py)

A sink gets two kinds of calls (base.Sink): `record(record)`, each record metrics.jsonl holds, at its cadence
(a dict with "event" and "time"; hpc_ddp.run.records.metrics documents every field), and `scalars(step, values)`, a
curve's values by tag at their full rate (every step, every rank window, each save and evaluation). Adding a
destination (an experiment tracker) is one module here with a class deriving from base.Sink, built in
`optional` below; the Recorder does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.run.sinks.base import Sink, Sinks

if TYPE_CHECKING:
    from hpc_ddp.run.config import TrainConfig

__all__ = ["Sink", "Sinks", "optional"]


def optional(folder: Path, cfg: TrainConfig, params: Mapping[str, Any] | None = None) -> list[Sink]:
    """The sinks the options ask for beside metrics.jsonl, opened now (rank 0, at its start of training, once
    the run folder is settled). `params`: the run's parameters for the trackers (trackers.run_params; by
    default of the options alone)."""
    found: list[Sink] = []
    if cfg.tensorboard:
        from hpc_ddp.run.records.tblog import Board

        found.append(Board(folder))
    if cfg.tracker:
        from hpc_ddp.run.sinks import trackers

        found.extend(trackers.open_all(cfg.tracker, folder, params or trackers.run_params(cfg.as_dict())))
    return found
