"""Where a run's allocation went, computed from its records alone (pure: no files, no clock, no plotting).

Every time is in seconds: wall-clock stamps are seconds since the epoch, as the records carry them. An attempt
is one start of the run's processes, identified by (job, restart). Its allocated time is cut into six parts
that add up to it exactly:

    startup      process start -> first step (the start record's startup_s)
    productive   first step -> the last step that was kept (and its save), minus the stalls of saves up to it
    stalls       the time saves held the training thread (every save record's stall_s)
    lost         the last kept step -> the attempt's last step, minus the stalls of saves in between: steps
                 trained and then thrown away, because the attempt ended (failure, hang, preemption) after
                 its last checkpoint and the next attempt replays them from that checkpoint
    after        the attempt's last step (its end record, else its last record) -> its end: writing
                 model.pth, teardown, hang detection, exit (for a running attempt: nothing yet)

    held         a restart in place (--spare-nodes): the previous attempt's end -> this one's process start,
                 when the job kept its allocation between them (hpc_ddp.launch.slurm.inplace)

    allocated = startup + productive + stalls + lost + after + held = end - process start + held, summed
    goodput   = productive / allocated

The time an attempt's job waited in the queue after the previous attempt (Slurm's accounting when there is
one, else the gap between the previous attempt's end and this one's process start) is shown beside it but is
not allocated time; after a restart in place there is no queue, and that gap is `held`. The checkpoint interval that would have maximised goodput given the failures seen is
Young's (Daly's first order): tau = sqrt(2 x save cost x MTBF), with the save cost the mean stall of a save
and MTBF = allocated time / failures, all in seconds.
"""

from __future__ import annotations

import itertools
import math
import statistics
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hpc_ddp.cluster.env import in_place
from hpc_ddp.ledger import attempts as record  # attempts.jsonl's lines, merged by the ledger
from hpc_ddp.ledger import outcomes
from hpc_ddp.ledger.values import int_or_none, num, stamp
from hpc_ddp.report.recorded import Recorded, Save, Segment, compile_records
from hpc_ddp.report.records import StepClock, duration_or_none, ordered
from hpc_ddp.scheduler.base import Window  # when the scheduler says each run held its nodes

# Ends that lose the work since the last checkpoint and that checkpointing more often would have saved: these
# count as failures for the MTBF. A preemption saves at an agreed step and loses nothing (unless it lost
# steps: then it counts too).
# The ledger's one rule of what a failure is (what --max-restarts counts).
FAILURE_OUTCOMES = frozenset(outcomes.FAILURES)


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
    queue_before_s: float  # from the previous attempt's end to its start (0 for the first)
    nodes: tuple[str, ...] = ()
    reason: str = ""
    decision: str = ""
    queued: bool = False  # that time was a wait in Slurm's queue (a requeue, or sacct says so)
    # A restart in place (--spare-nodes): from the previous attempt's end to this one's start, the job held its
    # allocation (and its spare nodes): allocated time, not a queue wait.
    held_before_s: float = 0.0
    left: tuple[str, ...] = ()  # restarted in place: the nodes the next step left out
    spares_in: tuple[str, ...] = ()  # ... the spares it took in their place
    recovery_s: float | None = None  # ... and from this attempt's end to the next one's first step

    @property
    def allocated_s(self) -> float:
        return self.end - self.process_start + self.held_before_s

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
    queued: bool = False  # some time between attempts was a wait in Slurm's queue (else: a local run's gaps)
    held_s: float = 0.0  # between attempts restarted in place: allocated (Attempt.held_before_s)
    restarts_in_place: int = 0

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else None

    @property
    def no_interval(self) -> str:
        """Why there is no best checkpoint interval ("" when there is one): the formula needs both a failure
        and the cost of a save; a run that failed before any timed save has the one and not the other."""
        if self.best_interval_s is not None:
            return ""
        return "no failure seen" if not self.failures else "no checkpoint save was timed"

    @property
    def best_interval_steps(self) -> int | None:
        if self.best_interval_s is None or not self.step_time_s:
            return None
        return max(1, round(self.best_interval_s / self.step_time_s))


# ----- the attempts and the summary -----------------------------------------------------------------------


def build_attempts(
    records: Recorded | Iterable[Mapping[str, Any]],
    lines: Sequence[record.Attempt],
    slurm: Mapping[tuple[str, int], Window] | None = None,
    running: bool = True,
    now: float | None = None,
) -> list[Attempt]:
    """Every attempt of the run, oldest first, from metrics records (compiled, or as read) and attempts.jsonl's
    attempts as the ledger merged them (ledger.attempts.read; either may be empty) and, where known, Slurm's start and end of each attempt (for the queue waits).
    `running`: a run holds the folder now (its run.lock); if not, a last attempt that never ended was killed.
    `now`: the time of the report; a running attempt's allocation goes on until then."""
    run = records if isinstance(records, Recorded) else compile_records(records)
    by_key = {(a.job, a.restart): a for a in lines}
    drafts: list[tuple[Segment | None, record.Attempt | None]] = []
    used: set[tuple[str, int]] = set()
    for seg in run.segments:
        line = by_key.get(seg.key) if seg.key is not None else None
        if line is not None and seg.key in used:
            line = None  # two process starts with one identity: the attempts line describes the first
        if seg.key is not None and line is not None:
            used.add(seg.key)
        drafts.append((seg, line))
    drafts += [(None, line) for key, line in by_key.items() if key not in used]
    drafts = ordered(drafts, key=lambda d: _first_time(*d))
    nexts = [_resume_step(d[0], d[1]) for d in drafts[1:]] + [None]
    attempts: list[Attempt] = []
    for i, ((seg, line), next_resume) in enumerate(zip(drafts, nexts, strict=True)):
        attempt = _attempt(seg, line, next_resume, is_last=i == len(drafts) - 1, running=running, now=now)
        attempts.append(_with_queue(attempt, attempts[-1] if attempts else None, slurm or {}))
        if attempt.first_step is not None and attempts[-1].held_before_s and len(attempts) > 1:
            # A restart in place: from the failure (its attempt's end) to the first step of the step after it.
            attempts[-2] = replace(attempts[-2], recovery_s=max(0.0, attempt.first_step - attempts[-2].end))
    return attempts


def _first_time(seg: Segment | None, line: record.Attempt | None) -> float:
    candidates = (_process_start(seg), line.started if line else None, line.ended if line else None)
    times = [t for t in candidates if t is not None]
    return min(times) if times else 0.0


def _process_start(seg: Segment | None) -> float | None:
    """Its processes' start: the start record's time minus its startup_s (garbage, negative or before 1970:
    none)."""
    if seg is None:
        return None
    if seg.start is not None:
        t = num(seg.start.get("time"))
        startup = duration_or_none(seg.start.get("startup_s")) or 0.0
        return None if t is None else t - startup if stamp(t - startup) is not None else t
    return seg.first_time


def _resume_step(seg: Segment | None, line: record.Attempt | None) -> int | None:
    if seg is not None and seg.start is not None and int_or_none(seg.start.get("step")) is not None:
        return int_or_none(seg.start.get("step"))
    if seg is not None and seg.resumed is not None:
        return seg.resumed
    return line.resumed_from if line is not None else None


def _attempt(
    seg: Segment | None,
    line: record.Attempt | None,
    next_resume: int | None,
    is_last: bool,
    running: bool,
    now: float | None,
) -> Attempt:
    seg = seg or Segment()
    start = seg.start or {}
    first_step = num(start.get("time")) if seg.start is not None else seg.first_time
    process_start = _process_start(seg)
    if process_start is None:
        process_start = next((t for t in (line.started, line.ended) if t is not None), 0.0) if line else 0.0
    resumed_at = _resume_step(seg, line) or 0
    saves = seg.saves
    end = max(t for t in (seg.last_time, line.ended if line else None, process_start) if t is not None)
    outcome = (
        line.outcome
        if line and line.ended is not None  # its end line's word; without one, the metrics tell
        else _outcome_from_metrics(bool(seg.end_times), is_last, running)
    )
    if outcome == "running" and now is not None:
        end = max(end, now)  # it goes on: its allocation runs until now, not until its last record
    last_step = max(
        [max(seg.point_steps, default=resumed_at), resumed_at]
        + [s.step for s in saves if s.step is not None]
        + [line.step if line and line.step is not None else resumed_at]
    )
    # The step a later attempt resumed from (or, for the last one, the checkpoint it ended with) is what was
    # kept; the steps after it were trained for nothing.
    checkpoint = next_resume if next_resume is not None else (line.checkpoint if line else None)
    kept_step = last_step if checkpoint is None else max(resumed_at, min(last_step, checkpoint))
    t_last = seg.end_times[-1] if seg.end_times else seg.last_time
    if outcome == "running":
        t_last = end  # still training: the time since its last record is training time too
    if first_step is None or t_last is None:  # it never trained: all of it was startup
        startup, productive, stalls, lost, t_last = end - process_start, 0.0, 0.0, 0.0, end
    else:
        first_step = min(max(first_step, process_start), end)
        t_last = min(max(t_last, first_step), end)
        startup = first_step - process_start
        clock = StepClock(
            array("d", [first_step]) + seg.point_times, array("q", [resumed_at]) + seg.point_steps
        )
        productive, stalls, lost = _kept_and_lost(clock, saves, first_step, t_last, kept_step, last_step)
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
        left=line.left if line else (),
        spares_in=line.spares_in if line else (),
    )


def _kept_and_lost(
    clock: StepClock, saves: Sequence[Save], first_step: float, t_last: float, kept_step: int, last_step: int
) -> tuple[float, float, float]:
    """(productive, stalls, lost) seconds of an attempt that trained from `first_step` to `t_last` and kept
    the steps up to `kept_step`. A save stalls training right after its step (its record comes later, once
    written): its stall is taken from the kept part if its step was kept, else from the lost part. Stalls
    longer than the part they fall in (garbage) are cut to it: every part stays between 0 and the whole."""
    kept_stalls = sum(s.stall_s or 0.0 for s in saves if s.step is None or s.step <= kept_step)
    lost_stalls = sum(s.stall_s or 0.0 for s in saves) - kept_stalls
    its_save = sum(s.stall_s or 0.0 for s in saves if s.step == kept_step)
    t_kept = t_last if kept_step == last_step else min(t_last, clock.at(kept_step) + its_save)
    t_kept = max(t_kept, first_step)
    kept_stalls, lost_stalls = min(kept_stalls, t_kept - first_step), min(lost_stalls, t_last - t_kept)
    return t_kept - first_step - kept_stalls, kept_stalls + lost_stalls, t_last - t_kept - lost_stalls


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
    """The time from the previous attempt's end to this one's start: a queue wait when Slurm's accounting
    has both (then from its own times) or the previous attempt was requeued; otherwise (a local run's
    restart, a new command) only the time between them."""
    if previous is None:
        return attempt
    mine, theirs = slurm.get((attempt.job, attempt.restart)), slurm.get((previous.job, previous.restart))
    if mine is not None and theirs is not None and theirs.end is not None:
        wait, queued = mine.start - theirs.end, True
    else:
        wait, queued = attempt.process_start - previous.end, previous.decision == "requeue"
    if in_place(attempt.restart) and previous.decision == outcomes.RESTART and previous.job == attempt.job:
        # A step started inside the allocation: the nodes were held all along (hpc_ddp.launch.slurm.inplace).
        return replace(attempt, held_before_s=max(0.0, attempt.process_start - previous.end))
    return replace(attempt, queue_before_s=max(0.0, wait), queued=queued)


def summarize(
    records: Recorded | Iterable[Mapping[str, Any]],
    lines: Sequence[record.Attempt] = (),
    slurm: Mapping[tuple[str, int], Window] | None = None,
    running: bool = True,
    now: float | None = None,
) -> Summary:
    """The run's numbers from its metrics records (compiled, or as read), its attempts lines and Slurm's
    windows (all optional); `now`: the time of the report (a running attempt's allocation runs until then)."""
    run = records if isinstance(records, Recorded) else compile_records(records)
    attempts = build_attempts(run, lines, slurm, running, now)
    losses = run.losses()
    final = next((series.values[-1] for series in reversed(losses)), None)  # the last step trained
    best = min(
        ((s.values[i], s.steps[i]) for s in losses for i in range(len(s))), key=lambda p: p[0], default=None
    )
    saves = run.saves
    costs = [s.stall_s for s in saves if not s.final and s.stall_s is not None] or [
        s.stall_s for s in saves if s.stall_s is not None
    ]
    save_cost = statistics.fmean(costs) if costs else None
    allocated = sum(a.allocated_s for a in attempts)
    failures = sum(a.failure for a in attempts)
    mtbf = allocated / failures if failures else None
    step_times = run.step_times or run.end_step_times
    return Summary(
        attempts=tuple(attempts),
        steps=max((a.last_step for a in attempts), default=0),
        final_loss=final,
        best_loss=best[0] if best else None,
        best_step=best[1] if best else None,
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
        save_interval_s=_save_interval(run),
        mtbf_s=mtbf,
        best_interval_s=young_daly(save_cost, mtbf),
        step_time_s=_median(step_times) if step_times else None,
        state=_state(attempts, running),
        queued=any(a.queued for a in attempts),
        held_s=sum(a.held_before_s for a in attempts),
        restarts_in_place=sum(1 for a in attempts if in_place(a.restart)),
    )


def _median(values: Sequence[float]) -> float:
    ranked, half = ordered(values), len(values) // 2
    return ranked[half] if len(ranked) % 2 else (ranked[half - 1] + ranked[half]) / 2


def young_daly(save_cost_s: float | None, mtbf_s: float | None) -> float | None:
    """The checkpoint interval (seconds of training between saves) that maximises goodput to first order:
    sqrt(2 x save cost x MTBF) (Young 1974; Daly 2006). None unless both are known and positive."""
    if not save_cost_s or not mtbf_s or save_cost_s <= 0 or mtbf_s <= 0:
        return None
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def _save_interval(run: Recorded) -> float | None:
    """Mean seconds of training between consecutive saves of one process (the time between their steps; a
    restart's first save and the final saves are not counted)."""
    gaps: list[float] = []
    for seg in run.segments:
        clock = seg.clock()
        if clock:
            times = [clock.at(s.step) for s in seg.saves if not s.final and s.step is not None]
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
    return outcomes.FAILED if last in FAILURE_OUTCOMES or last == "cut" else outcomes.STOPPED
