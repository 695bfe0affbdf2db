"""User tasks that make a process's exit hang, loaded as `--task exit_tasks:NAME` (tests/ on PYTHONPATH).

Each trains the article's linear model and leaves something behind that would keep an ordinary Python
process from ending: a task must still end with its own exit code, within seconds (hpc_ddp.exitcodes.leave).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading

import torch
from slow_tasks import _data
from torch import nn

from hpc_ddp import Task


def _linear(config, loss_fn=nn.functional.mse_loss):  # type: ignore[no-untyped-def]
    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


def leftover_thread(config):  # type: ignore[no-untyped-def]
    """A non-daemon thread that never ends: interpreter shutdown would join it forever."""
    threading.Thread(target=threading.Event().wait, name="user-leftover", daemon=False).start()
    return _linear(config)


def gil_hang_at_exit(config):  # type: ignore[no-untyped-def]
    """An exit hook stuck in native code that holds the GIL (PyDLL keeps it): no Python thread can run."""
    atexit.register(lambda: ctypes.PyDLL(None).sleep(3600))
    return _linear(config)


def gil_hang_in_step(config):  # type: ignore[no-untyped-def]
    """Stuck on the 3rd step in native code holding the GIL: only a C-level timer can still end the task."""
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3 and os.environ.get("RANK", "0") == "0":
            ctypes.PyDLL(None).sleep(3600)
        return nn.functional.mse_loss(output, target)

    return _linear(config, loss_fn)


def usage_error_on_rank0(config):  # type: ignore[no-untyped-def]
    """Rank 0 alone refuses its first step with a usage error (as MLflow 3 refuses a file store) while the other
    ranks are already in the step's collective: they fail on the vanished peer a moment later (issue 42)."""
    from hpc_ddp.errors import UsageError

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK", "0") == "0":
            raise UsageError("the tracker refuses a file store. Fix: set MLFLOW_ALLOW_FILE_STORE=1")
        return nn.functional.mse_loss(output, target)

    return _linear(config, loss_fn)
