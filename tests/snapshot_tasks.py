"""User tasks for the snapshot tests (`--task snapshot_tasks:NAME`, tests/ on PYTHONPATH)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
from pathlib import Path

from slow_tasks import slow


def killed(config):  # type: ignore[no-untyped-def]
    """slow_tasks.slow, except that rank KILL_RANK of the first start kills itself (SIGKILL) in optimizer step
    KILL_AT_STEP; with LOSE_MEMORY=1 it first deletes its node's snapshot folder, as losing a machine loses its
    memory (the emulated node's folder: $HPC_DDP_SNAPSHOT_DIR/<job id>/<node name>/)."""
    task = slow(config)
    at, rank = int(os.environ.get("KILL_AT_STEP", "0")), os.environ.get("KILL_RANK", "1")
    if not at or os.environ.get("RANK") != rank or int(os.environ.get("SLURM_RESTART_COUNT") or 0):
        return task
    calls = [0]
    inner = task.loss_fn

    def loss_fn(output, target):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == at:
            if os.environ.get("LOSE_MEMORY") == "1":
                base = Path(os.environ["HPC_DDP_SNAPSHOT_DIR"])
                shutil.rmtree(base / os.environ["SLURM_JOB_ID"] / os.environ["SLURMD_NODENAME"])
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)
