"""The records of a run folder, parsed (pure): attempts.jsonl's lines merged per attempt, metrics.jsonl's
records cut per process start, when a step was reached, and the per-rank step times.

Every reader takes the records as `read_records` returns them (dicts, a torn line already skipped) and skips a
record whose fields have the wrong type, rather than fail: a report must work on any folder a run left.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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


# ----- attempts.jsonl -------------------------------------------------------------------------------------


def merge_attempt_lines(lines: Iterable[Mapping[str, Any]]) -> list[AttemptLine]:
    """attempts.jsonl's start and end lines merged by (job, restart), in the order each attempt first appears.
    A line without a job or restart, or with fields of the wrong type, is skipped (a torn or foreign line)."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for line in lines:
        try:
            key = (str(line["job"]), int(line["restart"]))
            time = num(line["time"])
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if time is None:
            continue
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
            )
    return [AttemptLine(**entry) for entry in merged.values()]


def int_or_none(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: json.loads reads "Infinity"
        return None


def num(value: Any) -> float | None:
    """A finite number from a record, else None (missing, null, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ----- metrics.jsonl: records cut into attempts -----------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """The metrics records of one process start (from its "start" record to the next one)."""

    start: Mapping[str, Any] | None
    records: tuple[Mapping[str, Any], ...]
    resumed: int | None = None  # without a start record: the step the previous process's end record names

    @property
    def key(self) -> tuple[str, int] | None:
        if self.start is None:
            return None
        try:
            return str(self.start.get("job")), int(self.start.get("restart") or 0)
        except (TypeError, ValueError):
            return None


def segments(records: Sequence[Mapping[str, Any]]) -> list[Segment]:
    """Cut rank 0's records into process starts: at each "start" record, and (in a folder written before
    start records existed) after each "end" record, the next process resuming at the step that end names."""
    found: list[Segment] = []
    start: Mapping[str, Any] | None = None
    resumed: int | None = None
    current: list[Mapping[str, Any]] = []
    for record in records:
        if num(record.get("time")) is None:
            continue
        ended = current and current[-1].get("event") == "end"
        if record.get("event") == "start" or ended:
            if start is not None or current:
                found.append(Segment(start, tuple(current), resumed))
            start, current = (record, []) if record.get("event") == "start" else (None, [record])
            resumed = int_or_none(found[-1].records[-1].get("step")) if ended and start is None else None
        else:
            current.append(record)
    if start is not None or current:
        found.append(Segment(start, tuple(current), resumed))
    return found


def progress_points(segment: Segment) -> list[tuple[float, int]]:
    """(time, step) of every record of the segment that has both and is written at its step: not "save",
    which is written once the checkpoint's write has ended, a few steps later."""
    points = []
    for record in segment.records:
        if record.get("event") == "save":
            continue
        t, step = num(record.get("time")), int_or_none(record.get("step"))
        if t is not None and step is not None:
            points.append((t, step))
    return points


def time_at_step(points: Sequence[tuple[float, int]], step: int) -> float:
    """When `step` was reached, linearly interpolated between the (time, step) points around it; before the
    first point: the first point's time, after the last: the last's."""
    ordered = sorted(points, key=lambda p: (p[1], p[0]))
    if step <= ordered[0][1]:
        return ordered[0][0]
    for (t0, s0), (t1, s1) in itertools.pairwise(ordered):
        if s0 <= step <= s1:
            return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return ordered[-1][0]


def heat_map(
    records: Sequence[Mapping[str, Any]], max_columns: int = 0
) -> tuple[list[int], list[list[float]]]:
    """The "ranks" records as (steps, rows): rows[rank][i] is that rank's step time (s) at steps[i]. A record
    whose list is shorter than the widest (a world-size change) leaves NaN for the missing ranks. With more
    records than `max_columns` (if set), each column is the slowest of a window of them (at its first step),
    so that a straggler's spike survives."""
    ranks = [
        r
        for r in records
        if r.get("event") == "ranks"
        and isinstance(r.get("step_time_s"), list)
        and int_or_none(r.get("step")) is not None
    ]
    width = max((len(r["step_time_s"]) for r in ranks), default=0)
    steps = [int(r["step"]) for r in ranks]
    rows = [
        [(num(r["step_time_s"][k]) if k < len(r["step_time_s"]) else None) for r in ranks]
        for k in range(width)
    ]
    if max_columns and len(steps) > max_columns:
        window = -(-len(steps) // max_columns)
        steps = steps[::window]
        rows = [
            [
                max((v for v in row[i : i + window] if v is not None), default=None)
                for i in range(0, len(row), window)
            ]
            for row in rows
        ]
    return steps, [[math.nan if v is None else v for v in row] for row in rows]
