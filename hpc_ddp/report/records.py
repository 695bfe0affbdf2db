"""The report's own checks of a run's records (pure): a duration it may trust, its one way to sort, and when a
step was reached.

Every reader skips a record whose fields have the wrong type, or whose value no run can have written, rather
than fail: a report must work on any folder a run left, garbage included. What a number or a time stamp may be
is the ledger's rule (hpc_ddp.ledger.values), and so is how attempts.jsonl's lines merge into attempts
(hpc_ddp.ledger.attempts.merge): the report reads both through the ledger, as the supervisors do.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from hpc_ddp.ledger.values import num

T = TypeVar("T")


# ----- values ---------------------------------------------------------------------------------------------


def duration_or_none(value: Any) -> float | None:
    """A number of seconds from a record: finite and not negative (a negative stall is garbage), else None."""
    t = num(value)
    return t if t is not None and t >= 0 else None


def ordered(items: Iterable[T], key: Any = None) -> list[T]:
    """The report's one way to sort (a test counts what goes through it: the work must stay linear)."""
    return sorted(items, key=key)


# ----- when a step was reached ----------------------------------------------------------------------------


class StepClock:
    """When each step was reached, from the (time, step) points of one process start: put in step order once
    (they come in order from a run: a sort only for a file that is not), then each question is a binary
    search."""

    def __init__(self, times: Sequence[float], steps: Sequence[int]) -> None:
        if not all(map(operator.le, steps, itertools.islice(steps, 1, None))):  # a step went back: by step,
            order = ordered(range(len(steps)), key=steps.__getitem__)  # the file's order kept among equals
            times, steps = [times[i] for i in order], [steps[i] for i in order]
        self.times, self.steps = times, steps

    def __bool__(self) -> bool:
        return len(self.steps) > 0

    def at(self, step: int) -> float:
        """When `step` was reached, linearly interpolated between the points around it; before the first
        point: the first point's time, after the last: the last's."""
        j = bisect.bisect_left(self.steps, step)  # the first point at `step` or after it
        if j == 0:
            return self.times[0]
        if j == len(self.steps):
            return self.times[-1]
        (t0, s0), (t1, s1) = (self.times[j - 1], self.steps[j - 1]), (self.times[j], self.steps[j])
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)  # s0 < step <= s1
