"""Where a run's allocation went, computed from its records alone (pure: no files, no clock, no plotting).

Every time is in seconds: wall-clock stamps are seconds since the epoch, as the records carry them. An attempt
is one start of the run's processes, identified by (job, restart). Its allocated time is cut into five parts
that add up to it exactly:

    startup      process start -> first step (the start record's startup_s)
    productive   first step -> the last step that was kept (and its save), minus the stalls of saves up to it
    stalls       the time saves held the training thread (every save record's stall_s)
    lost         the last kept step -> the attempt's last step, minus the stalls of saves in between: steps
                 trained and then thrown away, because the attempt ended (failure, hang, preemption) after
                 its last checkpoint and the next attempt replays them from that checkpoint
    after        the attempt's last step (its end record, else its last record) -> its end: writing
                 model.pth, teardown, hang detection, exit (for a running attempt: nothing yet)

    allocated = startup + productive + stalls + lost + after = end - process start, summed over attempts
    goodput   = productive / allocated

The time an attempt's job waited in the queue after the previous attempt (Slurm's accounting when there is
one, else the gap between the previous attempt's end and this one's process start) is shown beside it but is
not allocated time. The checkpoint interval that would have maximised goodput given the failures seen is
Young's (Daly's first order): tau = sqrt(2 x save cost x MTBF), with the save cost the mean stall of a save
and MTBF = allocated time / failures, all in seconds.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hpc_ddp.report.records import (
    AttemptLine,
    Segment,
    int_or_none,
    num,
    progress_points,
    segments,
    time_at_step,
)

# Ends that lose the work since the last checkpoint and that checkpointing more often would have saved: these
# count as failures for the MTBF. A preemption saves at an agreed step and loses nothing (unless it lost
# steps: then it counts too).
FAILURE_OUTCOMES = frozenset({"failed", "hang", "node_fail", "lost"})  # hpc_ddp.ledger.outcomes.FAILURES


@dataclass(frozen=True)
class Window:
    """Queue and run times that Slurm's accounting gives for one attempt (seconds since the epoch)."""

    start: float
    end: float | None


@dataclass(frozen=True)
class Attempt:
    """One attempt, its numbers in seconds (times: seconds since the epoch) and steps."""

    job: str
    restart: int
    process_start: float
    first_step: float | None  # None: it never reached a step
    end: float
    outcome: str  # attempts.jsonl's, else from metrics: "completed", "stopped", "ended", "running" or "cut"
    resumed_at: int  # the step it started from
    last_step: int
    kept_step: int  # its last step that the run kept (== last_step unless steps were lost)
    startup_s: float
    productive_s: float
    stalls_s: float
    lost_s: float
    after_s: float
    saves: int
    queue_before_s: float  # in the queue before it, after the previous attempt ended (0 for the first)
    nodes: tuple[str, ...] = ()
    reason: str = ""
    decision: str = ""

    @property
    def allocated_s(self) -> float:
        return self.end - self.process_start

    @property
    def lost_steps(self) -> int:
        return self.last_step - self.kept_step

    @property
    def failure(self) -> bool:
        return self.outcome in FAILURE_OUTCOMES or self.lost_steps > 0


@dataclass(frozen=True)
class Summary:
    """The run's headline numbers (seconds, steps)."""

    attempts: tuple[Attempt, ...]
    steps: int  # the highest step reached
    final_loss: float | None
    best_loss: float | None
    best_step: int | None
    allocated_s: float
    productive_s: float
    startup_s: float
    stalls_s: float
    lost_s: float
    after_s: float
    queue_s: float
    lost_steps: int
    failures: int
    saves: int
    save_cost_s: float | None  # mean stall of a save
    save_interval_s: float | None  # mean time between saves within an attempt, as run
    mtbf_s: float | None  # allocated time / failures; None without a failure
    best_interval_s: float | None  # Young/Daly: sqrt(2 x save cost x MTBF)
    step_time_s: float | None  # median step time
    state: str  # "finished", "running", "failed" or "stopped" (the last attempt ended, not completed)

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else None

    @property
    def best_interval_steps(self) -> int | None:
        if self.best_interval_s is None or not self.step_time_s:
            return None
        return max(1, round(self.best_interval_s / self.step_time_s))


# ----- the attempts and the summary -----------------------------------------------------------------------


def build_attempts(
    records: Sequence[Mapping[str, Any]],
    lines: Sequence[AttemptLine],
    slurm: Mapping[tuple[str, int], Window] | None = None,
    running: bool = True,
) -> list[Attempt]:
    """Every attempt of the run, oldest first, from metrics records and attempts.jsonl lines (either may be
    empty) and, where known, Slurm's start and end of each attempt (for the queue waits). `running`: a run
    holds the folder now (its run.lock); if not, a last attempt that never ended was killed."""
    by_key = {(a.job, a.restart): a for a in lines}
    drafts: list[tuple[Segment | None, AttemptLine | None]] = []
    used: set[tuple[str, int]] = set()
    for seg in segments(records):
        line = by_key.get(seg.key) if seg.key is not None else None
        if line is not None and seg.key in used:
            line = None  # two process starts with one identity: the attempts line describes the first
        if seg.key is not None and line is not None:
            used.add(seg.key)
        drafts.append((seg, line))
    drafts += [(None, line) for key, line in by_key.items() if key not in used]
    drafts.sort(key=lambda d: _first_time(*d))
    nexts = [_resume_step(d[0], d[1]) for d in drafts[1:]] + [None]
    attempts: list[Attempt] = []
    for i, ((seg, line), next_resume) in enumerate(zip(drafts, nexts, strict=True)):
        attempt = _attempt(seg, line, next_resume, is_last=i == len(drafts) - 1, running=running)
        attempts.append(_with_queue(attempt, attempts[-1] if attempts else None, slurm or {}))
    return attempts


def _first_time(seg: Segment | None, line: AttemptLine | None) -> float:
    candidates = (_process_start(seg), line.start_time if line else None, line.end_time if line else None)
    times = [t for t in candidates if t is not None]
    return min(times) if times else 0.0


def _process_start(seg: Segment | None) -> float | None:
    if seg is None:
        return None
    if seg.start is not None:
        t = num(seg.start.get("time"))
        return None if t is None else t - (num(seg.start.get("startup_s")) or 0.0)
    return num(seg.records[0].get("time")) if seg.records else None


def _resume_step(seg: Segment | None, line: AttemptLine | None) -> int | None:
    if seg is not None and seg.start is not None and int_or_none(seg.start.get("step")) is not None:
        return int_or_none(seg.start.get("step"))
    if seg is not None and seg.resumed is not None:
        return seg.resumed
    return line.resumed_from if line is not None else None


def _attempt(
    seg: Segment | None, line: AttemptLine | None, next_resume: int | None, is_last: bool, running: bool
) -> Attempt:
    seg = seg or Segment(None, ())
    points = progress_points(seg)
    start = seg.start or {}
    first_step = num(start.get("time")) if seg.start is not None else (points[0][0] if points else None)
    process_start = _process_start(seg)
    if process_start is None:
        process_start = (
            line.start_time
            if line and line.start_time is not None
            else line.end_time
            if line and line.end_time is not None
            else 0.0
        )
    resumed_at = _resume_step(seg, line) or 0
    if first_step is not None:
        points = [(first_step, resumed_at)] + points
    ends = [r for r in seg.records if r.get("event") == "end"]
    saves = [
        (int_or_none(r.get("step")), num(r.get("stall_s")) or 0.0)
        for r in seg.records
        if r.get("event") == "save"
    ]
    last_time = max((t for r in seg.records if (t := num(r.get("time"))) is not None), default=None)
    end = max(t for t in (last_time, line.end_time if line else None, process_start) if t is not None)
    last_step = max(
        [s for _, s in points]
        + [s for s, _ in saves if s is not None]
        + [line.step if line and line.step is not None else resumed_at]
    )
    # The step a later attempt resumed from (or, for the last one, the checkpoint it ended with) is what was
    # kept; the steps after it were trained for nothing.
    checkpoint = next_resume if next_resume is not None else (line.checkpoint if line else None)
    kept_step = last_step if checkpoint is None else max(resumed_at, min(last_step, checkpoint))
    stalls = sum(stall for _, stall in saves)
    t_last = num(ends[-1].get("time")) if ends else last_time
    if first_step is None or t_last is None:  # it never trained: all of it was startup
        startup, productive, lost, t_last = end - process_start, 0.0, 0.0, end
    else:
        startup = first_step - process_start
        productive, lost = _kept_and_lost(points, saves, first_step, t_last, kept_step, last_step)
    outcome = line.outcome if line and line.outcome else _outcome_from_metrics(bool(ends), is_last, running)
    return Attempt(
        job=line.job if line else str(start.get("job") or "?"),
        restart=line.restart if line else int_or_none(start.get("restart")) or 0,
        process_start=process_start,
        first_step=first_step,
        end=end,
        outcome=outcome,
        resumed_at=resumed_at,
        last_step=last_step,
        kept_step=kept_step,
        startup_s=startup,
        productive_s=productive,
        stalls_s=stalls,
        lost_s=lost,
        after_s=end - t_last,
        saves=len(saves),
        queue_before_s=0.0,
        nodes=line.nodes if line else (),
        reason=line.reason if line else "",
        decision=line.decision if line else "",
    )


def _kept_and_lost(
    points: Sequence[tuple[float, int]],
    saves: Sequence[tuple[int | None, float]],
    first_step: float,
    t_last: float,
    kept_step: int,
    last_step: int,
) -> tuple[float, float]:
    """(productive, lost) seconds of an attempt that trained from `first_step` to `t_last` and kept the
    steps up to `kept_step`. A save stalls training right after its step (its record comes later, once
    written): its stall is taken from the kept part if its step was kept, else from the lost part."""
    kept_stalls = sum(stall for step, stall in saves if step is None or step <= kept_step)
    lost_stalls = sum(stall for _, stall in saves) - kept_stalls
    its_save = sum(stall for step, stall in saves if step == kept_step)
    t_kept = t_last if kept_step == last_step else min(t_last, time_at_step(points, kept_step) + its_save)
    return t_kept - first_step - kept_stalls, t_last - t_kept - lost_stalls


def _outcome_from_metrics(ended: bool, is_last: bool, running: bool) -> str:
    """Without attempts.jsonl: an attempt with an end record stopped by itself ("stopped" when another came
    after it; the last "completed", or "ended" while the run still holds its folder: finishing or about to
    restart); one without was killed ("cut"), unless it is the last and the run holds its folder."""
    if ended:
        return "stopped" if not is_last else "ended" if running else "completed"
    return "running" if is_last and running else "cut"


def _with_queue(
    attempt: Attempt, previous: Attempt | None, slurm: Mapping[tuple[str, int], Window]
) -> Attempt:
    if previous is None:
        return attempt
    mine, theirs = slurm.get((attempt.job, attempt.restart)), slurm.get((previous.job, previous.restart))
    if mine is not None and theirs is not None and theirs.end is not None:
        wait = mine.start - theirs.end
    else:
        wait = attempt.process_start - previous.end
    return replace(attempt, queue_before_s=max(0.0, wait))


def summarize(
    records: Sequence[Mapping[str, Any]],
    lines: Sequence[AttemptLine] = (),
    slurm: Mapping[tuple[str, int], Window] | None = None,
    running: bool = True,
) -> Summary:
    """The run's numbers from its metrics records, its attempts lines and Slurm's windows (all optional)."""
    attempts = build_attempts(records, lines, slurm, running)
    losses = [
        (int(r["step"]), loss)
        for r in records
        if r.get("event") == "step"
        and int_or_none(r.get("step")) is not None
        and (loss := num(r.get("loss"))) is not None
    ]
    if not losses:
        losses = [
            (int(r["step"]), loss)
            for r in records
            if r.get("event") == "epoch"
            and int_or_none(r.get("step")) is not None
            and (loss := num(r.get("loss"))) is not None
        ]
    best = min(losses, key=lambda p: p[1]) if losses else None
    final = max(enumerate(losses), key=lambda p: (p[1][0], p[0]))[1][1] if losses else None
    saves = [r for r in records if r.get("event") == "save"]
    costs = [c for r in saves if not r.get("final") and (c := num(r.get("stall_s"))) is not None] or [
        c for r in saves if (c := num(r.get("stall_s"))) is not None
    ]
    save_cost = statistics.fmean(costs) if costs else None
    allocated = sum(a.allocated_s for a in attempts)
    failures = sum(a.failure for a in attempts)
    mtbf = allocated / failures if failures else None
    step_times = [
        t for r in records if r.get("event") == "step" and (t := num(r.get("step_time_s"))) is not None
    ]
    step_times = step_times or [
        t
        for r in records
        if r.get("event") == "end" and (t := num(r.get("median_step_time_s"))) is not None and t > 0
    ]
    return Summary(
        attempts=tuple(attempts),
        steps=max((a.last_step for a in attempts), default=0),
        final_loss=final,
        best_loss=best[1] if best else None,
        best_step=best[0] if best else None,
        allocated_s=allocated,
        productive_s=sum(a.productive_s for a in attempts),
        startup_s=sum(a.startup_s for a in attempts),
        stalls_s=sum(a.stalls_s for a in attempts),
        lost_s=sum(a.lost_s for a in attempts),
        after_s=sum(a.after_s for a in attempts),
        queue_s=sum(a.queue_before_s for a in attempts),
        lost_steps=sum(a.lost_steps for a in attempts),
        failures=failures,
        saves=len(saves),
        save_cost_s=save_cost,
        save_interval_s=_save_interval(records),
        mtbf_s=mtbf,
        best_interval_s=young_daly(save_cost, mtbf),
        step_time_s=statistics.median(step_times) if step_times else None,
        state=_state(attempts, running),
    )


def young_daly(save_cost_s: float | None, mtbf_s: float | None) -> float | None:
    """The checkpoint interval (seconds of training between saves) that maximises goodput to first order:
    sqrt(2 x save cost x MTBF) (Young 1974; Daly 2006). None unless both are known and positive."""
    if not save_cost_s or not mtbf_s or save_cost_s <= 0 or mtbf_s <= 0:
        return None
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def _save_interval(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean seconds of training between consecutive saves of one process (the time between their steps; a
    restart's first save and the final saves are not counted)."""
    gaps: list[float] = []
    for seg in segments(records):
        points = progress_points(seg)
        steps = [
            s
            for r in seg.records
            if r.get("event") == "save"
            and not r.get("final")
            and (s := int_or_none(r.get("step"))) is not None
        ]
        if points:
            times = [time_at_step(points, s) for s in steps]
            gaps += [b - a for a, b in itertools.pairwise(times)]
    return statistics.fmean(gaps) if gaps else None


def _state(attempts: Sequence[Attempt], running: bool) -> str:
    if running:  # a run holds the folder: training, or between two attempts
        return "running"
    if not attempts:
        return "empty"
    last = attempts[-1].outcome
    if last == "completed":
        return "finished"
    if last == "running":
        return "running"
    return "failed" if last in FAILURE_OUTCOMES or last == "cut" else "stopped"
