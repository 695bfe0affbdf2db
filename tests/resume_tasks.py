"""Tasks for the resume check's tests (`--task resume_tasks:NAME`, tests/ on PYTHONPATH): the article's linear model
on slow_tasks' data, with one thing a resume cannot restore, as a user's task may have."""

from __future__ import annotations

import torch
from slow_tasks import _data
from torch import nn

from hpc_ddp import Task


def counter(config):  # type: ignore[no-untyped-def]
    """A loss scaled by a Python counter of the calls: kept nowhere, so a resumed process counts from 0 again."""
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return nn.functional.mse_loss(output, target) * (1.0 + 0.01 * calls[0])

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


class Counting(nn.Linear):
    """A linear layer with a buffer it counts its forwards in, kept out of its state_dict (persistent=False)."""

    def __init__(self) -> None:
        super().__init__(10, 1)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return super().forward(x) * (1.0 + 0.001 * self.seen)


def transient_buffer(config):  # type: ignore[no-untyped-def]
    return Task(model=Counting(), dataset=_data(config.seed), loss_fn=nn.functional.mse_loss)


def blocks_eval(config):  # type: ignore[no-untyped-def]
    """fsdp_tasks' blocks (momentum, dropout), with an evaluation set: its loss rises then falls over the first
    two epochs, so that --keep-best loss:max finds new bests at some evaluations and not at others."""
    from fsdp_tasks import blocks

    from hpc_ddp.run.tasks import _synthetic_regression

    task = blocks(config)
    task.eval_dataset = _synthetic_regression(64, 10, 1, config.seed + 1)
    return task


def _normed(config):  # type: ignore[no-untyped-def]
    from exact_tasks import Normed, _pairs

    x, y = _pairs(config.seed, 96)
    return Normed(), torch.utils.data.TensorDataset(x, y)


def batchnorm_loss_fn(config):  # type: ignore[no-untyped-def]
    """BatchNorm through `loss_fn`: the kit's forward hook (fsdp's buffer broadcast) runs before each forward."""
    model, data = _normed(config)
    return Task(model=model, dataset=data, loss_fn=nn.functional.mse_loss)


def batchnorm_step(config):  # type: ignore[no-untyped-def]
    """The same model through `Task.step`."""
    model, data = _normed(config)

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    return Task(model=model, dataset=data, step=step)


def crashing(config):  # type: ignore[no-untyped-def]
    """Raises in its third step, on every rank: a task that crashes, for the check's report of it."""
    calls = [0]

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the crashing task's third step")
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), step=step)


# ----- issue 42: the run the user will run, and everything it produces ---------------------------------------------


class LateUnfreeze(nn.Module):
    """A layer whose gradients a Python counter of forwards lets through from the 60th on (its output is the same
    before and after: only the training changes). A resumed process counts from 0 again."""

    def __init__(self) -> None:
        super().__init__()
        self.base, self.late = nn.Linear(10, 1), nn.Linear(10, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        late = self.late(x)
        if self.calls < 60:  # frozen: the same value, no gradient
            late = late.detach() + 0.0 * late
        return self.base(x) + late


def late_unfreeze(config):  # type: ignore[no-untyped-def]
    """320 samples: 80 steps with --batch-size 2 on 2 ranks, the layer unfrozen at forward 60."""
    return Task(model=LateUnfreeze(), dataset=_data(config.seed, 320), loss_fn=nn.functional.mse_loss)
