"""`--tracker wandb`: rank 0's records in a Weights & Biases run, one per run folder (see trackers.py).

wandb's own settings apply (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline...); the project defaults to
"hpc_ddp", the run's name to the folder's; a sweep's trials are one group, named as the sweep's folder. Its files go under `<folder>/wandb/`. A requeued or rerun start
calls wandb.init with the same id and resume="allow": online it continues the same run; offline each start
leaves its own `offline-run-*` folder with that id, which `wandb sync` uploads into the one run. wandb does
not capture the console here (console="off"): the kit's progress line and logs are its own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.run.sinks.trackers import Tracked, sweep_of


class WandbRun(Tracked):
    name = "wandb"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        super().__init__(folder, config)
        import wandb

        run_id = str(self.entry.get("id") or uuid.uuid4().hex[:12])
        sweep = sweep_of(folder)
        self.run: Any = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "hpc_ddp",
            id=run_id,
            resume="allow",
            name=folder.resolve().name,
            group=sweep.name if sweep is not None else None,  # a sweep's trials: one group, the sweep's name
            dir=str(folder),
            config=None if self.resumed else dict(config),  # the options, once: when the run is made
            settings=wandb.Settings(silent=True, console="off"),
        )
        # A save's and a new best's records come after later steps were logged (a save's once its write has
        # ended): they go on their own x axis, since wandb drops a step below the last it has.
        self.run.define_metric("checkpoint/step")
        self.run.define_metric("time/checkpoint_*", step_metric="checkpoint/step")
        self.run.define_metric("best/*", step_metric="best/step")
        if not self.resumed:
            self.entry = {"id": run_id}
            self.ids.put(self.name, self.entry)
        offline = bool(getattr(self.run, "offline", False))
        where = (
            f"offline in {Path(self.run.dir).parent} (`wandb sync` uploads it)" if offline else self.run.url
        )
        print(f"wandb: run {run_id} ({'resumed' if self.resumed else 'new'}): {where}", flush=True)

    def started(self, record: Mapping[str, Any], attempts: list[str]) -> None:
        self.run.summary["attempts"] = attempts
        self.run.summary["restarts"] = max(0, len(attempts) - 1)

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        if any(k.startswith("time/checkpoint_") for k in values):
            self.run.log({**values, "checkpoint/step": step})  # at wandb's current step, on its own axis
        elif any(k.startswith("best/") for k in values):
            self.run.log({**values, "best/step": step})
        else:
            self.run.log(values, step=step)

    def best(self, record: Mapping[str, Any]) -> None:
        self.run.summary["best_step"] = record.get("step")
        self.run.summary[f"best/{record.get('metric')}"] = record.get("value")

    def close(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        finished = self.finished()
        if finished is False:
            run.mark_preempting()  # stopped to go on: a requeue or the same command resumes it
        run.finish(exit_code=0 if finished is not None else 1)
        self.remember()
