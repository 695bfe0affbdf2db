"""User tasks for the run-folder and fault tests, loaded as `--task robust_tasks:NAME` (tests/ on PYTHONPATH).

Each is the article's linear model on slow_tasks' data, with one thing a demanding user's task really does:
a numpy learning rate, a loss that turns NaN, an optimizer that ignores --lr, a disk that fills up for a while.
Environment variables choose when the fault happens, so that one task name (which a resume must keep) can
train cleanly first and misbehave later.
"""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import torch
from slow_tasks import _data
from torch import nn

from hpc_ddp import Task


def _sleepy_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    time.sleep(float(os.environ.get("ROBUST_SLEEP_S", "0")))
    return nn.functional.mse_loss(output, target)


def numpy_lr(config):  # type: ignore[no-untyped-def]
    """An optimizer whose learning rate is a numpy float (from a config file, an LR finder...)."""
    return Task(
        model=nn.Linear(10, 1),
        dataset=_data(config.seed),
        loss_fn=_sleepy_mse,
        optimizer=lambda params: torch.optim.SGD(params, lr=np.float64(config.lr), momentum=0.9),
    )


def fixed_lr(config):  # type: ignore[no-untyped-def]
    """An optimizer that does not take its learning rate from --lr."""
    return Task(
        model=nn.Linear(10, 1),
        dataset=_data(config.seed),
        loss_fn=_sleepy_mse,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.003),
    )


def nan_loss(config):  # type: ignore[no-untyped-def]
    """Rank $NAN_RANK's loss is NaN on its optimizer steps $NAN_STEPS (comma-separated, counted from 1 in
    this process); no NaN when $NAN_STEPS is unset."""
    steps = {int(s) for s in os.environ.get("NAN_STEPS", "").split(",") if s}
    rank = os.environ.get("NAN_RANK", "0")
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = _sleepy_mse(output, target)
        if calls[0] in steps and os.environ.get("RANK", "0") == rank:
            return loss * float("nan")
        return loss

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


def flaky_disk(config):  # type: ignore[no-untyped-def]
    """The first $FLAKY_SAVES checkpoint writes fail with ENOSPC, as on a full disk that is freed later."""
    from hpc_ddp.run.checkpoint import torchfile

    failures = [int(os.environ.get("FLAKY_SAVES", "0"))]
    real = torchfile._save_stream

    def save_stream(obj, out):  # type: ignore[no-untyped-def]
        if failures[0] > 0 and "ckpt-" in out.name:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", out.name)
        return real(obj, out)

    torchfile._save_stream = save_stream
    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=_sleepy_mse)


def torch_full_disk(config):  # type: ignore[no-untyped-def]
    """The first $FLAKY_SAVES checkpoint writes meet a full disk inside torch's zip writer, which turns the
    OSError into `RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...`."""
    from hpc_ddp.run.checkpoint import torchfile

    failures = [int(os.environ.get("FLAKY_SAVES", "0"))]
    real = torchfile._save_stream

    class FullDisk:
        def __init__(self, out):  # type: ignore[no-untyped-def]
            self.out, self.written = out, 0

        def write(self, data):  # type: ignore[no-untyped-def]
            if self.written > 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += 1
            return self.out.write(data)

        def flush(self):  # type: ignore[no-untyped-def]
            self.out.flush()

    def save_stream(obj, out):  # type: ignore[no-untyped-def]
        if failures[0] > 0 and "ckpt-" in out.name:
            failures[0] -= 1
            return torch.save(obj, FullDisk(out))
        return real(obj, out)

    torchfile._save_stream = save_stream
    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=_sleepy_mse)


def nan_after_slow_save(config):  # type: ignore[no-untyped-def]
    """nan_loss, with every checkpoint write taking $SLOW_SAVE_S longer (a slow file system)."""
    from hpc_ddp.run.checkpoint import torchfile

    real = torchfile._save_stream

    def save_stream(obj, out):  # type: ignore[no-untyped-def]
        time.sleep(float(os.environ.get("SLOW_SAVE_S", "0")))
        return real(obj, out)

    torchfile._save_stream = save_stream
    return nan_loss(config)


def fill_disk(folder: str) -> str:
    """Fill the file system of `folder` (a small tmpfs of a test) with one file: every write there then fails
    with ENOSPC, a real full disk. Returns the file's path (removing it frees the space)."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:
        for block in (b"\0" * (1 << 20), b"\0" * 4096):  # big blocks, then what they left
            try:
                while f.write(block):
                    pass
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return path


def full_for_a_while(config):  # type: ignore[no-untyped-def]
    """At its optimizer step $FULL_AT (counted in this process, from 1) rank 0 fills the run folder's file system
    (a real full disk: the test puts the folder on a small tmpfs, and frees it a while later). With $CRASH_AT,
    rank 1 of the first start raises at that step, while the disk is full: the restart starts on a full disk."""
    full_at, crash_at = int(os.environ.get("FULL_AT", "0")), int(os.environ.get("CRASH_AT", "0"))
    first_start = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        rank = os.environ.get("RANK", "0")
        if calls[0] == full_at and rank == "0" and first_start:
            fill_disk(config.folder)
            print(f"[task] the disk is full from step {calls[0]}", flush=True)
        if calls[0] == crash_at and rank == "1" and first_start:
            raise RuntimeError(f"a crash at step {calls[0]} while the disk is full (tests/robust_tasks.py)")
        return _sleepy_mse(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)
