"""Read what a run folder says about itself: metrics.jsonl, attempts.jsonl, and Slurm's accounting if any.

Every reader is tolerant: a torn or foreign line is skipped, a missing file is no records, and a missing or
failing `sacct` only means the queue waits come from the gaps between attempts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp import proc
from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import attempts
from hpc_ddp.ledger.attempts import ATTEMPTS  # written by rank 0 (start) and the supervisor (end)
from hpc_ddp.report.recorded import Recorded, compile_records
from hpc_ddp.report.records import AttemptLine, merge_attempt_lines
from hpc_ddp.report.timeline import Window
from hpc_ddp.run.folder import CHECKPOINTS, METRICS, RUN_RECORD, is_held
from hpc_ddp.run.metrics_read import iter_records

SACCT_FORMAT = "JobID,Submit,Start,End,State"


@dataclass(frozen=True)
class RunFiles:
    """What the report reads from a run folder."""

    folder: Path
    records: Recorded  # metrics.jsonl, compiled as it is read
    lines: tuple[AttemptLine, ...]
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
    # The kit's own reader (a cut line skipped, only start and end lines), then the report's merge, which
    # skips a line whose fields have the wrong type rather than fail.
    lines = tuple(merge_attempt_lines(attempts.read_lines(folder)))
    slurm: Mapping[tuple[str, int], Window] = {}
    if use_sacct:
        jobs = sorted(
            {a.job for a in lines}
            | {str(seg.start["job"]) for seg in records.segments if seg.start and seg.start.get("job")}
        )
        slurm = {key: w for job in jobs for key, w in sacct_windows(job).items()}
    return RunFiles(folder, records, lines, slurm, running=is_held(folder))


def sacct_windows(job: str) -> dict[tuple[str, int], Window]:
    """Start and end of each run of Slurm job `job` ({} when it is no Slurm job id, or sacct cannot tell)."""
    if not job.isdigit():
        return {}
    out = proc.run(["sacct", "-j", job, "--duplicates", "-X", "-P", "-n", "-o", SACCT_FORMAT], timeout_s=10)
    return parse_sacct(job, out.stdout.splitlines()) if out.ok else {}


def parse_sacct(job: str, lines: Iterable[str]) -> dict[tuple[str, int], Window]:
    """sacct's parsable rows of one job (`--duplicates`: one row per run of a requeued job), oldest start
    first, as restart 0, 1, 2...; rows that never started are skipped."""
    runs: list[tuple[float, float | None]] = []
    for line in lines:
        fields = line.strip().split("|")
        if len(fields) < 4 or fields[0].split(".")[0].split("_")[0] != job:
            continue
        start, end = _slurm_time(fields[2]), _slurm_time(fields[3])
        if start is not None:
            runs.append((start, end))
    runs.sort(key=lambda r: r[0])
    return {(job, k): Window(start, end) for k, (start, end) in enumerate(runs)}


def _slurm_time(text: str) -> float | None:
    """Slurm's local time "2026-12-02T10:01:00" in seconds since the epoch; None for Unknown/None."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


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
