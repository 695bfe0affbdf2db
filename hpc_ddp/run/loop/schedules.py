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

A task's own scheduler (`Task.scheduler(optimizer, total_steps)`) is stepped the same way, with two cases:
`total_steps` is None when the run has no known end (a stream without --max-steps): a factory, or a first
step, that needs it fails at start, one line; and a `ReduceLROnPlateau` is stepped after each evaluation with
the value --plateau-metric names (`after_evaluation`), never per optimizer step. Its state (best value, bad
evaluations, cooldown) is in every checkpoint like any scheduler's, and an evaluation cut short by a stop
steps it when it runs again: a resumed run reduces the rate where the uninterrupted one did.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.run.loop.options import SCHEDULES


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


def from_task(make: Callable[[Any, int | None], Any], optimizer: Any, total: int | None) -> Any:
    """The task's own `scheduler(optimizer, total_steps)`; what it returns must step and save its state. With
    no known total (None) its first step is tried, and undone: a schedule that needs the total fails now."""
    scheduler = make(optimizer, total)
    for needed in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(scheduler, needed, None)):
            raise TypeError(
                f"Task.scheduler returned {type(scheduler).__name__}, which has no {needed}(): return a "
                "torch.optim.lr_scheduler.LRScheduler (e.g. LambdaLR(optimizer, fn))"
            )
    if total is None and not is_plateau(scheduler):
        trial_step(scheduler, optimizer)
    return scheduler


def trial_step(scheduler: Any, optimizer: Any) -> list[float]:
    """Step `scheduler` once and put it and the optimizer's groups back as they were; the groups' rates that
    step gave. Raises what it raises."""
    import copy
    import warnings

    state = copy.deepcopy(scheduler.state_dict())
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "lr_scheduler.step() before optimizer.step()"
            scheduler.step()
        return [g["lr"] for g in optimizer.param_groups]
    finally:
        scheduler.load_state_dict(state)
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved)


def total_changed(
    old: int | None, new: int | None, step: int, before: float, after: float, own: bool, why: str
) -> str | None:
    """What a resume says when the schedule's total changed (--epochs or --max-steps raised, say on a finished
    run, as its end suggests; or another number of ranks): the schedule goes on over the new total, which for a
    decaying one moves the rate at once (a cosine near its end jumps back up). `why`: the options that changed
    it. None when nothing changed, or when the checkpoint does not say its total (written before it did). Pure."""
    if old is None or old == new:
        return None
    whose = "Task.scheduler" if own else "the LR schedule"
    moved = f"stays at {after:.4g}" if after == before else f"goes from {before:.4g} to {after:.4g}"
    when = f"at step {step}" + (" (its next step, with the new total)" if own else "")
    return (
        f"{whose}'s total changed from {old} to {new or 'unknown'} optimizer steps ({why}): it goes on over the "
        f"new total, so the learning rate {moved} {when}"
    )


def why_total(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """The options that change a run's total between a checkpoint's config (`saved`) and now's, as flags. Pure."""
    changed = [
        f"--{name.replace('_', '-')} {saved[name]} -> {now[name]}"
        for name in ("epochs", "max_steps")
        if name in saved and saved[name] != now.get(name)
    ]
    return ", ".join(changed) or "another number of ranks or --grad-accum"


def is_plateau(scheduler: Any) -> bool:
    """A scheduler stepped with an evaluation value (torch's ReduceLROnPlateau), not per optimizer step."""
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    return isinstance(scheduler, ReduceLROnPlateau)


def check_plateau(name: str, has_evaluation: bool, reports: list[str] | None) -> None:
    """A ReduceLROnPlateau can be stepped: the task evaluates, and reports NAME when that is known at start
    (`reports`: what its evaluation reports, None when only an evaluation will tell). UsageError otherwise."""
    if not has_evaluation:
        raise UsageError(
            "Task.scheduler returned ReduceLROnPlateau, which is stepped with an evaluation value, but the task "
            "has no evaluation (no Task.eval_dataset). Fix: give it an eval_dataset, or another scheduler"
        )
    if reports is not None and name not in reports:
        raise UsageError(
            f"--plateau-metric {name}: the evaluation reports {', '.join(reports)}, not {name!r}; "
            "ReduceLROnPlateau is stepped with it. Fix: --plateau-metric one of those"
        )


def after_evaluation(scheduler: Any, means: Mapping[str, float], name: str, first: bool) -> bool:
    """Step a ReduceLROnPlateau with the evaluation's value of NAME; True if it was. An evaluation that did
    not report NAME does not step it; the run's first evaluation without it is a usage error (a wrong NAME)."""
    if name not in means:
        if first:
            raise UsageError(
                f"--plateau-metric {name}: the evaluation reports {', '.join(sorted(means)) or 'nothing'}, not "
                f"{name!r}; ReduceLROnPlateau is stepped with it. Fix: --plateau-metric one of those"
            )
        return False
    scheduler.step(means[name])
    return True


def for_run(task: Any, cfg: Any, optimizer: Any, total: int | None, say: Callable[[str], None]) -> Any | None:
    """Task.scheduler(optimizer, total_steps), or --lr-schedule/--warmup-steps; a usage error for a factory
    that raises or returns something that cannot step and save, or a ReduceLROnPlateau that nothing can step
    (the same on every rank: never retried). `total` None: no known end (a stream without --max-steps), which
    a task's scheduler is told of (`say`: once, rank 0's log)."""
    if task.scheduler is None:
        return build(cfg.lr_schedule, cfg.warmup_steps, optimizer, total or 0)
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        raise UsageError(
            f"--lr-schedule {cfg.lr_schedule} --warmup-steps {cfg.warmup_steps}: this task brings its own "
            "Task.scheduler, which would be replaced. Fix: drop those flags, or Task.scheduler"
        )
    try:
        scheduler = from_task(task.scheduler, optimizer, total)
    except Exception as e:
        unknown = (
            " (total_steps is None: the dataset is a stream, which has no length, and --max-steps is not set. "
            "Fix: add --max-steps N, or a schedule that needs no total)"
            if total is None
            else ""
        )
        raise UsageError(f"Task.scheduler(optimizer, {total}) raised {type(e).__name__}: {e}{unknown}") from e
    if is_plateau(scheduler):
        reports = ["loss"] if task.eval_step is None else None
        check_plateau(cfg.plateau_metric, task.eval_dataset is not None, reports)
    if total is None:
        say(
            "Task.scheduler got total_steps=None: a stream has no length and --max-steps is not set, so "
            "its schedule cannot end at the run's last step (add --max-steps N for one that does)"
        )
    return scheduler
