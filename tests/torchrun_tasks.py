"""User tasks for the torchrun restart tests: `--task torchrun_tasks:NAME` (tests/ on PYTHONPATH).

`fails_once` is slow_tasks.slow, except that rank 1 raises once per run folder, on its 3rd step after the
folder's first checkpoint exists (a marker file TORCHRUN_FAIL_MARKER, required, is created first): torchrun's
agent must then start a second round that resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from slow_tasks import slow

from hpc_ddp import Task


def fails_once(config):  # type: ignore[no-untyped-def]
    task: Task = slow(config)
    marker = Path(os.environ["TORCHRUN_FAIL_MARKER"])
    checkpoints = Path(config.folder) / "checkpoints"
    if os.environ.get("RANK") != "1" or marker.exists():
        return task
    calls = [0]
    inner = task.loss_fn

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if any(checkpoints.glob("ckpt-*.pt")) and not marker.exists():
            calls[0] += 1
            if calls[0] == 3:
                marker.write_text("failed once\n")
                raise RuntimeError("forced failure after the first checkpoint (tests/torchrun_tasks.py)")
        return inner(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)
