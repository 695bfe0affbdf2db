"""A micro-batch's loss, the task's way: `Task.step(model, batch)`, or `loss_fn(model(input), target)`.

What the task returns is checked before it is used: a scalar loss tensor, optionally with extra metrics
(`(loss, {"name": value})`), the same names at every step and on every rank (they ride in the step's all-reduce
by position: hpc_ddp.run.loop.agreed). A mistake is a usage error that names what was found.
"""

from __future__ import annotations

from typing import Any

import torch

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import UsageError
from hpc_ddp.run.loop.evaluator import agree_names
from hpc_ddp.run.tasks import Task


class Forward:
    def __init__(self, task: Task, env: DistEnv) -> None:
        self.step_fn, self.loss_fn, self.env = task.step, task.loss_fn, env
        # The extra metrics of Task.step, agreed at the first step (a loss_fn has none).
        self.names: list[str] | None = None if task.step is not None else []

    def __call__(self, model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch's loss and extra metrics."""
        if self.step_fn is not None:
            return _loss_and_extras(self.step_fn(model, batch), self.names)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise UsageError(
                f"Task.loss_fn needs (input, target) batches, but a batch is {_kind(batch)}. Fix: give "
                "Task.step(model, batch) -> loss instead of loss_fn, which takes a batch of any structure"
            )
        inputs, target = batch
        return _loss_and_extras(self.loss_fn(model(inputs), target), [])  # type: ignore[misc]

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        """The evaluation's value without Task.eval_step: the training loss of the batch."""
        return self(model, batch)[0]

    def agree(self, extras: dict[str, Any]) -> None:
        """Once, at the first micro-batch: every rank's step must return the same extra metrics."""
        names = sorted(extras)
        agree_names(
            names,
            self.env,
            lambda theirs, rank: (
                f"Task.step returned the metrics {names} on rank {self.env.rank} but {theirs} "
                f"on rank {rank}. Fix: return the same names on every rank and every step"
            ),
        )
        self.names = names


def add(extras: dict[str, Any], more: dict[str, Any], names: list[str]) -> None:
    """Add a micro-batch's extra metrics `more` (those of `names`) into the step's sums `extras`."""
    for name in names:
        value = more[name]
        value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
        extras[name] = extras.get(name, 0.0) + value


def trainable(loss: torch.Tensor) -> None:
    """A usage error for a loss that backward cannot train the model from."""
    if not loss.requires_grad:
        raise UsageError(
            "the training step's loss does not require gradients (computed under torch.no_grad() or "
            "inference_mode(), detached, or from no trainable parameter): backward cannot train the "
            "model. Fix: compute the loss from the model's output with gradients on"
        )


def _kind(value: Any) -> str:
    return type(value).__name__ + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")


def _loss_and_extras(out: Any, names: list[str] | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """What a step returned: a scalar loss tensor, or (loss, {"name": value}); a usage error otherwise."""
    extras: Any = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, extras = out
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        found = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else _kind(out)
        raise UsageError(
            f"the training step returned {found} as its loss; expected a scalar tensor. Fix: reduce it "
            '(e.g. loss.mean()), and return loss or (loss, {"name": value, ...})'
        )
    for name, value in extras.items():
        if not isinstance(name, str) or not (
            isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        ):
            raise UsageError(
                f"Task.step returned the metric {name!r}: {_kind(value)}; expected a number or a scalar tensor "
                "named by a string"
            )
    if names is not None and sorted(extras) != names:
        raise UsageError(
            f"Task.step returned the metrics {sorted(extras)} after {names} at the first step. Fix: return "
            "the same names at every step"
        )
    return out.reshape(()), extras
