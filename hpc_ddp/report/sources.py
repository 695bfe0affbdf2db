"""Read what a run folder says about itself: metrics.jsonl, attempts.jsonl, and its scheduler's accounting.

Every reader is tolerant: a torn or foreign line is skipped, a missing file is no records, and a scheduler that
does not answer (no `sacct`, no accounting) only means the queue waits come from the gaps between attempts.
The scheduler's answers come through hpc_ddp.scheduler (Slurm: one `sacct` query per job, read by the one sacct
parser); a job id is any the scheduler has, an array task's "123_4" too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp import scheduler
from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import attempts
from hpc_ddp.ledger.attempts import ATTEMPTS  # written by rank 0 (start) and the supervisor (end)
from hpc_ddp.report.recorded import Recorded, compile_records
from hpc_ddp.run.folder import CHECKPOINTS, METRICS, RUN_RECORD, is_held
from hpc_ddp.run.records.metrics_read import iter_records
from hpc_ddp.scheduler.base import Scheduler, Window, is_job_id

SACCT_TIMEOUT_S = 10.0  # the report waits no longer for accounting: without it, the gaps between attempts


@dataclass(frozen=True)
class RunFiles:
    """What the report reads from a run folder."""

    folder: Path
    records: Recorded  # metrics.jsonl, compiled as it is read
    lines: tuple[attempts.Attempt, ...]  # attempts.jsonl, merged by the ledger as the supervisors read it
    slurm: Mapping[tuple[str, int], Window]
    running: bool  # a run holds the folder now (its run.lock is there and its holder alive)


def read_run(folder: Path, use_sacct: bool = True) -> RunFiles:
    """The run folder's records; UsageError if `folder` is no run folder (nothing a run writes is there)."""
    if not folder.is_dir():
        raise UsageError(
            f"{folder} is not a folder. Fix: give the run folder (the --folder of the run, e.g. "
            "runs/local-12345)"
        )
    if not any((folder / name).exists() for name in (METRICS, ATTEMPTS, RUN_RECORD, CHECKPOINTS)):
        raise UsageError(
            f"{folder} is not a run folder: it has no {METRICS}, {ATTEMPTS}, {RUN_RECORD} or "
            f"{CHECKPOINTS}/. Fix: give the folder a run wrote (its --folder, e.g. "
            "runs/local-12345)"
        )
    records = compile_records(iter_records(folder / METRICS))  # one pass; the dicts are not kept
    # The ledger's reader and merge, the supervisors' own: a torn or foreign line skipped, a field of the wrong
    # type read as missing (ledger.attempts.merge), so the report shows the attempts the supervisors counted.
    lines = tuple(attempts.read(folder))
    slurm: Mapping[tuple[str, int], Window] = {}
    if use_sacct:
        jobs = sorted(
            {a.job for a in lines}
            | {str(seg.start["job"]) for seg in records.segments if seg.start and seg.start.get("job")}
        )
        slurm = {key: w for job in jobs for key, w in sacct_windows(job).items()}
    return RunFiles(folder, records, lines, slurm, running=is_held(folder))


def sacct_windows(job: str, asked: Scheduler | None = None) -> dict[tuple[str, int], Window]:
    """Start and end of each run of job `job` as its scheduler's accounting has them ({} when it is no job id
    of a scheduler, or the scheduler cannot tell), as restart 0, 1, 2..."""
    if not is_job_id(job):
        return {}
    runs = (asked or scheduler.default(timeout_s=SACCT_TIMEOUT_S)).runs(job)
    return {(job, k): w for k, w in enumerate(runs or [])}


def plausible(
    windows: Mapping[tuple[str, int], Window], starts: Sequence[tuple[str, int, float]]
) -> dict[tuple[str, int], Window]:
    """Only the windows that contain their attempt's process start (job, restart, time): a local run's fake
    job id that happens to be a real Slurm job's is never taken for it."""
    found = {}
    for job, restart, t in starts:
        w = windows.get((job, restart))
        if w is not None and w.start - 60 <= t and (w.end is None or t <= w.end + 60):
            found[(job, restart)] = w
    return found


def described(run: RunFiles, slurm: Mapping[tuple[str, int], Window]) -> str:
    """What the report's numbers come from, for its page: "metrics.jsonl, attempts.jsonl and sacct"."""
    read = [name for name in (METRICS, ATTEMPTS) if (run.folder / name).is_file()] or ["no records"]
    if slurm:
        read.append("Slurm's accounting (sacct)")
    return ", ".join(read[:-1]) + " and " + read[-1] if len(read) > 1 else read[0]
