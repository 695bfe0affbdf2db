"""User tasks for the progress and TensorBoard tests (`--task progress_tasks:NAME`, tests/ on PYTHONPATH)."""

from __future__ import annotations

import dataclasses
import os
import signal

from slow_tasks import slow


def crash_on_restart(config):  # type: ignore[no-untyped-def]
    """slow_tasks.slow, except that with CRASH_AT_CALL=N set, rank 1 of the first restart (SLURM_RESTART_COUNT=1)
    raises on its N-th step: a crash after the resume, so that the next start trains those steps again."""
    task = slow(config)
    at = int(os.environ.get("CRASH_AT_CALL", "0"))
    if not at or os.environ.get("RANK") != "1" or os.environ.get("SLURM_RESTART_COUNT") != "1":
        return task
    calls = [0]
    inner = task.loss_fn

    def loss_fn(output, target):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("crash on restart (tests/progress_tasks.py)")
        return inner(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)


def killed_at(config):  # type: ignore[no-untyped-def]
    """slow_tasks.slow, except that rank 0 of the first start kills itself (SIGKILL: no Python exit path runs)
    in optimizer step KILL_AT_STEP (one loss call a step): the attempt dies between two progress records."""
    task = slow(config)
    at = int(os.environ.get("KILL_AT_STEP", "0"))
    if not at or os.environ.get("RANK") != "0" or int(os.environ.get("SLURM_RESTART_COUNT") or 0):
        return task
    calls = [0]
    inner = task.loss_fn

    def loss_fn(output, target):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)
