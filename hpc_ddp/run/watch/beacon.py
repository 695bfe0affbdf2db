"""What this rank is doing, and since when: the progress beacon that the hang watchdog reads.

The training thread sets it a few times per step (data, forward and backward, the gradient all-reduce, the
optimizer, the step's all-reduce, checkpoints): one clock read and one reference assignment each, about a
microsecond per step. Nothing leaves the process: no collective, no message, no file. The watchdog thread
(`run/watch/watchdog.py`) reads it about once a second, so a job of 8,000 ranks pays exactly what one rank pays,
and shared storage is touched only once a rank has been stalled past the hang threshold.

`state` is one tuple replaced whole, so a reader on another thread always sees a phase, step, start time,
"long" mark and limit that belong together (a reference assignment is atomic under the GIL).

The user's own long work (`hpc_ddp.long_work`, run/watch/longwork.py) is a phase too, long, with the limit the user
gave it (`limit_s`; None: the watchdog's own limit for the phase).

A phase is *long* when it legitimately pays a start-up cost: the phases in SLOW always; any phase the loop marks
`long=True` (the first batch of an epoch or of an evaluation, whose DataLoader workers start; every phase of
the first step after a resume or after a save or an evaluation, where ranks wait for the slowest of them). The
watchdog gives long phases the start-up limit (run/watch/watchdog.py).
"""

from __future__ import annotations

import time

STARTUP = "startup"
USER_CODE = "user code"  # the task's build function, the user's own setup
DATA = "data loading"
COMPUTE = "forward and backward"
GRAD_ALLREDUCE = "the gradient all-reduce"  # backward's compute is done; waiting for the other ranks
OPTIMIZER = "the optimizer step"
STEP_ALLREDUCE = "the step's all-reduce"  # loss and signal votes once a step; straggler rows every 5
CHECKPOINT = "a checkpoint save"  # the writer's own work: state_dict, copy to CPU, the wait for a write
CHECKPOINT_GATHER = "the checkpoint's RNG gather"  # every rank's RNG to the writer: a collective
EVALUATION = "evaluation"  # forwards over this rank's evaluation shard (run/loop/evaluator.py)
EVAL_ALLREDUCE = "the evaluation's all-reduce"  # its means and the signal votes
FINISHING = "finishing"  # final save, sync check, model.pth, barriers
USER_WORK = "the task's long work"  # hpc_ddp.long_work: "the task's long work: <what>"

# Phases in which a rank only waits for the others: a rank stalled here is a victim, not a culprit.
COLLECTIVE = frozenset({GRAD_ALLREDUCE, STEP_ALLREDUCE, CHECKPOINT_GATHER, EVAL_ALLREDUCE})
# Phases that may legitimately last long (first step's warm-up, saves): `auto` gives them the long threshold.
# An evaluation batch is one: its first pays the loader's start, and no step time measures its forwards.
SLOW = frozenset({STARTUP, USER_CODE, CHECKPOINT, FINISHING, EVALUATION})


class Beacon:
    """One rank's current phase, optimizer step, the monotonic time the phase began, whether it is long, and
    its own limit in seconds (None: the watchdog's)."""

    __slots__ = ("state",)
    # A watched rank (the hang watchdog reads its beacon) also marks the end of backward and checks for
    # stragglers every few steps (hpc_ddp.run.loop.clock): what `python -m hpc_ddp.bench watchdog` weighs.
    watched = True

    def __init__(self) -> None:
        self.state: tuple[str, int, float, bool, float | None] = (STARTUP, 0, time.monotonic(), True, None)

    def set(
        self, phase: str, step: int | None = None, long: bool = False, limit_s: float | None = None
    ) -> float:
        """Enter `phase` (at `step`, or the current one; `long`: it pays a start-up cost; `limit_s`: a limit of
        its own, the task's long work); returns the time it began."""
        now = time.monotonic()
        self.state = (phase, self.state[1] if step is None else step, now, long or phase in SLOW, limit_s)
        return now


_LOOP: list[Beacon] = []  # the beacon of this process's training loop, once the session made it


def publish(beacon: Beacon) -> None:
    """`beacon` is this process's training loop's (the session, once): `current()` returns it."""
    _LOOP[:] = [beacon]


def current() -> Beacon | None:
    """The beacon of this process's training loop, if one runs here: where the loop is, for code of the kit
    that runs inside the user's task and must know the step (the resume check's probe, hpc_ddp.doctor.probe)."""
    return _LOOP[0] if _LOOP else None


class NullBeacon(Beacon):
    """A beacon that records nothing, of an unwatched rank (no end-of-backward mark, no straggler check): the
    baseline of `python -m hpc_ddp.bench watchdog`."""

    __slots__ = ()
    watched = False

    def set(
        self, phase: str, step: int | None = None, long: bool = False, limit_s: float | None = None
    ) -> float:
        return time.monotonic()
