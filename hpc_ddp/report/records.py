"""The values of a run's records, checked (pure): attempts.jsonl's lines merged per attempt, the numbers and
time stamps a report may trust, and when a step was reached.

Every reader skips a record whose fields have the wrong type, or whose value no run can have written (a time
stamp before 1970 or after TIME_MAX, a step past MAX_STEP), rather than fail: a report must work on any
folder a run left, garbage included.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

TIME_MAX = 1e10  # seconds since the epoch: the year 2286. A later stamp is garbage (1e308 was one)
MAX_STEP = 2**53  # a step or count past this is garbage (and would not fit the compact arrays)

T = TypeVar("T")


@dataclass(frozen=True)
class AttemptLine:
    """One attempt as attempts.jsonl tells it: its start and end lines merged (either may be missing)."""

    job: str
    restart: int
    start_time: float | None = None
    nodes: tuple[str, ...] = ()
    resumed_from: int | None = None
    end_time: float | None = None
    outcome: str | None = None
    step: int | None = None  # the last step it reached
    checkpoint: int | None = None  # the step of the latest checkpoint when it ended
    reason: str = ""
    decision: str = ""
    left: tuple[str, ...] = ()  # restarted in place (--spare-nodes): the nodes the next step left out
    spares_in: tuple[str, ...] = ()  # ... and the spares it took in their place


# ----- values ---------------------------------------------------------------------------------------------


def int_or_none(value: Any) -> int | None:
    """An integer from a record (an integral float too), else None: missing, null, a string, out of range."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):  # json.loads reads Infinity
        return None
    return int(value) if abs(value) < MAX_STEP else None


def num(value: Any) -> float | None:
    """A finite number from a record, else None (missing, null, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def stamp(value: Any) -> float | None:
    """A time stamp from a record: seconds since the epoch, from 1970 to TIME_MAX; else None."""
    t = num(value)
    return t if t is not None and 0 <= t < TIME_MAX else None


def duration_or_none(value: Any) -> float | None:
    """A number of seconds from a record: finite and not negative (a negative stall is garbage), else None."""
    t = num(value)
    return t if t is not None and t >= 0 else None


def ordered(items: Iterable[T], key: Any = None) -> list[T]:
    """The report's one way to sort (a test counts what goes through it: the work must stay linear)."""
    return sorted(items, key=key)


# ----- attempts.jsonl -------------------------------------------------------------------------------------


def merge_attempt_lines(lines: Iterable[Mapping[str, Any]]) -> list[AttemptLine]:
    """attempts.jsonl's start and end lines merged by (job, restart), in the order each attempt first appears.
    A line without a job or restart, or with fields of the wrong type, is skipped (a torn or foreign line)."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for line in lines:
        restart, time = int_or_none(line.get("restart")), stamp(line.get("time"))
        if "job" not in line or restart is None or time is None:
            continue
        key = (str(line["job"]), restart)
        entry = merged.setdefault(key, {"job": key[0], "restart": key[1]})
        if line.get("event") == "start":
            entry["start_time"] = time
            nodes = line.get("nodes")
            entry["nodes"] = tuple(str(n) for n in nodes) if isinstance(nodes, list) else ()
            entry["resumed_from"] = int_or_none(line.get("resumed_from"))
        elif line.get("event") == "end":
            entry.update(
                end_time=time,
                outcome=str(line.get("outcome") or "") or None,
                step=int_or_none(line.get("step")),
                checkpoint=int_or_none(line.get("checkpoint")),
                reason=str(line.get("reason") or ""),
                decision=str(line.get("decision") or ""),
                left=_names(line.get("left")),
                spares_in=_names(line.get("spares_in")),
            )
    return [AttemptLine(**entry) for entry in merged.values()]


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(n) for n in value) if isinstance(value, list) else ()


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
