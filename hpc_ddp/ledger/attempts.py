"""The attempts record: every start of a job, how it ended and what was decided, in `<folder>/attempts.jsonl`.

An *attempt* is one run of the job's tasks: the first start, and every start after a requeue (Slurm) or a
restart (the local launcher, torchrun). It is named by (job id, restart count): DistEnv.restart, from
hpc_ddp.cluster.env.restart_count (SLURM_RESTART_COUNT, which Slurm raises at every requeue and the local
launcher sets the same way; torchrun's round). Two kinds of lines, appended as they happen:

    {"event": "start", "job", "restart", "time", "nodes": [...], "ranks": [node of each rank], "resumed_from"}
        written by global rank 0 once it is about to train (it knows the checkpoint it resumed from);
    {"event": "end", "job", "restart", "time", "outcome", "step", "checkpoint", "rank", "node", "blamed", "reason",
     "signature", "decision", "exclude": [...], "lost": [...]}
        written by the attempt's supervisor once every task is gone: the batch shell after srun returns
        (hpc_ddp.launch.slurm.batch) or the local launcher. It runs even when every task died.

`outcome` is one of hpc_ddp.ledger.outcomes.OUTCOMES; `decision` what came next: "done" (finished), "restart"/"requeue" (the job
starts again from its latest checkpoint), "stop" (the job ends here). An attempt whose supervisor never wrote
its end (the batch shell died with its node) is closed by the next attempt's supervisor ("lost", or
"node_fail" when Slurm's accounting says so). Both retry budgets (--max-requeue for preemptions,
--max-restarts for failures) are counted here, per job, not from SLURM_RESTART_COUNT, which counts every
requeue of either kind.

The file only grows and a kill can cut its last line: a writer starts on a fresh line, and every reader (the
supervisors, `submit --wait`, the judge, the report) reads it through `merge`, which skips a line that is no
whole record of an attempt and reads a field of the wrong type as missing (its docstring has the rule). A write that fails (a full disk) raises and leaves
the file as it was: no empty file, at most a cut line; the supervisor keeps what it could not write and says so
(hpc_ddp.launch.supervisor.Journal). No torch: supervisors import this.

`line` is the one way an attempt's end is said in one line, by every supervisor; `summary` is an attempt with
its start, as the list of attempts shows it.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpc_ddp.cluster.env import in_place
from hpc_ddp.ledger.outcomes import COMPLETED, FAILURES, HANG, LOST, RESTART, RUNNING, USAGE
from hpc_ddp.ledger.values import int_or_none, stamp

ATTEMPTS = "attempts.jsonl"


@dataclass(frozen=True)
class Attempt:
    """One attempt, merged from its start and end lines (either may be missing)."""

    job: str
    restart: int
    number: int = 0  # 1-based, in the order of the file (attempts of every job in this folder)
    started: float | None = None
    ended: float | None = None
    nodes: tuple[str, ...] = ()
    ranks: tuple[str, ...] = ()  # the node of each rank
    resumed_from: int | None = None  # step of the checkpoint this attempt resumed from
    outcome: str = RUNNING
    step: int | None = None  # the last step reached
    checkpoint: int | None = None  # step of the latest checkpoint when it ended
    rank: int | None = None  # the rank that failed first, if one did
    node: str | None = None  # the node of the rank that failed first, if known
    blamed: bool = False  # the failure points at `node` (hardware error, death by signal, hang, node failure)
    reason: str = ""
    signature: str = ""  # the error, numbers masked: equal signatures mean the same error
    decision: str = ""
    exclude: tuple[str, ...] = field(default_factory=tuple)
    lost: tuple[str, ...] = ()  # a node failure: every node that failed under it (`node` is the first)
    left: tuple[str, ...] = ()  # restarted in place (--spare-nodes): the nodes the next step left out
    spares_in: tuple[str, ...] = ()  # ... and the spare nodes it took in their place

    @property
    def key(self) -> tuple[str, int]:
        return (self.job, self.restart)

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    @property
    def lost_steps(self) -> int:
        """Steps done after the last checkpoint, which the next attempt does again (0 when unknown)."""
        if self.step is None or self.outcome in (COMPLETED, RUNNING):
            return 0
        return max(0, self.step - (self.checkpoint or 0))


def path(folder: Path) -> Path:
    return Path(folder) / ATTEMPTS


def append(folder: Path, record: dict[str, Any]) -> None:
    """Append one record (one line, one write) starting on a fresh line: a line cut by a kill stays cut.

    Raises OSError when it cannot (a full disk, a read-only folder), leaving the file as it was: a file this
    call created is removed again, so a failed first write never leaves an empty attempts.jsonl behind."""
    target = path(folder)
    line = json.dumps(record, sort_keys=True) + "\n"
    created = True
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
    except FileExistsError:
        created = False
        fd = os.open(target, os.O_WRONLY | os.O_APPEND)
    try:
        if not created and os.fstat(fd).st_size and not _ends_with_newline(target):
            line = "\n" + line
        data = line.encode()
        written = os.write(fd, data)
        if written != len(data):  # a full disk takes part of the line: the rest fails the same way
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
        os.fsync(fd)
    except OSError:
        if created:
            target.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _ends_with_newline(target: Path) -> bool:
    with open(target, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def record_start(
    folder: Path,
    job: str,
    restart: int,
    nodes: Iterable[str],
    ranks: Iterable[str],
    resumed_from: int | None,
    now: float | None = None,
) -> None:
    append(
        folder,
        {
            "event": "start",
            "job": job,
            "restart": restart,
            "time": round(now or time.time(), 3),
            "nodes": list(nodes),
            "ranks": list(ranks),
            "resumed_from": resumed_from,
        },
    )


def worth_recording(attempt: Attempt) -> bool:
    """An end without a start that trained nothing (a rerun of a finished run, a usage error) is no attempt:
    the record, its budgets and the report leave it out. A failure before training started is kept: it
    counts against --max-restarts, and a crash loop is found by it."""
    return attempt.started is not None or attempt.outcome not in (COMPLETED, USAGE)


def end_record(attempt: Attempt, now: float | None = None) -> dict[str, Any]:
    """The end line of `attempt` (pure)."""
    return {
        "event": "end",
        "job": attempt.job,
        "restart": attempt.restart,
        "time": round(now or attempt.ended or time.time(), 3),
        "outcome": attempt.outcome,
        "step": attempt.step,
        "checkpoint": attempt.checkpoint,
        "rank": attempt.rank,
        "node": attempt.node,
        "blamed": attempt.blamed,
        "reason": attempt.reason,
        "signature": attempt.signature,
        "decision": attempt.decision,
        "exclude": list(attempt.exclude),
        # where the step ran, when its ranks never said (no start record: killed while they started)
        **({"nodes": list(attempt.nodes)} if attempt.nodes and attempt.started is None else {}),
        **({"lost": list(attempt.lost)} if attempt.lost else {}),
        **({"left": list(attempt.left)} if attempt.left else {}),
        **({"spares_in": list(attempt.spares_in)} if attempt.spares_in else {}),
    }


def record_end(folder: Path, attempt: Attempt, now: float | None = None) -> None:
    append(folder, end_record(attempt, now))


def read_lines(folder: Path) -> list[dict[str, Any]]:
    """The whole JSON objects of attempts.jsonl, in order (a line a kill cut, or one that is no JSON object, is
    skipped); `merge` decides which of them are records of an attempt."""
    try:
        raw = path(folder).read_bytes()
    except OSError:
        return []
    records = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def merge(records: Iterable[Any]) -> list[Attempt]:
    """Start and end lines -> attempts, in the order each attempt first appears (pure).

    The one merge of attempts.jsonl: the supervisors, `submit --wait`, the judge and the report all read the
    attempts through it, so they tell the same attempts, numbered the same. The file only grows, a kill can cut
    its last line and anything may append to it; a line must never crash a supervisor or the report. The rule:

    - A line is a record of an attempt only if it says which attempt and when, as every line the kit writes
      does: a JSON object whose "event" is "start" or "end", "job" a string, "restart" an integer and "time"
      a time stamp (hpc_ddp.ledger.values.stamp: from 1970 to TIME_MAX). Any other line (not an object, no or
      another event, a job or restart of the wrong type, no time or one no clock can give) is skipped whole:
      it opens no attempt, so it never moves the attempt numbers or the budgets counted from them.
    - In a record, a field of the wrong type reads as missing: a number that is no integer (or past
      MAX_STEP) is None, a text that is no string is "" (an end's outcome: LOST, an ended attempt whose way of
      ending is unknown), a list of names that is no list is (), "node" that is no string None, "blamed"
      anything but true False.
    - The same event twice for one attempt: the later line wins (a supervisor's rewrite of a lost attempt).
    """
    merged: dict[tuple[str, int], Attempt] = {}
    for r in records:
        known = _known(r)
        if known is None:
            continue
        key, event, when = known
        a = merged.get(key) or Attempt(job=key[0], restart=key[1], number=len(merged) + 1)
        merged[key] = _started(a, r, when) if event == "start" else _ended(a, r, when)
    return list(merged.values())


def _known(record: Any) -> tuple[tuple[str, int], str, float] | None:
    """(attempt, event, time) of a record of an attempt, else None (a torn or foreign line: merge's rule)."""
    if not isinstance(record, dict) or record.get("event") not in ("start", "end"):
        return None
    job, restart, when = record.get("job"), int_or_none(record.get("restart")), stamp(record.get("time"))
    if not isinstance(job, str) or restart is None or when is None:
        return None
    return (job, restart), record["event"], when


def _started(a: Attempt, r: dict[str, Any], when: float) -> Attempt:
    return replace(
        a,
        started=when,
        nodes=_names(r.get("nodes")),
        ranks=_names(r.get("ranks")),
        resumed_from=int_or_none(r.get("resumed_from")),
    )


def _ended(a: Attempt, r: dict[str, Any], when: float) -> Attempt:
    return replace(
        a,
        ended=when,
        nodes=a.nodes or _names(r.get("nodes")),
        outcome=_text(r.get("outcome")) or LOST,
        step=int_or_none(r.get("step")),
        checkpoint=int_or_none(r.get("checkpoint")),
        rank=int_or_none(r.get("rank")),
        node=_text(r.get("node")) or None,
        blamed=r.get("blamed") is True,
        reason=_text(r.get("reason")),
        signature=_text(r.get("signature")),
        decision=_text(r.get("decision")),
        exclude=_names(r.get("exclude")),
        lost=_names(r.get("lost")),
        left=_names(r.get("left")),
        spares_in=_names(r.get("spares_in")),
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _names(value: Any) -> tuple[str, ...]:
    """A list of node names (a rank's node by its index: each kept in its place), else ()."""
    return tuple(str(n) for n in value) if isinstance(value, list) else ()


def read(folder: Path) -> list[Attempt]:
    return merge(read_lines(folder))


def of_job(attempts: Iterable[Attempt], job: str) -> list[Attempt]:
    return [a for a in attempts if a.job == job]


def find(attempts: Iterable[Attempt], job: str, restart: int) -> Attempt | None:
    return next((a for a in attempts if a.key == (job, restart)), None)


def line(attempt: Attempt, message: str) -> str:
    """The one line that says how an attempt ended and what comes next (`message`, the decision's), as every
    supervisor prints it: "attempt 2 failed on node3 (points at the node): RuntimeError: ...; restarting ..."."""
    if attempt.outcome == COMPLETED:
        return f"attempt {attempt.number} completed"
    where = (
        f" on {','.join(attempt.lost)}"
        if len(attempt.lost) > 1
        else f" on {attempt.node}"
        if attempt.node
        else ""
    )
    blame = " (points at the node)" if attempt.blamed else ""
    # A hang's reason is the verdict's line, which its supervisor prints just before (with where to read more).
    reason = "" if attempt.outcome == HANG else f"{attempt.reason}; "
    return f"attempt {attempt.number} {attempt.outcome}{where}{blame}: {reason}{message}"


def start_line(attempt: Attempt) -> str:
    """How an attempt started, as one line: "attempt 2 on node1,node3: resumed from step 120"; a step started
    inside the allocation (--spare-nodes) says so: "attempt 2 on node1,node3 (restart in place 1): ..."."""
    nodes = ",".join(attempt.nodes) or "?"
    resumed = (
        f"resumed from step {attempt.resumed_from}" if attempt.resumed_from is not None else "from the start"
    )
    where = f" (restart in place {in_place(attempt.restart)})" if in_place(attempt.restart) else ""
    return f"attempt {attempt.number} on {nodes}{where}: {resumed}"


def restarted_in_place(history: Iterable[Attempt], attempt: Attempt) -> Attempt | None:
    """The attempt whose failure `attempt` restarted in place from (its job's attempt just before it, when that
    one's decision was a restart and `attempt` is a step in place), else None (pure)."""
    if not in_place(attempt.restart):
        return None
    before = [a for a in history if a.job == attempt.job and a.number < attempt.number]
    last = before[-1] if before else None
    return last if last is not None and last.decision == RESTART else None


def recovery_line(failed: Attempt, attempt: Attempt, first_step: float) -> str:
    """What a restart in place cost, as one line (pure): which node left, which spare came in, and the
    seconds from the failure (its end's record) to the first step the new step committed (`first_step`)."""
    moves = [
        *([f"{','.join(failed.left)} left"] if failed.left else []),
        *([f"spare {','.join(failed.spares_in)} in"] if failed.spares_in else []),
    ]
    seconds = first_step - failed.ended if failed.ended is not None else None
    took = f"{seconds:.1f} s" if seconds is not None else "? s"
    return (
        f"restart in place {in_place(attempt.restart)} of job {attempt.job}"
        f"{' (' + ', '.join(moves) + ')' if moves else ' (same nodes)'}: {took} from the failure of attempt "
        f"{failed.number} to the first step of attempt {attempt.number}, without leaving the allocation"
    )


def summary(attempt: Attempt) -> str:
    """One attempt, its start and its end, as one line (the attempts listed when a job stops)."""
    if attempt.ended is None:
        return start_line(attempt)
    step = f" at step {attempt.step}" if attempt.step is not None else ""
    return f"{start_line(attempt)}; {attempt.outcome}{step}: {attempt.reason} -> {attempt.decision}"
