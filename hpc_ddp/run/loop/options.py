"""The loop's options (when to evaluate and --keep-best; the learning-rate schedule): parts of TrainConfig that
import no runtime code, so that importing the options costs no loop, watchdog or ledger (issue 43 item 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp.errors import UsageError
from hpc_ddp.run import options


# ----- the evaluation options -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """When to evaluate and what to keep of it (a part of hpc_ddp.run.config.TrainConfig), checked here."""

    eval_every_epochs: int = field(
        default=-1,
        metadata={
            "help": "with a task that has an eval_dataset: evaluate every N epochs, and at the end (0: only at "
            "the end; -1: 1, or 0 when --eval-every-steps is given) (default: -1)"
        },
    )
    eval_every_steps: int = field(
        default=0,
        metadata={
            "help": "evaluate every N optimizer steps instead of every epoch (unless --eval-every-epochs is "
            "given too), and at the end (0: off)"
        },
    )
    eval_batch_size: int = field(
        default=0,
        metadata={
            "help": "samples per rank per evaluation batch (0: --batch-size); no gradients, so it can be larger"
        },
    )
    keep_best: str = field(
        default="",
        metadata={
            "help": "NAME:min or NAME:max: also keep the checkpoint with the best evaluation value of NAME "
            "(e.g. accuracy:max), never rotated away; `checkpoints/best` names it"
        },
    )

    def __post_init__(self) -> None:
        self._check_eval()

    def _check_eval(self) -> None:
        if self.eval_every_epochs < -1:
            raise UsageError(
                f"--eval-every-epochs {self.eval_every_epochs}: use N >= 0, or -1 (1, or 0 with --eval-every-steps)"
            )
        options.at_least(self, 0, ["eval_every_steps", "eval_batch_size"])
        self.best_rule()  # validates --keep-best

    def eval_epochs(self) -> int:
        """Every how many epochs to evaluate (0: not by epochs): --eval-every-epochs, whose default (-1) is 1,
        or 0 when --eval-every-steps is given (then evaluations come by steps instead)."""
        if self.eval_every_epochs >= 0:
            return self.eval_every_epochs
        return 0 if self.eval_every_steps else 1

    def best_rule(self) -> tuple[str, str] | None:
        """--keep-best as (metric name, "min" or "max"), or None when off (raises UsageError when malformed)."""
        if not self.keep_best:
            return None
        name, _, direction = self.keep_best.rpartition(":")
        if not name or direction not in ("min", "max"):
            raise UsageError(
                f"--keep-best {self.keep_best!r}: expected NAME:min or NAME:max, e.g. --keep-best accuracy:max "
                "or --keep-best loss:min (NAME: a value the task's evaluation reports)"
            )
        return name, direction


SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class ScheduleOptions:
    """The learning-rate schedule (a part of hpc_ddp.run.config.TrainConfig), checked here beside it."""

    lr_schedule: str = field(
        default="constant",
        metadata={
            "help": "learning-rate schedule when the task brings none: constant, linear (to 0 at the last step) or "
            "cosine (to 0 at the last step); the last step comes from --epochs or --max-steps",
            "choices": SCHEDULES,
        },
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "optimizer steps of linear warm-up before the schedule (0: none)"}
    )
    plateau_metric: str = field(
        default="loss",
        metadata={
            "help": "a Task.scheduler that returns ReduceLROnPlateau is stepped after each evaluation with this "
            "evaluation value, instead of after each optimizer step (default: loss)"
        },
    )

    def __post_init__(self) -> None:
        self._check_schedule()

    def _check_schedule(self) -> None:
        options.choice("lr_schedule", self.lr_schedule, SCHEDULES)
        options.at_least(self, 0, ["warmup_steps"])
