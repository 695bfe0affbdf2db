"""Where the resume check stops its run: chosen from the uninterrupted run's shape with a seeded generator. Pure.

The points a preemption can hit that an exact resume must survive (issue 32), each where the run has one:

    in the run's last step             a micro-batch of it, or a batch of its final evaluation (the resume has
                                       only the run's end left to do: the final evaluation, the epoch's
                                       record, the final save and model.pth)
    within gradient accumulation       a micro-batch before a step's last (a plain step without --grad-accum)
    during an evaluation               one of its batches
    at an epoch's last step            one before the run's last step (the next epoch follows); the whole check
                                       stops at every one of them, the run's epoch boundaries
    while a save is in flight          the step right after a checkpoint (the check delays the write)
    the first step after a resume      the step right after another stop's

The stops are taken in run order, one per attempt (stop k ends attempt k - 1; the launcher starts attempt k,
which resumes from the checkpoint the stop saved). Two stops never share a step: a stop at a step saves there,
and the next attempt begins after it. The whole check (no --stops limit) has a stop late in the run too, in its
last quarter before the last step (a state lost there is seen only by a resume after it: a counter's threshold
late in the run): the mid-step kind is drawn from there when no other stop is.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_ddp.doctor.probe import Stop

LAST = "in the run's last step"
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


def choose(shape: Shape, seed: int, limit: int = 0) -> tuple[list[Stop], list[str]]:
    """The stops (attempts numbered in run order), and a line for each kind of point not tried (the run has none,
    or, `limit` > 0, beyond the limit). `limit` > 0: that many kinds at most: first one mid-run at its earliest
    point (the most steps after it), then the run's last step, the others chosen with the same generator (a
    quicker check; the next seed tries others)."""
    rng = random.Random(seed)
    last = shape.last
    evals = dict(shape.evals or {})
    options = _options(shape)
    ends = options[EPOCH_END]
    skipped = _absent(options, bool(evals), last)
    middle_kind = ACCUM if options.get(ACCUM) else STEP
    kinds, opening = _kinds(options, middle_kind, limit, rng, last)
    picks: list[tuple[str, str, int, int]] = []  # (what, kind, step, index)
    taken: set[int] = set()
    for what in kinds:
        if 0 < limit <= len(picks):
            break
        # A stop at the step a save-in-flight stop follows would save there itself: that save would be the stop's,
        # and none would be in flight after it.
        saving = {p[2] - 1 for p in picks if p[0] == SAVE}
        if what == AFTER_RESUME:
            # The first step after one of the stops: its attempt resumes there and is stopped again at once.
            free = [
                ("train", p[2] + 1, 0)
                for p in picks
                if p[2] + 1 <= last and p[2] + 1 not in taken and p[2] + 1 not in saving
            ]
            if not free:
                skipped.append(f"{AFTER_RESUME}: every stop's next step is taken or past the end")
        else:
            free = [o for o in options[what] if o[1] not in taken and o[1] not in saving]
            if what == LAST and len({o[0] for o in free}) > 1:  # its training or its evaluation, even odds
                part = rng.choice(["train", "eval"])
                free = [o for o in free if o[0] == part]
            if what == SAVE:
                free = [o for o in free if o[1] - 1 not in taken]
                if limit <= 0:  # a save at an epoch boundary would keep the whole check from stopping there
                    free = [o for o in free if ("train", o[1] - 1, 0) not in ends] or free
        if limit <= 0 and what == middle_kind and not any(late(shape, p[2]) for p in picks if p[0] != LAST):
            free = [o for o in free if late(shape, o[1])] or free
        if what == opening and not picks:  # the earliest point: the most steps after it
            free = [min((o for o in free if o[1] < last), key=lambda o: (o[1], o[0] == "eval", o[2]))]
        elif opening and picks:  # after it: it stays the first stop in run order
            free = [o for o in free if o[1] > picks[0][2]]
        if free:
            kind, step, index = rng.choice(free)
            picks.append((what, kind, step, index))
            taken.add(step)
        elif what != AFTER_RESUME and not (opening and picks):  # said, never left out in silence
            skipped.append(
                f"{what}: each of its points is another stop's step, or right before a save's stop"
            )
    if limit <= 0:  # the whole check: every epoch boundary (a stop of any kind there is one), not only one
        saving = {p[2] - 1 for p in picks if p[0] == SAVE}
        picks += [(EPOCH_END, *o) for o in ends if o[1] not in taken and o[1] not in saving]
    if limit > 0:
        tried, said = {p[0] for p in picks}, {line.split(":")[0] for line in skipped}
        skipped += [f"{k}: beyond --stops {limit}" for k in kinds if k not in tried and k not in said]
    order = {"train": 0, "eval": 1}
    picks.sort(key=lambda p: (p[2], order[p[1]], p[3]))
    stops = [
        Stop(attempt, kind, step, index, what, save=what == SAVE)
        for attempt, (what, kind, step, index) in enumerate(picks)
    ]
    return stops, skipped


def _absent(options: Mapping[str, list[tuple[str, int, int]]], evals: bool, last: int) -> list[str]:
    """A line for each kind of point the run does not have."""
    skipped = []
    if not options[EPOCH_END]:
        skipped.append(
            f"{EPOCH_END}: no epoch ended before the run's last step, {last} (raise --epochs, and raise --steps "
            "if the run then passes the check's cap)"
        )
    if not evals:
        skipped.append(f"{EVAL}: the task has no evaluation (Task.eval_dataset)")
    if not options[SAVE]:
        skipped.append(f"{SAVE}: no checkpoint before the last step (add --save-every-steps)")
    return skipped


def _kinds(
    options: Mapping[str, list[tuple[str, int, int]]],
    middle_kind: str,
    limit: int,
    rng: random.Random,
    last: int,
) -> tuple[list[str], str]:
    """The kinds of stop in the order they are drawn, and (--stops N) the kind of the first stop, at its earliest
    point before the run's last step ('' without --stops)."""
    kinds = [k for k, found in options.items() if found] + [AFTER_RESUME]
    if limit <= 0:
        if middle_kind in kinds:  # drawn after the others: late if none of them is (see `late`)
            kinds.remove(middle_kind)
            kinds.insert(len(kinds) - 1, middle_kind)
        return kinds, ""
    # First a stop mid-run with the most steps after it (a stop in the last step alone has only the run's end
    # after it: it cannot see a state that is lost and only matters later), of a kind the seed picks; then the
    # run's last step (the hardest case: a stop, then only the run's end to do); then the other kinds in a
    # seeded order, a resume's stop after some other: the first `limit` that fit.
    middle = [k for k in kinds if k not in (LAST, AFTER_RESUME) and any(o[1] < last for o in options[k])]
    opening = rng.choice(middle) if middle else ""
    first = [k for k in (opening, LAST) if k in kinds]
    rest = rng.sample([k for k in kinds if k not in first], len(kinds) - len(first))
    if not first and rest[0] == AFTER_RESUME and len(rest) > 1:
        rest[0], rest[1] = rest[1], rest[0]
    return first + rest, opening


def _options(shape: Shape) -> dict[str, list[tuple[str, int, int]]]:
    """Each kind of stop point -> the points of it the run has, (kind, step, index)."""
    last = shape.last
    evals = dict(shape.evals or {})
    # The run's last step has an epoch record too, whether its epoch ended there or --max-steps ended the run.
    ends = [s for s in shape.epoch_ends if s in shape.micro and s < last]
    accum = [("train", s, i) for s, n in shape.micro.items() if n > 1 and s < last for i in range(n - 1)]
    return {
        # The hardest case: the run's end (final evaluation, records, final save, model.pth) is all that is left.
        LAST: [("train", last, i) for i in range(shape.micro.get(last, 0))]
        + [("eval", last, b) for b in range(evals.get(last, 0))],  # its final evaluation
        EPOCH_END: [("train", s, 0) for s in sorted(set(ends))],  # every epoch boundary before the last step
        # Before the kinds with many points: a save in flight has few, and no other stop may save before it.
        SAVE: [("train", s + 1, 0) for s in shape.saves if s + 1 <= last],
        ACCUM if accum else STEP: accum or [("train", s, 0) for s in shape.micro if 1 < s < last],
        EVAL: [("eval", s, b) for s, n in evals.items() for b in range(n)],
    }


def late(shape: Shape, step: int) -> bool:
    """`step` is in the run's last quarter, before its last step (step 61 to 79 of 80)."""
    return 4 * step > 3 * shape.last and step < shape.last


def kinds_to_try(shape: Shape, limit: int = 0) -> int:
    """How many kinds of stop point `choose` tries on `shape` (each its own step): the kinds the run has, the
    first step after a resume among them, at most `limit` (> 0)."""
    count = 1 + sum(1 for found in _options(shape).values() if found)  # + the first step after a resume
    return min(count, limit) if limit > 0 else count


def too_short(shape: Shape, limit: int, bound: str) -> str:
    """ "" when the run has a step for every kind of stop to try, else the line that refuses it: fewer steps
    could try only some kinds, and say nothing of the others. `bound`: the option that makes the run longer."""
    needed = kinds_to_try(shape, limit)
    if shape.last >= needed:
        return ""
    return (
        f"the run has {shape.last} optimizer step(s), fewer than the {needed} kinds of stop point the check "
        f"tries (each at a step of its own): a check of it would prove little. Fix: make the run longer with "
        f"{bound}, or fewer kinds with --stops {max(shape.last, 1)}"
    )


def too_long(steps: int, cap: int, bound: str) -> str:
    """The line that refuses a run of `steps` optimizer steps longer than the check's cap, --steps `cap` (0:
    its length unknown, a stream's without --max-steps, seen past the cap): the check never shortens a run (a
    shorter one would not prove it; each stop runs the rest of it again). `bound`: the options that end it."""
    has = (
        f"the run has {steps} optimizer step(s)"
        if steps
        else f"the run has more than {cap} optimizer steps (a stream's: its length is unknown until it ends)"
    )
    return (
        f"{has}, more than the check's cap, --steps {cap}: a check of a shorter run would not prove this one, "
        f"and the check never shortens it. Fix: raise --steps{f' to {steps}' if steps else ''} (each stop "
        f"runs the rest of the run again), or make the run shorter with {bound}"
    )


def describe(stop: Stop, micro: Mapping[int, int], evals: Mapping[int, int]) -> str:
    """`stop` in words: "within gradient accumulation: micro-batch 1 of 2 of step 7"."""
    if stop.kind == "eval":
        where = f"batch {stop.index + 1} of {evals.get(stop.step, '?')} of the evaluation at step {stop.step}"
    else:
        where = f"micro-batch {stop.index + 1} of {micro.get(stop.step, '?')} of step {stop.step}"
    return f"{stop.what}: {where}"
