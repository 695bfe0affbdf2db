"""What this rank is doing, and since when: the progress beacon that the hang watchdog reads.

The training thread sets it a few times per step (data, forward and backward, the gradient all-reduce, the
optimizer, the step's all-reduce, checkpoints): one clock read and one reference assignment each, about a
microsecond per step. Nothing leaves the process: no collective, no message, no file. The watchdog thread
(`run/watchdog.py`) reads it about once a second, so a job of 8,000 ranks pays exactly what one rank pays,
and shared storage is touched only once a rank has been stalled past the hang threshold.

`state` is one tuple replaced whole, so a reader on another thread always sees a phase, step and start time
that belong together (a reference assignment is atomic under the GIL).
"""

from __future__ import annotations

import time

STARTUP = "startup"
USER_CODE = "user code"  # the task's build function, the user's own setup
DATA = "data loading"
COMPUTE = "forward and backward"
GRAD_ALLREDUCE = "the gradient all-reduce"  # backward's compute is done; waiting for the other ranks
OPTIMIZER = "the optimizer step"
STEP_ALLREDUCE = "the step's all-reduce"  # loss and signal votes, once per optimizer step
STRAGGLER_GATHER = "the straggler check"  # one all-gather every few steps
CHECKPOINT = "a checkpoint save"
EVALUATION = "evaluation"  # forwards over this rank's evaluation shard (run/evaluator.py)
EVAL_ALLREDUCE = "the evaluation's all-reduce"  # its means and the signal votes
FINISHING = "finishing"  # final save, sync check, model.pth, barriers

# Phases in which a rank only waits for the others: a rank stalled here is a victim, not a culprit.
COLLECTIVE = frozenset({GRAD_ALLREDUCE, STEP_ALLREDUCE, STRAGGLER_GATHER, EVAL_ALLREDUCE})
# Phases that may legitimately last long (first step's warm-up, saves): `auto` gives them the long threshold.
# An evaluation batch is one: its first pays the loader's start, and no step time measures its forwards.
SLOW = frozenset({STARTUP, USER_CODE, CHECKPOINT, FINISHING, EVALUATION})


class Beacon:
    """One rank's current phase, optimizer step and the monotonic time the phase began."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: tuple[str, int, float] = (STARTUP, 0, time.monotonic())

    def set(self, phase: str, step: int | None = None) -> float:
        """Enter `phase` (at `step`, or the current one); returns the time it began."""
        now = time.monotonic()
        self.state = (phase, self.state[1] if step is None else step, now)
        return now


class NullBeacon(Beacon):
    """A beacon that records nothing: the baseline of `python -m hpc_ddp.bench watchdog`."""

    __slots__ = ()

    def set(self, phase: str, step: int | None = None) -> float:
        return time.monotonic()
