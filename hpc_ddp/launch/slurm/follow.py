"""`submit --wait`: print rank 0's log and the run's progress as they grow, say what happens to the job
(pending and why, requeued, each attempt), and give the final word once the job is over.

Polling like a good citizen. Every user's `--wait` shares slurmdbd: one look at the job is one accounting
query (`sacct -D`: every run of the job at once, whatever the attempts), and the looks space out with the
job's steadiness (`poll_delay`: 2 s after a change, up to 30 s for a job that has looked the same for 5
minutes). Between looks, cheap local signs of a change bring the next look forward (to at most one every
2 s): attempts.jsonl changed (the batch shell's `begin` or `end` wrote), the run's own start or end in
metrics.jsonl, or rank 0's log grew while the job was not yet seen running (it started). The controller
(`scontrol show job`) is asked only when accounting has no answer (a fresh job, no accounting) or says the
run ended: the controller alone knows whether the job is over (no requeue coming, every process gone).

An attempt whose batch shell died (its node was the one lost: Slurm ends such a job under the kit's
--no-kill) is closed here once Slurm says its run is over, by the same judge as the next `begin`'s
(hpc_ddp.launch.slurm.lost), with the job's own budgets: the job is requeued away from the lost node, goes on
with fewer (--min-nodes), or stops (a job Slurm requeued itself is cancelled then, never left pending on
nodes that are gone). A job that waits for nodes on purpose (--wait-for-nodes) is said to, every minute.
The final word (hpc_ddp.launch.slurm.outcome) is the record's.

Both the client and the clock are arguments: tests follow a fake cluster on a fake clock.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from hpc_ddp import exitcodes
from hpc_ddp.launch import supervisor
from hpc_ddp.launch.slurm import lost
from hpc_ddp.launch.slurm.lost import Policy
from hpc_ddp.launch.slurm.outcome import chatter, log_path, report
from hpc_ddp.ledger import attempts, outcomes
from hpc_ddp.log import TracebackFold
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.records import progress
from hpc_ddp.scheduler.base import Kind
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.parse import JobHistory, JobInfo
from hpc_ddp.scheduler.slurm.request import pending_hint
from hpc_ddp.scheduler.slurm.states import JobState, meaning

POLL_MIN_S = 2.0  # never two looks at Slurm closer than this
POLL_MAX_S = 30.0  # a steady job is looked at this often
TICK_S = 1.0  # local looks (the logs' new lines, a stat of attempts.jsonl) between two looks at Slurm
SILENCE_S = 300.0  # no word about the job from sacct or the controller for this long: stop following
COMPLETING_S = 300.0  # the controller says "completing" for this long: report without waiting more
SETTLE_S = 0.5  # the log's last lines may land just after the processes are gone


@dataclass(frozen=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


def poll_delay(steady_s: float) -> float:
    """Seconds from one look at Slurm to the next, for a job that has looked the same for `steady_s` (pure)."""
    return min(POLL_MAX_S, max(POLL_MIN_S, steady_s / 10))


@dataclass(frozen=True)
class Look:
    """What one look at Slurm says about the job."""

    state: JobState
    restarts: int  # requeues so far
    reason: str  # why it is pending ("" when it is not)
    over: bool  # no run, requeue or process to come: the final word is due


def verdict(history: JobHistory | None, info: JobInfo | None) -> Look | None:
    """One look from accounting's history and, when asked, the controller's view (pure). Over only on the
    controller's word: a terminal state (never COMPLETING: processes may still save), or no longer knowing
    the job while accounting says its last run ended. None: neither knows the job (yet)."""
    if info is not None and not info.gone:
        state = info.state
        if state.done and history is not None and history.current.done and history.restarts >= info.restarts:
            state = history.current  # accounting's record of that same run (its exit code as sacct has it)
        reason = info.reason if info.state.kind.waiting else ""
        restarts = max(info.restarts, history.restarts if history else 0)
        return Look(state, restarts, reason, over=info.state.done)
    if history is None:
        return None
    reason = history.reason if history.current.kind.waiting else ""
    return Look(history.current, history.restarts, reason, over=info is not None and history.current.done)


def news(job_id: str, before: Look | None, now: Look) -> list[str]:
    """The lines a new look deserves (pure): a requeue once per requeue (counted by Slurm, not guessed
    from the state words: accounting may still say PENDING while the controller has the job running), and
    a pending reason once per change."""
    lines = []
    if now.restarts > (before.restarts if before else 0):
        after = {Kind.RUNNING: "; it runs again"}.get(now.state.kind, "")
        if now.state.kind.waiting:
            after = "; waiting for it to start again"
        lines.append(f"job {job_id} was requeued{after}")
    # BeginTime after a requeue: Slurm's own pause before a requeued job may start again (said above).
    quiet = ("", "None", *(("BeginTime",) if now.restarts else ()))
    if now.reason not in quiet and now.reason != (before.reason if before else ""):
        lines.append(f"job {job_id} pending: {pending_hint(now.reason)}")
    return lines


def look(
    client: SlurmClient, job_id: str, history: JobHistory | None, ending: bool
) -> tuple[Look | None, JobHistory | None]:
    """Ask Slurm once: accounting, then the controller when accounting has no answer or says the run ended.
    While the job is `ending` (the controller said COMPLETING), only the controller: accounting's record of
    the run is final already. Returns the look and accounting's latest history."""
    if not ending:
        history = client.history(job_id)
    info = None
    # Accounting's last record REQUEUED: the next run's record may never come (the job was cancelled while
    # on its way back to pending, as the batch step's stop does): the controller says.
    if ending or history is None or history.current.done or history.current.kind is Kind.REQUEUED:
        info = client.job(job_id)
        if info is None and history is not None:
            # The controller does not answer. After NODE_FAIL or PREEMPTED Slurm may be requeuing the job and
            # only the controller knows: no word yet. Otherwise accounting's word stands.
            if meaning(history.current.state).requeues:
                return None, history
            info = JobInfo(gone=True)
    return verdict(history, info), history


class _LogFollower:
    """Prints what a growing log file gains, whole lines only, skipping submitit's chatter. `watch`: a text
    whose appearance it notes (`seen`)."""

    def __init__(self, path: Path, out: TextIO, watch: str = "") -> None:
        self.path, self.out, self.offset, self.partial = path, out, 0, b""
        self.folded = TracebackFold(str(path))
        self.watch, self.seen = watch, False

    def poll(self) -> int:
        """Print the new whole lines; returns how many bytes the file gained."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return 0
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            line = self.folded.feed(raw.decode("utf-8", "replace"))
            if line is not None and not chatter(line):
                self.out.write(line + "\n")
                self.seen = self.seen or bool(self.watch and self.watch in line)
        self.out.flush()
        return len(data)


class _Local:
    """The cheap looks: rank 0's log, metrics.jsonl and attempts.jsonl, shown as they grow."""

    def __init__(self, job_id: str, checkpoints: CheckpointStore, out: TextIO) -> None:
        folder = checkpoints.folder
        self.job_id, self.folder, self.checkpoints = job_id, folder, checkpoints
        self.metrics = progress.MetricsView(folder / run_folder.METRICS, out, job=job_id)
        self.out = cast(TextIO, self.metrics.stream)  # what else is written erases the live line first
        # The batch shell's `end` prints the first error and every attempt when it stops the job (batch_end.stop).
        self.log = _LogFollower(log_path(folder, job_id), self.out, watch=f"[hpc_ddp] job {job_id} stops: ")
        self.stamp: tuple[int, int] | None = None
        self.attempts_shown = 0
        self.stopped_here = False  # this follower stopped the job, and showed every attempt
        self.recovering: int | None = None  # the restart count of a start whose first step is still to come

    @property
    def stops_shown(self) -> bool:
        """The stop's first error and every attempt are on the console already (above the final word)."""
        return self.log.seen or self.stopped_here

    def settle(self, client: SlurmClient, policy: Policy | None) -> bool:
        """Close the job's attempts whose batch shell died now that their run is over (hpc_ddp.launch.slurm.
        lost), acting on the decision with the job's `policy` (without one: only once the job is over, as a
        stop); True when the job was requeued and may run again."""
        if self.log.seen:  # the batch shell stopped the job, said so above: its word stands
            return False
        journal = supervisor.Journal(self.checkpoints)
        settled, trouble = lost.settle_open(journal, client, self.job_id, policy)
        again = False
        for done in settled:
            closed = done.closed
            self.say(closed.line)
            for line in done.said:
                self.say(line)
            again = closed.decision.action == outcomes.REQUEUE
            if closed.decision.action == outcomes.STOP and policy is not None:
                self.say(f"job {self.job_id} stops: {closed.decision.said}. Attempts:")
                for a in journal.history(self.job_id):
                    self.out.write(f"    {attempts.summary(a)}\n")
                self.stopped_here = True
        if trouble:
            self.say(trouble)
        return again

    def poll(self, running: bool) -> bool:
        """Show what is new; True when it signals a change of the job's state."""
        try:
            st = os.stat(attempts.path(self.folder))
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        changed = stamp != self.stamp
        self.stamp = stamp
        if changed:  # first: an attempt's start comes before the lines of the run it starts
            self._show_attempts()
        grew = self.log.poll() > 0
        records = self.metrics.poll()
        self._show_recovery(records)
        events = [r for r in records if r.get("event") in ("start", "end")]
        return changed or bool(events) or (grew and not running)

    def _show_recovery(self, records: list[dict[str, Any]]) -> None:
        """After a restart in place (--spare-nodes), at its first committed step (the first "step" record after
        its "start"): which node left, which spare came in, and the seconds from the failure to that step
        (attempts.recovery_line). A start that dies before its first step says nothing."""
        for r in records:
            if r.get("event") == "start":
                restart = r.get("restart")
                self.recovering = restart if isinstance(restart, int) else None
            elif (
                r.get("event") == "step" and self.recovering is not None and isinstance(r.get("time"), float)
            ):
                history = attempts.of_job(attempts.read(self.folder), self.job_id)
                this = attempts.find(history, self.job_id, self.recovering)
                failed = attempts.restarted_in_place(history, this) if this is not None else None
                if this is not None and failed is not None:
                    self.say(attempts.recovery_line(failed, this, r["time"]))
                self.recovering = None

    def _show_attempts(self) -> None:
        """Each new attempt of the job as it starts ("attempt 2 on node1,node3: resumed from step 120"); how
        it ended comes through the batch log (hpc_ddp.launch.slurm.batch)."""
        started = [
            a for a in attempts.of_job(attempts.read(self.folder), self.job_id) if a.started is not None
        ]
        for a in started[self.attempts_shown :]:
            self.out.write(f"[submit] {attempts.start_line(a)}\n")
            self.out.flush()
        self.attempts_shown = max(self.attempts_shown, len(started))

    def say(self, text: str) -> None:
        self.out.write(f"[submit] {text}\n")
        self.out.flush()


def follow(
    job_id: str,
    store: CheckpointStore,  # the run folder's checkpoints (the step a resume would start from)
    world_size: int,
    submitted_at: float,
    client: SlurmClient,
    out: TextIO = sys.stdout,
    clock: Clock = Clock(),
    policy: Policy | None = None,
    resume: str = "",
) -> int:
    """--wait: print rank 0's log as it grows until the job ends, then report; returns the exit code. The
    progress line of the job's metrics.jsonl is shown below it (in place on a terminal), with each start.
    `policy`: the job's own rules (budgets, size, --min-nodes, --wait-for-nodes), with which an attempt whose
    batch shell died is closed and acted on (hpc_ddp.launch.slurm.lost); without one, such an attempt is only
    recorded once the job is over. `resume`: the command that resumes the run, for the final word."""
    local = _Local(job_id, store, out)
    last: Look | None = None
    history: JobHistory | None = None
    start = clock.now()
    heard = steady_since = last_poll = start
    next_poll = start
    ending_since: float | None = None
    told_waiting = -NODES_EVERY_S
    while True:
        now = clock.now()
        if local.poll(running=last is not None and last.state.kind is Kind.RUNNING):
            steady_since = now
            next_poll = min(next_poll, last_poll + POLL_MIN_S)
        if now >= next_poll:
            seen, history = look(
                client, job_id, history, ending=last is not None and last.state.kind is Kind.COMPLETING
            )
            last_poll = now
            if seen is None:
                if now - heard > SILENCE_S:
                    local.say(
                        f"cannot get the state of job {job_id} from sacct or scontrol for 5 minutes; stopped "
                        f"following. Check: sacct -j {job_id}"
                    )
                    return exitcodes.FAILED
            else:
                heard = now
                for line in news(job_id, last, seen):
                    local.say(line)
                if last is None or (seen.state.state, seen.restarts) != (last.state.state, last.restarts):
                    steady_since = now
                if (seen.over or seen.state.kind.waiting) and local.settle(client, policy):
                    # An attempt whose batch shell died, closed and acted on: the job may run again.
                    last, next_poll = seen, now + POLL_MIN_S
                    continue
                if policy is not None and policy.wait and waiting_for_nodes(seen):
                    if now - told_waiting >= NODES_EVERY_S:
                        told_waiting = now
                        local.say(
                            f"job {job_id} waits for nodes ({pending_hint(seen.reason)}); --wait-for-nodes: it "
                            f"starts once enough are back (scancel {job_id} to stop it)"
                        )
                ending = seen.state.done or seen.state.kind is Kind.COMPLETING
                ending_since = (ending_since or now) if ending else None
                stuck = ending_since is not None and now - ending_since > COMPLETING_S
                if seen.over or stuck:
                    final = history.current if stuck and history is not None else seen.state
                    clock.sleep(SETTLE_S)
                    local.poll(running=True)
                    local.metrics.stream.keep()
                    local.out.flush()
                    return report(
                        job_id, store, world_size, final, submitted_at, local.out, local.stops_shown, resume
                    )
                last = seen
            next_poll = now + poll_delay(now - steady_since)
        clock.sleep(TICK_S)


NODES_EVERY_S = 60.0  # --wait-for-nodes: how often a job waiting for nodes is said to be


def waiting_for_nodes(seen: Look) -> bool:
    """The job pends because too few of its nodes are up (pure): Slurm's ReqNodeNotAvail, "Nodes required for
    job are DOWN, DRAINED...", or Resources once it was requeued."""
    if not seen.state.kind.waiting:
        return False
    reason = seen.reason.replace("_", " ")
    return (
        "ReqNodeNotAvail" in reason
        or "Nodes required" in reason
        or (seen.restarts > 0 and reason == "Resources")
    )
