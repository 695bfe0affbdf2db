"""Tasks for the task settings' tests (`--task task_args_tasks:NAME`, tests/ on PYTHONPATH): models shaped by
config.task_args, as a user's task reads its own settings."""

from __future__ import annotations

import torch
from slow_tasks import _data
from torch import nn

from hpc_ddp import Task


def sized(config):  # type: ignore[no-untyped-def]
    """A two-layer model as wide as the setting `width` says (a required setting: a KeyError without it)."""
    width = config.task_args["width"]
    return Task(
        model=nn.Sequential(nn.Linear(10, width), nn.Linear(width, 1)),
        dataset=_data(config.seed, 64),
        loss_fn=nn.functional.mse_loss,
    )


def scheduled(config):  # type: ignore[no-untyped-def]
    """The linear model with its own optimizer and scheduler (a tracker must not be told "constant")."""

    def optimizer(params):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(params, lr=1e-3)

    def scheduler(opt, total):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    return Task(
        model=nn.Linear(10, 1),
        dataset=_data(config.seed, 64),
        loss_fn=nn.functional.mse_loss,
        optimizer=optimizer,
        scheduler=scheduler,
    )
