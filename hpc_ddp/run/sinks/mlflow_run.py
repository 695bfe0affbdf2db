"""`--tracker mlflow`: rank 0's records in an MLflow run, one per run folder (see trackers.py).

MLflow's own settings apply: MLFLOW_TRACKING_URI (a server, or offline a `sqlite:///...` database, which needs
the full mlflow package, or a `file:` store, which MLflow 3 keeps in maintenance mode behind
MLFLOW_ALLOW_FILE_STORE=true) and MLFLOW_EXPERIMENT_NAME (default here: "hpc_ddp"). The run is named after the
folder and tagged with its path; a sweep's trial is a child run of the sweep's (named as the sweep's folder,
made by the first trial to start). Through MlflowClient, never the fluent API: no global active run in the rank.
A start that resumes asks the store for the highest step of train/loss, so that no step is logged twice even
after a start that was killed outright.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.run.sinks.trackers import Tracked, shared_entry, sweep_of

PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
PARENT = "mlflow.json"  # in a sweep's folder: the id of the sweep's parent run


class MlflowRun(Tracked):
    name = "mlflow"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        super().__init__(folder, config)
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client: Any = MlflowClient()
        if self.resumed:
            self.run_id = str(self.entry["id"])
            self.client.update_run(self.run_id, status="RUNNING")
            history = self.client.get_metric_history(self.run_id, "train/loss")
            self.after = max([self.after, *(m.step for m in history)])
            self.logged = self.after
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "hpc_ddp"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            tags = {"hpc_ddp.folder": str(folder.resolve())}
            sweep = sweep_of(folder)
            if sweep is not None:  # a sweep's trials: child runs of one parent run, the sweep's
                tags["mlflow.parentRunId"] = self._parent(experiment, sweep)
            run = self.client.create_run(experiment, run_name=folder.resolve().name, tags=tags)
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in config.items()]  # the options, once
            self.client.log_batch(self.run_id, params=params)
            self.entry = {"id": self.run_id, "tracking_uri": mlflow.get_tracking_uri()}
            self.ids.put(self.name, self.entry)
        print(
            f"mlflow: run {self.run_id} ({'resumed' if self.resumed else 'new'}) in {mlflow.get_tracking_uri()}",
            flush=True,
        )

    def _parent(self, experiment: str, sweep: Path) -> str:
        """The sweep's parent run, made by its first trial to open a run (its id in <sweep>/mlflow.json)."""

        def make() -> dict[str, Any]:
            run = self.client.create_run(experiment, run_name=sweep.name, tags={"hpc_ddp.sweep": str(sweep)})
            return {"id": run.info.run_id}

        return str(shared_entry(sweep / PARENT, make)["id"])

    def started(self, record: Mapping[str, Any], attempts: list[str]) -> None:
        self.client.log_text(self.run_id, "\n".join(attempts) + "\n", "attempts.txt")
        self.client.set_tag(self.run_id, "restarts", str(max(0, len(attempts) - 1)))

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        from mlflow.entities import Metric

        stamp = int(time_s * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in values.items()])

    def best(self, record: Mapping[str, Any]) -> None:
        self.client.set_tag(self.run_id, "best_step", str(record.get("step")))

    def close(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        finished = self.finished()
        status = {True: "FINISHED", False: "KILLED", None: "FAILED"}[finished]  # KILLED: stopped, to go on
        client.set_terminated(self.run_id, status)
        self.remember()
