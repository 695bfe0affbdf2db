"""--keep-best NAME:min|max: which evaluation is the best so far, and what a checkpoint keeps of it. No torch.

The loop offers every evaluation's means (`offer`, the same on every rank: the means are all-reduced); a new
best at step S makes the save at S due, and that checkpoint, once durable and promoted, is the one the store's
`best` pointer names (hpc_ddp.run.checkpoint.store.point_best), never rotated away. The best value and its step
are in every checkpoint (the "best" part): a resumed run compares against the real best, not against the
first evaluation after the resume.

A value that is not finite (NaN, inf) is never the best, nor is an evaluation that did not report NAME; a tie
keeps the earlier checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hpc_ddp.errors import UsageError


class Best:
    """The best value of one evaluation metric so far (`value`, None before the first) and its step."""

    def __init__(self, name: str, mode: str) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode!r}: expected min or max")
        self.name, self.mode = name, mode
        self.value: float | None = None
        self.step: int | None = None
        self.reported = False  # some evaluation reported NAME (a best loaded from a checkpoint says so too)

    @property
    def flag(self) -> str:
        return f"--keep-best {self.name}:{self.mode}"

    def check_names(self, names: list[str] | tuple[str, ...]) -> None:
        """The evaluation reports `names`: NAME must be one of them (UsageError, one line, otherwise)."""
        if self.name not in names:
            raise UsageError(
                f"{self.flag}: the evaluation reports {', '.join(sorted(names)) or 'nothing'}, not "
                f"{self.name!r}. Fix: --keep-best one of those, e.g. --keep-best {sorted(names or ['loss'])[0]}"
                f":{self.mode}"
            )

    def better(self, value: float) -> bool:
        """`value` beats the best so far (strictly; a first finite value always does)."""
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.mode == "min" else value > self.value

    def offer(self, step: int, means: Mapping[str, float]) -> bool:
        """The evaluation at `step` gave `means`: True (and remembered) if it is the new best. One that did not
        report NAME cannot be (hpc_ddp.run.loop.evaluation: a missing value is missing, never 0.0); the first
        evaluation of a run that never reported it is a usage error (the name is wrong)."""
        if self.name not in means:
            if not self.reported:
                self.check_names(list(means))
            return False
        self.reported = True
        value = float(means[self.name])
        if not self.better(value):
            return False
        self.value, self.step = value, step
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mode": self.mode, "value": self.value, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> str | None:
        """Take a checkpoint's best (None: it had none). A best of another NAME:mode is not comparable: it is
        dropped, and the note returned says so."""
        if not state:
            return None
        if (state.get("name"), state.get("mode")) != (self.name, self.mode):
            return (
                f"{self.flag}: the checkpoint's best was by {state.get('name')}:{state.get('mode')}; the best "
                "is chosen anew from the next evaluation"
            )
        self.value, self.step = state.get("value"), state.get("step")
        self.reported = self.value is not None
        return None


def for_run(rule: tuple[str, str] | None, task: Any) -> Best | None:
    """--keep-best's tracker (`rule`: TrainConfig.best_rule()); a usage error now when the task cannot report
    NAME (known before training)."""
    if rule is None:
        return None
    best = Best(*rule)
    if task.eval_dataset is None:
        raise UsageError(
            f"{best.flag}: the task has no evaluation (no Task.eval_dataset). Fix: drop --keep-best, or give "
            "the task an eval_dataset"
        )
    if task.eval_step is None:  # the evaluation reports the loss only
        best.check_names(["loss"])
    return best
