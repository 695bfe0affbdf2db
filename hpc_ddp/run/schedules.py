"""Learning-rate schedules: `--lr-schedule constant|linear|cosine` with `--warmup-steps N`, or the task's own.

A schedule multiplies each parameter group's base rate by a factor of the optimizer step, stepped once per
optimizer step (never per micro-batch, never for a step whose update was not applied). The factor is a pure
function of (step, warm-up, total), so a resumed run computes the same rates as an uninterrupted one; the
scheduler's own `state_dict` (its step count and base rates) is a part of every checkpoint.

    warm-up (steps 0 .. N-1): linear from 1/N to 1      (no warm-up: 1 from the first step)
    constant: 1                 linear: 1 -> 0 at `total`        cosine: 1 -> 0 along half a cosine at `total`

`--lr` changed on resume: the new value becomes every group's base rate and the schedule goes on from the step
it reached (the factor at that step, times the new base rate), which is what "a lower learning rate from here
on" means for a decaying schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

SCHEDULES = ("constant", "linear", "cosine")


def factor(kind: str, step: int, warmup: int, total: int) -> float:
    """The multiplier of the base rate at optimizer step `step` (0-based: the step about to be taken). Pure."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class Factor:
    """`factor` bound to its settings: a picklable callable for LambdaLR (a lambda would not be)."""

    def __init__(self, kind: str, warmup: int, total: int) -> None:
        self.kind, self.warmup, self.total = kind, warmup, total

    def __call__(self, step: int) -> float:
        return factor(self.kind, step, self.warmup, self.total)


def build(kind: str, warmup: int, optimizer: Any, total: int) -> Any | None:
    """The LambdaLR for `--lr-schedule kind --warmup-steps warmup` over `total` optimizer steps, or None when
    the rate never changes (constant without warm-up: nothing to step, nothing to save)."""
    if kind == "constant" and warmup <= 0:
        return None
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, Factor(kind, warmup, total))


def from_task(make: Callable[[Any, int], Any], optimizer: Any, total: int) -> Any:
    """The task's own `scheduler(optimizer, total_steps)`; what it returns must step and save its state."""
    scheduler = make(optimizer, total)
    for needed in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(scheduler, needed, None)):
            raise TypeError(
                f"Task.scheduler returned {type(scheduler).__name__}, which has no {needed}(): return a "
                "torch.optim.lr_scheduler.LRScheduler (e.g. LambdaLR(optimizer, fn))"
            )
    return scheduler
