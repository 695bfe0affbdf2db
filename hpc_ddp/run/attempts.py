"""The attempts record: every start of a job, how it ended and what was decided, in `<folder>/attempts.jsonl`.

An *attempt* is one run of the job's tasks: the first start, and every start after a requeue (Slurm) or a
restart (the local launcher). It is named by (job id, restart count): SLURM_RESTART_COUNT, which Slurm raises at
every requeue and the local launcher sets the same way. Two kinds of lines, appended as they happen:

    {"event": "start", "job", "restart", "time", "nodes": [...], "ranks": [node of each rank], "resumed_from"}
        written by global rank 0 once it is about to train (it knows the checkpoint it resumed from);
    {"event": "end", "job", "restart", "time", "outcome", "step", "checkpoint", "rank", "node", "blamed", "reason",
     "signature", "decision", "exclude": [...]}
        written by the attempt's supervisor once every task is gone: the batch shell after srun returns
        (hpc_ddp.launch.slurm.batch) or the local launcher. It runs even when every task died.

`outcome` is one of OUTCOMES; `decision` what came next: "done" (finished), "restart"/"requeue" (the job
starts again from its latest checkpoint), "stop" (the job ends here). An attempt whose supervisor never wrote
its end (the batch shell died with its node) is closed by the next attempt's supervisor ("lost", or
"node_fail" when Slurm's accounting says so). Both retry budgets (--max-requeue for preemptions,
--max-restarts for failures) are counted here, per job, not from SLURM_RESTART_COUNT, which counts every
requeue of either kind.

The file only grows and a kill can cut its last line: a writer starts on a fresh line and `read` skips lines
that are not whole records (the same rule as metrics.jsonl). No torch: supervisors import this.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ATTEMPTS = "attempts.jsonl"

COMPLETED, PREEMPTED, STOPPED = "completed", "preempted", "stopped"
FAILED, HANG, NODE_FAIL, LOST = "failed", "hang", "node_fail", "lost"
NONFINITE, USAGE, RUNNING = "nonfinite", "usage", "running"
OUTCOMES = (COMPLETED, PREEMPTED, STOPPED, FAILED, HANG, NODE_FAIL, LOST, NONFINITE, USAGE)
FAILURES = (FAILED, HANG, NODE_FAIL, LOST)  # what --max-restarts counts; a preemption is not a failure

DONE, RESTART, REQUEUE, STOP = "done", "restart", "requeue", "stop"


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
    """Append one record (one line, one write) starting on a fresh line: a line cut by a kill stays cut."""
    target = path(folder)
    line = json.dumps(record, sort_keys=True) + "\n"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and not _ends_with_newline(target):
            line = "\n" + line
        os.write(fd, line.encode())
        os.fsync(fd)
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


def record_end(folder: Path, attempt: Attempt, now: float | None = None) -> None:
    append(
        folder,
        {
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
        },
    )


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
            )
        merged[key] = a
    return list(merged.values())


def read(folder: Path) -> list[Attempt]:
    return merge(read_lines(folder))


def of_job(attempts: Iterable[Attempt], job: str) -> list[Attempt]:
    return [a for a in attempts if a.job == job]


def find(attempts: Iterable[Attempt], job: str, restart: int) -> Attempt | None:
    return next((a for a in attempts if a.key == (job, restart)), None)


def count(attempts: Iterable[Attempt], job: str, outcomes: tuple[str, ...]) -> int:
    return sum(1 for a in attempts if a.job == job and a.outcome in outcomes)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


_CKPT = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_step(folder: Path) -> int | None:
    """The step of the folder's latest checkpoint (its `latest` pointer, else the newest file), without torch."""
    directory = Path(folder) / "checkpoints"
    try:
        match = _CKPT.match((directory / "latest").read_text().strip())
        if match:
            return int(match.group(1))
        steps = [int(m.group(1)) for p in directory.iterdir() if (m := _CKPT.match(p.name))]
    except OSError:
        return None
    return max(steps, default=None)


def step_reached(folder: Path, since: float) -> int | None:
    """The last step rank 0 finished since `since` (epoch seconds): where an attempt got to, also when it died
    between two progress records (hpc_ddp.run.reached owns the answer)."""
    from hpc_ddp.run.reached import step_reached as reached

    return reached(folder, since)
