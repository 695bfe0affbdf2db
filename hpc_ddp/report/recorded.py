"""metrics.jsonl compiled for the report (pure): one pass over the records, kept compact.

A run of a million steps has a million records or more (older versions wrote one a step with --log-every-s
0): each is read once, as it comes, and only what the report uses stays, in arrays of 8-byte numbers, not
the records' dicts (a dict a record was 1.8 GB for a million). `compile_records` cuts rank 0's records into
process starts (`Segment`: at each "start" record; in a folder written before start records existed, after
each "end" record) and keeps, per start, the points the plots draw and the timeline needs, and for the run,
the per-rank step times of the heat map. Evaluations ("eval" records) are few: each is kept whole
(`Evaluation`), and `Recorded.evaluations()` gives one per step, the latest (a step evaluated again after a
resume replayed it: the line the run kept).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

from hpc_ddp.ledger.values import MAX_STEP, TIME_MAX, int_or_none, num, stamp
from hpc_ddp.report.records import StepClock, duration_or_none


class Series:
    """(step, time, value) points of one kind, in the order of the file."""

    __slots__ = ("steps", "times", "values")

    def __init__(self) -> None:
        self.steps, self.times, self.values = array("q"), array("d"), array("d")

    def add(self, step: int, time: float, value: float) -> None:
        self.steps.append(step)
        self.times.append(time)
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class Evaluation:
    """One "eval" record: at `step` (end of `epoch`, or inside it), over `samples` samples, the means."""

    step: int
    epoch: int | None
    samples: int | None
    metrics: tuple[tuple[str, float], ...]  # (name, mean) in name order; a value that is no number left out


@dataclass(frozen=True)
class Best:
    """A "best" record (--keep-best): the evaluation at `step` was the best so far; `checkpoints/best` names
    that step's checkpoint."""

    step: int
    metric: str
    value: float | None


@dataclass(frozen=True)
class Save:
    step: int | None
    stall_s: float | None  # None: missing or garbage (negative); counts as 0 in the breakdown
    final: bool


@dataclass(eq=False)
class Segment:
    """What the records of one process start say (from its "start" record to the next one)."""

    start: Mapping[str, Any] | None = None  # its "start" record
    resumed: int | None = None  # without a start record: the step the previous process's end record names
    first_time: float | None = None  # its first record's time (the start record's excluded)
    last_time: float | None = None  # the latest time of its records (the start record's excluded)
    # (time, step) of every record written at its step: not "save", written once its write ended
    point_times: array = field(default_factory=lambda: array("d"))
    point_steps: array = field(default_factory=lambda: array("q"))
    saves: list[Save] = field(default_factory=list)
    end_times: list[float] = field(default_factory=list)  # its "end" records'
    last_event: str = ""
    last_step: int | None = None  # the step of its last record in the file
    losses: Series = field(default_factory=Series)  # "step" records' loss
    rates: Series = field(default_factory=Series)  # "step" records' samples_per_s > 0
    lrs: Series = field(default_factory=Series)  # "step" records' lr (the first parameter group's)
    epoch_losses: Series = field(default_factory=Series)
    epoch_rates: Series = field(default_factory=Series)  # "epoch" and "end" records' samples_per_s > 0
    first_ranks: int | None = None  # the index of its first "ranks" record in the run's heat map

    @property
    def key(self) -> tuple[str, int] | None:
        if self.start is None:
            return None
        restart = int_or_none(self.start.get("restart") or 0)
        return None if restart is None else (str(self.start.get("job")), restart)

    def clock(self) -> StepClock:
        return StepClock(self.point_times, self.point_steps)


class Heat:
    """The "ranks" records as columns: rows[rank][i] is that rank's step time (s) at steps[i], NaN where a
    record had fewer ranks (a world-size change) or no number."""

    def __init__(self) -> None:
        self.steps = array("q")
        self.rows: list[array] = []

    def add(self, step: int, times: list[Any]) -> None:
        while len(self.rows) < len(times):  # a wider record: the new ranks had no number before
            self.rows.append(array("d", [math.nan]) * len(self.steps))
        for k, row in enumerate(self.rows):
            value = num(times[k]) if k < len(times) else None
            row.append(math.nan if value is None else value)
        self.steps.append(step)

    def grid(self, max_columns: int = 0) -> tuple[list[int], list[list[float]]]:
        """(steps, rows); with more records than `max_columns` (if set), each column is the slowest of a window
        of them (at its first step), so that a straggler's spike survives."""
        window = -(-len(self.steps) // max_columns) if max_columns and len(self.steps) > max_columns else 1
        steps = list(self.steps[::window])
        rows = [
            [_max_or_nan(row[i : i + window]) for i in range(0, len(row), window)]
            if window > 1
            else list(row)
            for row in self.rows
        ]
        return steps, rows

    def column(self, index: int, max_columns: int = 0) -> int:
        """The column of `grid(max_columns)` that holds record `index`."""
        n = len(self.steps)
        return index // (-(-n // max_columns)) if max_columns and n > max_columns else index


def _max_or_nan(values: Iterable[float]) -> float:
    return max((v for v in values if not math.isnan(v)), default=math.nan)


@dataclass(eq=False)
class Recorded:
    """A run's metrics.jsonl, compiled: its process starts in order, the heat map, and the step times."""

    segments: list[Segment] = field(default_factory=list)
    heat: Heat = field(default_factory=Heat)
    step_times: array = field(default_factory=lambda: array("d"))  # "step" records' step_time_s
    end_step_times: list[float] = field(default_factory=list)  # "end" records' median_step_time_s > 0
    evals: list[Evaluation] = field(default_factory=list)  # "eval" records, in the order of the file
    # A Task.step's own values (the "step" records' `metrics`), by name: (step, time, value) in file order.
    extras: dict[str, Series] = field(default_factory=dict)
    bests: list[Best] = field(default_factory=list)  # --keep-best's "best" records, in file order

    def evaluations(self) -> list[Evaluation]:
        """One evaluation per step, in step order: the last record of each step (a resume that replays steps
        after its checkpoint evaluates them again; the later record is the kept line's)."""
        by_step = {e.step: e for e in self.evals}
        return [by_step[step] for step in sorted(by_step)]

    def eval_series(self) -> dict[str, tuple[list[int], list[float]]]:
        """Each evaluation metric's (steps, values) over `evaluations()`, by name in name order."""
        series: dict[str, tuple[list[int], list[float]]] = {}
        for e in self.evaluations():
            for name, value in e.metrics:
                steps, values = series.setdefault(name, ([], []))
                steps.append(e.step)
                values.append(value)
        return dict(sorted(series.items()))

    def extra_series(self) -> dict[str, tuple[list[int], list[float]]]:
        """Each of a Task.step's own values, (steps, values) by name in name order: one point a step, the
        last recorded (a resume that replays steps records them again; the later is the kept line's)."""
        series: dict[str, tuple[list[int], list[float]]] = {}
        for name, points in sorted(self.extras.items()):
            by_step = dict(zip(points.steps, points.values, strict=True))
            steps = sorted(by_step)
            series[name] = (steps, [by_step[k] for k in steps])
        return series

    @property
    def saves(self) -> list[Save]:
        return [save for seg in self.segments for save in seg.saves]

    def best(self) -> Best | None:
        """The checkpoint `checkpoints/best` names: the last "best" record's (None without --keep-best). A
        resume replays steps after its checkpoint; a best found again there is recorded again, so the last one
        is the kept line's."""
        return self.bests[-1] if self.bests else None

    def lrs(self) -> list[Series]:
        """Per process start, its "step" learning rates."""
        return [seg.lrs for seg in self.segments if len(seg.lrs)]

    def loss_steps(self) -> int:
        """How many distinct steps have a loss."""
        return len({step for series in self.losses() for step in series.steps})

    def smoothed_loss(self, last: int = 50) -> tuple[float, int] | None:
        """(mean, n): the training loss over the run's last `last` steps (a step replayed after a resume
        counts once, its later record), or None without step losses. A single minibatch's loss is noise."""
        by_step: dict[int, float] = {}
        for series in self.losses():
            by_step.update(zip(series.steps, series.values, strict=True))
        if not by_step:
            return None
        values = [by_step[k] for k in sorted(by_step)[-last:]]
        return sum(values) / len(values), len(values)

    def losses(self) -> list[Series]:
        """Per process start, its "step" losses; a run without any: its "epoch" losses."""
        found = [seg.losses for seg in self.segments if len(seg.losses)]
        return found or [seg.epoch_losses for seg in self.segments if len(seg.epoch_losses)]

    def rates(self) -> list[Series]:
        """Per process start, its "step" samples/s; a run without any: its "epoch" and "end" ones."""
        found = [seg.rates for seg in self.segments if len(seg.rates)]
        return found or [seg.epoch_rates for seg in self.segments if len(seg.epoch_rates)]


def compile_records(records: Iterable[Mapping[str, Any]]) -> Recorded:
    """One pass over rank 0's records (as `metrics.iter_records` yields them); a record without a valid time
    stamp, or with fields of the wrong type, is skipped or the field left out."""
    run = Recorded()
    seg: Segment | None = None
    for r in records:
        t = r.get("time")
        if t.__class__ is not float or not 0.0 <= t < TIME_MAX:  # the common case first: a float in range
            t = stamp(t)
            if t is None:
                continue
        event = r.get("event")
        if event == "start" or seg is None or seg.last_event == "end":
            resumed = seg.last_step if seg is not None and event != "start" else None
            seg = Segment(start=r if event == "start" else None, resumed=resumed)
            run.segments.append(seg)
            if event == "start":
                continue
        step = r.get("step")
        if step.__class__ is not int or not -MAX_STEP < step < MAX_STEP:
            step = int_or_none(step)
        if seg.first_time is None:
            seg.first_time = seg.last_time = t
        elif t > seg.last_time:  # type: ignore[operator]
            seg.last_time = t
        seg.last_event, seg.last_step = event if event.__class__ is str else str(event), step
        if event == "step" and step is not None:  # most records: inline
            seg.point_times.append(t)
            seg.point_steps.append(step)
            loss, rate, step_time = r.get("loss"), r.get("samples_per_s"), r.get("step_time_s")
            if loss.__class__ is float and isfinite(loss) or (loss := num(loss)) is not None:
                seg.losses.add(step, t, loss)
            if rate.__class__ is float and isfinite(rate) and rate > 0 or ((rate := num(rate)) or 0) > 0:
                seg.rates.add(step, t, rate)
            if (lr := num(r.get("lr"))) is not None:
                seg.lrs.add(step, t, lr)
            if step_time.__class__ is float and 0 <= step_time < math.inf:
                run.step_times.append(step_time)
            elif (step_time := duration_or_none(step_time)) is not None:
                run.step_times.append(step_time)
            # The gradient norm before clipping (issue 46): drawn with the task's own values, train-metrics.png.
            if (norm := num(r.get("grad_norm"))) is not None:
                run.extras.setdefault("grad_norm", Series()).add(step, t, norm)
            extras = r.get("metrics")  # absent unless the task's step returns its own values
            if extras is not None and isinstance(extras, Mapping):
                for name, value in extras.items():
                    if (value := num(value)) is not None:
                        run.extras.setdefault(str(name), Series()).add(step, t, value)
        else:
            _add(run, seg, r, event, t, step)
    return run


def _add(run: Recorded, seg: Segment, r: Mapping[str, Any], event: Any, t: float, step: int | None) -> None:
    """Record `r` (time `t`, at `step`) of process start `seg`, other than a "step" record."""
    if event == "save":
        seg.saves.append(Save(step, duration_or_none(r.get("stall_s")), bool(r.get("final"))))
        return
    if step is None:
        return
    seg.point_times.append(t)
    seg.point_steps.append(step)
    if event == "eval":
        metrics = r.get("metrics")
        if isinstance(metrics, Mapping):
            found = ((str(k), num(v)) for k, v in metrics.items())
            means = tuple(sorted((k, v) for k, v in found if v is not None))
            run.evals.append(
                Evaluation(step, int_or_none(r.get("epoch")), int_or_none(r.get("samples")), means)
            )
    elif event == "best" and isinstance(r.get("metric"), str):
        run.bests.append(Best(step, r["metric"], num(r.get("value"))))
    elif event == "ranks" and isinstance(r.get("step_time_s"), list):
        if seg.first_ranks is None:
            seg.first_ranks = len(run.heat.steps)
        run.heat.add(step, r["step_time_s"])
    elif event in ("epoch", "end"):
        if event == "epoch" and (loss := num(r.get("loss"))) is not None:
            seg.epoch_losses.add(step, t, loss)
        if (rate := num(r.get("samples_per_s"))) is not None and rate > 0:
            seg.epoch_rates.add(step, t, rate)
        if event == "end":
            seg.end_times.append(t)
            if (median := num(r.get("median_step_time_s"))) is not None and median > 0:
                run.end_step_times.append(median)


def heat_map(
    records: Iterable[Mapping[str, Any]], max_columns: int = 0
) -> tuple[list[int], list[list[float]]]:
    """The "ranks" records of `records` as (steps, rows): see Heat.grid."""
    return compile_records(records).heat.grid(max_columns)
