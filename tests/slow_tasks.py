"""User tasks for the tests, loaded the way a user's are: `--task slow_tasks:NAME` (tests/ on PYTHONPATH).

`slow` has dropout (global RNG), momentum (optimizer state) and a per-step sleep, so a signal can land
mid-epoch and a resume is only bitwise equal if RNG, optimizer state and data position all come back.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpc_ddp import Task


def _data(seed: int, samples: int = 512) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 10, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=gen))


def slow(config):  # type: ignore[no-untyped-def]
    delay = float(os.environ.get("SLOW_TASK_SLEEP_S", "0.02"))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(delay)
        return nn.functional.mse_loss(output, target)

    model = nn.Sequential(nn.Linear(10, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    return Task(
        model=model,
        dataset=_data(config.seed),
        loss_fn=loss_fn,
        optimizer=lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
    )


def crash(config):  # type: ignore[no-untyped-def]
    """Rank 1 raises on its 3rd step: the launcher must stop the others and show this error."""
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if os.environ.get("RANK") == "1" and calls[0] == 3:
            raise RuntimeError("boom from rank 1 (tests/slow_tasks.py:crash)")
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


def hang(config):  # type: ignore[no-untyped-def]
    """Rank 1 stops answering on its 2nd step: its peers wait in the all-reduce until --timeout-s."""
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if os.environ.get("RANK") == "1" and calls[0] == 2:
            time.sleep(3600)
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)
