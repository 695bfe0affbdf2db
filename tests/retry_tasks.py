"""User tasks that fail the way real jobs fail, for the retry tests: `--task retry_tasks:NAME`.

`node_fault` raises a GPU hardware error on one node only (the node, or the comma-separated nodes, named by
RETRY_BAD_NODE, as Slurm names them in SLURMD_NODENAME; the error is RETRY_ERROR, an ECC error by default), as a rank
on a broken GPU does: the job must exclude that node and finish elsewhere.
`fails_everywhere` raises the same error on every attempt before any checkpoint: a crash loop.
`fails_once_after_resume` fails once per run folder, some steps into a resumed attempt (a marker file).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from slow_tasks import _data, slow
from torch import nn

from hpc_ddp import Task
from hpc_ddp.launch.supervisor import latest_step
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore


def _failing(config, should_fail, error):  # type: ignore[no-untyped-def]
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3 and should_fail():
            raise error(calls[0])
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


def node_fault(config):  # type: ignore[no-untyped-def]
    bad = os.environ.get("RETRY_BAD_NODE", "").split(",")  # one node, or several: node2,node3
    return _failing(
        config,
        lambda: os.environ.get("SLURMD_NODENAME") in bad,
        lambda _n: RuntimeError(
            os.environ.get("RETRY_ERROR") or "CUDA error: uncorrectable ECC error encountered"
        ),
    )


def fails_everywhere(config):  # type: ignore[no-untyped-def]
    return _failing(
        config,
        lambda: os.environ.get("RANK") == "1",
        lambda n: ValueError(f"bad batch at call {n} (tests/retry_tasks.py:fails_everywhere)"),
    )


def fails_once_after_resume(config):  # type: ignore[no-untyped-def]
    """slow_tasks.slow, except that rank 1 of a resumed attempt (SLURM_RESTART_COUNT >= 1) raises on optimizer
    step RETRY_FAIL_AT_STEP (default 44; counted from the checkpoint it resumed from, one loss call a step) if
    the marker file RETRY_FAIL_MARKER (a path; required) does not exist yet, creating it first: one failure per
    run folder, some steps after the latest checkpoint, which the launcher restarts from (the steps since it
    are lost) and the next attempt completes."""
    task = slow(config)
    marker = os.environ.get("RETRY_FAIL_MARKER", "")
    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) >= 1
    if not marker or os.environ.get("RANK") != "1" or not restarted or os.path.exists(marker):
        return task
    # The checkpoint this attempt is about to resume from.
    resumed = latest_step(CheckpointStore(Path(config.folder), Local())) or 0
    at = int(os.environ.get("RETRY_FAIL_AT_STEP", "44")) - resumed
    calls = [0]
    inner = task.loss_fn

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == at and not os.path.exists(marker):
            Path(marker).write_text(f"failed at step {resumed + at}\n")
            raise RuntimeError(
                f"forced failure at step {resumed + at}, once per run folder (tests/retry_tasks.py)"
            )
        return inner(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)
