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

The file only grows and a kill can cut its last line: a writer starts on a fresh line and `read` skips lines
that are not whole records (the same rule as metrics.jsonl). A write that fails (a full disk) raises and leaves
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
        **({"lost": list(attempt.lost)} if attempt.lost else {}),
        **({"left": list(attempt.left)} if attempt.left else {}),
        **({"spares_in": list(attempt.spares_in)} if attempt.spares_in else {}),
    }


def record_end(folder: Path, attempt: Attempt, now: float | None = None) -> None:
    append(folder, end_record(attempt, now))


def read_lines(folder: Path) -> list[dict[str, Any]]:
    """The whole records of attempts.jsonl, in order; cut or foreign lines are skipped."""
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
        if isinstance(record, dict) and record.get("event") in ("start", "end") and "job" in record:
            records.append(record)
    return records


def merge(records: Iterable[dict[str, Any]]) -> list[Attempt]:
    """Start and end lines -> attempts, in the order each attempt first appears (pure)."""
    merged: dict[tuple[str, int], Attempt] = {}
    for r in records:
        try:
            key = (str(r["job"]), int(r.get("restart") or 0))
        except (TypeError, ValueError):
            continue
        a = merged.get(key) or Attempt(job=key[0], restart=key[1], number=len(merged) + 1)
        if r["event"] == "start":
            a = replace(
                a,
                started=_num(r.get("time")),
                nodes=tuple(r.get("nodes") or ()),
                ranks=tuple(r.get("ranks") or ()),
                resumed_from=_int(r.get("resumed_from")),
            )
        else:
            a = replace(
                a,
                ended=_num(r.get("time")),
                outcome=str(r.get("outcome") or LOST),
                step=_int(r.get("step")),
                checkpoint=_int(r.get("checkpoint")),
                rank=_int(r.get("rank")),
                node=r.get("node") or None,
                blamed=bool(r.get("blamed")),
                reason=str(r.get("reason") or ""),
                signature=str(r.get("signature") or ""),
                decision=str(r.get("decision") or ""),
                exclude=tuple(r.get("exclude") or ()),
                lost=tuple(r.get("lost") or ()),
                left=tuple(r.get("left") or ()),
                spares_in=tuple(r.get("spares_in") or ()),
            )
        merged[key] = a
    return list(merged.values())


def read(folder: Path) -> list[Attempt]:
    return merge(read_lines(folder))


def of_job(attempts: Iterable[Attempt], job: str) -> list[Attempt]:
    return [a for a in attempts if a.job == job]


def find(attempts: Iterable[Attempt], job: str, restart: int) -> Attempt | None:
    return next((a for a in attempts if a.key == (job, restart)), None)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


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
