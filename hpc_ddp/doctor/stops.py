"""Where the resume check stops its run: chosen from the uninterrupted run's shape with a seeded generator. Pure.

The points a preemption can hit that an exact resume must survive (issue 32), each where the run has one:

    within gradient accumulation       a micro-batch before a step's last (a plain step without --grad-accum)
    during an evaluation               one of its batches
    at an epoch's last step            the run's last step among them (a stop there, then finishing)
    while a save is in flight          the step right after a checkpoint (the check delays the write)
    the first step after a resume      the step right after another stop's

The stops are taken in run order, one per attempt (stop k ends attempt k - 1; the launcher starts attempt k,
which resumes from the checkpoint the stop saved). Two stops never share a step: a stop at a step saves there,
and the next attempt begins after it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_ddp.doctor.probe import Stop

ACCUM = "within gradient accumulation"
STEP = "in the middle of a training step"  # the same point, without --grad-accum
EVAL = "during an evaluation"
EPOCH_END = "at an epoch's last step"
SAVE = "while a save is in flight"
AFTER_RESUME = "the first step after a resume"


@dataclass(frozen=True)
class Shape:
    """The uninterrupted run, as its rank 0 trace and records tell it."""

    micro: Mapping[int, int]  # step -> micro-batches (every step the run trained)
    evals: Mapping[int, int] = None  # type: ignore[assignment]  # step -> evaluation batches
    epoch_ends: Sequence[int] = ()  # the last step of each epoch that ended
    saves: Sequence[int] = ()  # steps of the checkpoints written during training (not the final one)

    @property
    def last(self) -> int:
        return max(self.micro, default=0)


def choose(shape: Shape, seed: int) -> tuple[list[Stop], list[str]]:
    """The stops (attempts numbered in run order), and a line for each kind of point the run does not have."""
    rng = random.Random(seed)
    last = shape.last
    evals = dict(shape.evals or {})
    picks: list[tuple[str, str, int, int]] = []  # (what, kind, step, index)
    skipped: list[str] = []
    taken: set[int] = set()

    def take(what: str, options: list[tuple[str, int, int]]) -> bool:
        free = [o for o in options if o[1] not in taken]
        if not free:
            return False
        kind, step, index = rng.choice(free)
        picks.append((what, kind, step, index))
        taken.add(step)
        return True

    # An epoch's last step first: the run's last epoch end, where a stop then finishing is the hardest case.
    ends = [s for s in shape.epoch_ends if s in shape.micro]
    if ends:
        take(EPOCH_END, [("train", max(ends), 0)])
    else:
        skipped.append(f"{EPOCH_END}: no epoch ended within the {last} steps checked (raise --max-steps)")
    accum = [("train", s, i) for s, n in shape.micro.items() if n > 1 and s < last for i in range(n - 1)]
    if accum:
        take(ACCUM, accum)
    else:
        take(STEP, [("train", s, 0) for s in shape.micro if 1 < s < last])
    if evals:
        take(EVAL, [("eval", s, b) for s, n in evals.items() for b in range(n)])
    else:
        skipped.append(f"{EVAL}: the task has no evaluation (Task.eval_dataset)")
    saves = [("train", s + 1, 0) for s in shape.saves if s + 1 <= last]
    if not take(SAVE, saves):
        skipped.append(f"{SAVE}: no checkpoint before the last step (add --save-every-steps)")
    if picks:
        # The first step after one of those stops: its attempt resumes there and is stopped again at once.
        after = [("train", p[2] + 1, 0) for p in picks if p[2] + 1 <= last]
        if not take(AFTER_RESUME, after):
            skipped.append(f"{AFTER_RESUME}: every stop's next step is taken or past the end")
    order = {"train": 0, "eval": 1}
    picks.sort(key=lambda p: (p[2], order[p[1]], p[3]))
    stops = [
        Stop(attempt, kind, step, index, what, save=what == SAVE)
        for attempt, (what, kind, step, index) in enumerate(picks)
    ]
    return stops, skipped


def describe(stop: Stop, micro: Mapping[int, int], evals: Mapping[int, int]) -> str:
    """`stop` in words: "within gradient accumulation: micro-batch 1 of 2 of step 7"."""
    if stop.kind == "eval":
        where = f"batch {stop.index + 1} of {evals.get(stop.step, '?')} of the evaluation at step {stop.step}"
    else:
        where = f"micro-batch {stop.index + 1} of {micro.get(stop.step, '?')} of step {stop.step}"
    return f"{stop.what}: {where}"
