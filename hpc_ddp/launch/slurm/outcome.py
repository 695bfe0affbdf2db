"""The final word of `submit --wait` on a job that ended: one line for how it ended, the first error when
the job's own code failed, and the exit code `--wait` returns.

What `--wait` already printed is not printed again: rank 0's log was followed line by line (its tracebacks
folded to their last line, hpc_ddp.log.TracebackFold), and the batch shell's `end` step printed the first
error's traceback and every attempt when it stopped the job.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp import exitcodes
from hpc_ddp.launch.supervisor import latest_step
from hpc_ddp.ledger import attempts, judge, outcomes
from hpc_ddp.ledger import preemption as preemption_record
from hpc_ddp.ledger import verdict as hang_verdict
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.scheduler.base import End, Kind
from hpc_ddp.scheduler.slurm.states import JobState

TAIL_LINES = 20  # lines of the failing rank's log shown when the job failed
SUBMITIT_DIR = run_folder.SUBMITIT
_TRACEBACK = "Traceback (most recent call last)"


def log_path(folder: Path, job_id: str, rank: int = 0) -> Path:
    """A task's log; rank 0's holds the batch shell's lines too."""
    return folder / SUBMITIT_DIR / f"{job_id}_{rank}_log.out"


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def how_to_follow(job_id: str, folder: Path) -> str:
    """The commands that follow a submitted job by hand (paths quoted: they are meant to be copied)."""
    log = log_path(folder, job_id)
    return (
        f"  rank 0 log:  {log}  (rank N: {job_id}_N_log.out)\n"
        f"  follow it:   tail -F {shlex.quote(str(log))}\n"
        f"  state:       sacct -j {job_id}    cancel: scancel {job_id}"
    )


def chatter(line: str) -> bool:
    """submitit's own progress lines ("Starting with JobEnvironment...", "Bypassing signal SIGCONT")."""
    return line.startswith(("submitit INFO", "submitit WARNING"))


def rank_error(line: str) -> bool:
    """Does this line of a rank's log say that the rank itself failed (pure)? A traceback, or an `error:` line
    of its own ("python -m hpc_ddp.train: error: ..."); not slurmstepd's or srun's lines, which say what Slurm
    did to the job ("slurmstepd: error: *** JOB 5 ON node1 CANCELLED AT ... DUE TO TIME LIMIT ***")."""
    if _TRACEBACK in line:
        return True
    return ": error: " in line and not line.startswith(("slurmstepd", "srun:"))


def report(
    job_id: str,
    checkpoints: CheckpointStore,
    world_size: int,
    state: JobState,
    submitted_at: float,
    out: TextIO,
    shown: bool = False,
    resume: str = "",
) -> int:
    """The final word on a finished job, and the exit code that `--wait` returns. `shown`: the stop's first
    error and every attempt are above already (the batch shell's `end` printed them in the log followed, or
    the follower did). `resume`: the command that resumes the run (else "the same command"). `checkpoints`:
    the run folder's, through its --checkpoint-storage."""
    folder = checkpoints.folder

    def say(text: str) -> None:
        print(f"[submit] {text}", file=out, flush=True)

    if state.kind is Kind.SUCCESS:
        say(f"job {job_id} completed; run folder {folder}")
        return exitcodes.OK
    # The kit decided how the job ended (attempts.jsonl): that word stands, whatever the ranks did after the
    # first cause (saved on a SIGTERM, died of a closed connection) and whatever Slurm's state says.
    ends = [a for a in attempts.of_job(attempts.read(folder), job_id) if a.ended is not None]
    last = ends[-1] if ends else None
    if last is not None and last.decision == outcomes.STOP and last.outcome not in _SLURMS:
        return _stopped(job_id, checkpoints, last, len(ends), shown, resume, say)
    # Else the ledger's judge reads how Slurm says the job ended (hpc_ddp.ledger.judge.job_end), and the exit
    # code is its outcome's (hpc_ddp.ledger.outcomes): here it is only said.
    verdict = hang_verdict.read(folder, since=submitted_at)
    unwritable = run_folder.write_test(folder, ".write-test-wait") if folder.is_dir() else ""
    saved = preemption_record.since(folder, submitted_at)
    ending = judge.job_end(state.end or End.EXITED, state.exit_code, verdict is not None, saved, unwritable)
    _say_end(job_id, checkpoints, world_size, state, ending, verdict or {}, resume, say)
    return ending.exit_code


def _say_end(
    job_id: str,
    checkpoints: CheckpointStore,
    world_size: int,
    state: JobState,
    ending: judge.Ending,
    verdict: dict[str, Any],
    resume: str,
    say: Callable[[str], Any],
) -> None:
    """`submit --wait`'s words for how the judge says a job ended (`judge.job_end`, by its signature)."""
    folder = checkpoints.folder
    again = f": {resume}" if resume else ""
    resume_line = f"; the ranks saved a checkpoint first: run the same command to resume from {folder}{again}"
    signal = f", signal {state.signal}" if state.signal else ""
    code = f"(exit code {state.exit_code}{signal})"
    if ending.outcome == outcomes.HANG:
        say(f"job {job_id}: {verdict.get('line', 'hang')}; every rank's report: {hang_verdict.path(folder)}")
    elif ending.outcome == outcomes.NONFINITE:
        say(
            f"job {job_id} stopped: the loss became NaN or infinite (exit code {exitcodes.NONFINITE}); every rank "
            f"stopped before applying that update and nothing was saved after the last finite step (see the log "
            f"above). Fix: check the data, a smaller --lr or --clip-grad, then resume from {folder}"
        )
    elif ending.signature == judge.SIGNALLED:
        say(f"job {job_id} stopped after a signal and was not requeued (see the log above){resume_line}")
    elif ending.signature == judge.SAVED:
        say(f"job {job_id} {state.said}{resume_line}")
    elif ending.signature == judge.TIMED_OUT:
        say(f"job {job_id} {state.said} {code} {_timeout_advice(checkpoints, resume)}")
    elif ending.signature == judge.UNWRITABLE:  # its logs and records could not be written either
        say(
            f"job {job_id} {state.said} {code}: its run folder {folder} cannot be written ({ending.reason}), so "
            "nothing could be saved or recorded there. Fix the file system or its permissions, then run the "
            "same command again"
        )
    else:
        say(f"job {job_id} {state.said} {code}")
        if not state.by_slurm:  # Slurm ended it (cancel, node, preemption): no rank's error is the cause
            _show_failure(job_id, folder, world_size, say, ending.outcome == outcomes.USAGE)


# Outcomes whose stop Slurm caused (a cancel, a time limit: the record says "stopped"): its own words say it.
_SLURMS = (outcomes.STOPPED,)


def _stopped(
    job_id: str,
    checkpoints: CheckpointStore,
    last: attempts.Attempt,
    count: int,
    shown: bool,
    resume: str,
    say: Callable[[str], Any],
) -> int:
    """The final word on a job the kit stopped (the batch shell's `end`, or the follower): what the record
    says, once; the exit code of the outcome that stopped it (hpc_ddp.ledger.outcomes)."""
    folder = checkpoints.folder
    where = f" (on {last.node})" if last.node else ""
    who = f"rank {last.rank} failed first{where}: " if last.rank is not None else ""
    if last.outcome == outcomes.NODE_FAIL:
        who = f"a node failed{where}: "
    what = last.reason if last.outcome != outcomes.HANG else (last.reason.split(";")[0] or "a hang")
    above = "; its first error and every attempt are shown above" if shown else ""
    say(f"job {job_id} stopped after {count} attempt(s): {who}{what}{above}")
    if not shown:
        for a in attempts.of_job(attempts.read(folder), job_id):
            say(f"    {attempts.summary(a)}")
    if last.outcome in outcomes.RESUMABLE:
        step = latest_step(checkpoints)
        start = (
            f"its latest checkpoint (step {step})" if step is not None else "the start (no checkpoint yet)"
        )
        command = f": {resume}" if resume else ""
        say(f"once the cause is fixed, run the same command to resume from {start} in {folder}{command}")
    return outcomes.exit_code(last.outcome)


def _timeout_advice(checkpoints: CheckpointStore, resume: str = "") -> str:
    folder, step = checkpoints.folder, latest_step(checkpoints)
    if step is not None:
        command = f": {resume}" if resume else ""
        return (
            f"before the ranks saved at the signal: run the same command to resume from the latest checkpoint "
            f"(step {step}) in {folder}{command}"
        )
    return (
        "before the ranks saved a checkpoint: nothing to resume from. Fix: a longer --time, or a larger "
        "--signal-delay-s (the ranks save when the signal comes, that many seconds before the limit)"
    )


def failing_rank(job_id: str, folder: Path, world_size: int) -> int | None:
    """The rank that failed first: the oldest error result (submitit writes it as the exception passes
    through), else the first log with a line of its own error (`rank_error`)."""
    sub = folder / SUBMITIT_DIR
    errors = []
    for rank in range(world_size):
        result = sub / f"{job_id}_{rank}_result.pkl"
        if result.exists() and b"error" in result.read_bytes()[:64]:
            errors.append((result.stat().st_mtime, rank))
    if errors:
        return min(errors)[1]
    for rank in range(world_size):
        if any(rank_error(line) for line in read(log_path(folder, job_id, rank)).splitlines()):
            return rank
    return None


def _show_failure(
    job_id: str, folder: Path, world_size: int, say: Callable[[str], Any], usage: bool = False
) -> None:
    rank = failing_rank(job_id, folder, world_size)
    if rank is None and usage:  # refused before any task ran (srun's options): the batch shell said why
        say("a usage error, not retried: the line above says what to fix")
        return
    if rank is None:
        say(f"no rank logged an error; see the logs in {folder / SUBMITIT_DIR}")
        return
    path = log_path(folder, job_id, rank)
    lines = [line for line in read(path).splitlines() if not chatter(line)]
    tracebacks = [i for i, line in enumerate(lines) if _TRACEBACK in line]
    if not tracebacks and rank == 0:  # --wait printed rank 0's log as it grew: its last lines are above
        say(f"rank 0 failed; its log is shown above ({path})")
        return
    shown = lines[tracebacks[-1] :] if tracebacks else lines  # a traceback: --wait showed its last line only
    say(f"rank {rank} failed; the end of {path}:")
    for line in shown[-TAIL_LINES:]:
        say(f"    {line}")
