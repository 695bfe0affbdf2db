"""`python -m hpc_ddp.submit` on Slurm: build the job with submitit, submit it, and optionally follow it.

Layout of a run folder (`--folder`, on storage every node sees):

    <folder>/                    checkpoints/, model.pth, metrics.jsonl, run.json (written by the tasks)
    <folder>/submitit/           <job id>_submission.sh, <job id>_submitted.pkl (the pickled TaskEntry),
                                 <job id>_<rank>_log.out (one log per task), <job id>_<rank>_result.pkl

Both are created readable by the owner only: submitit unpickles, and so runs, what is in that folder.

Every task runs `TaskEntry`, which calls `hpc_ddp.train.main` with the validated training options; ranks are
derived inside by `hpc_ddp.cluster.env` from srun's variables, as on every other path.

Preemption. submitit installs its own handler for the preemption signal (USR2) before it calls the job: on
rank 0 alone it would checkpoint, `scontrol requeue` and exit, inside the handler, while the other ranks are
in a collective. `TaskEntry` and then `train.main` replace that handler first thing, so what happens is
hpc_ddp's: every rank agrees on a step, rank 0 saves once, all meet at a barrier, rank 0 requeues once. The
tasks then exit with `exitcodes.PREEMPTED` *without* a result file: submitit would read a result as "the job
is over" while the requeued run, which re-runs the same pickled `TaskEntry` and resumes from the folder's
latest checkpoint, is still to come.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, cast

from hpc_ddp import exitcodes, proc
from hpc_ddp.errors import UsageError, run_task
from hpc_ddp.launch.slurm.request import (
    JobState,
    SlurmRequest,
    check_signal_delay,
    mem_text,
    parse_extras,
    parse_sacct,
    parse_scontrol,
    parse_time,
    pending_hint,
    sbatch_error,
    submit_environ,
    with_batch_steps,
)
from hpc_ddp.ledger import attempts, outcomes
from hpc_ddp.ledger import preemption as preemption_record
from hpc_ddp.ledger import verdict as hang_verdict
from hpc_ddp.log import TracebackFold
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run import preemption, progress

if TYPE_CHECKING:
    from hpc_ddp.launch.shape import JobShape
    from hpc_ddp.run.config import TrainConfig

POLL_S = 2.0  # --wait: seconds between two looks at the job's state (one sacct call each)
TAIL_LINES = 20  # lines of the failing rank's log shown when the job failed
SUBMITIT_DIR = run_folder.SUBMITIT
TRAIN = "hpc_ddp.train"


@dataclass(frozen=True)
class TaskEntry:
    """What each task of the job runs (pickled by submitit): `<module>.main(argv)`, returning its exit code."""

    module: str
    argv: tuple[str, ...]

    def __call__(self) -> NoReturn:
        # First thing: take USR1/USR2/SIGTERM back from submitit (see the module docstring).
        preemption.install()
        main: Callable[[list[str]], int] = importlib.import_module(self.module).main

        def task() -> int:
            try:
                code = main(list(self.argv))
            except UsageError:
                raise  # one line in the task's log, as on the command line; no result file
            except Exception:
                _submitit_result("error", traceback.format_exc())  # failing_rank() orders ranks by its time
                raise
            if code == exitcodes.OK:
                _submitit_result("success", code)
            return code  # any other code: no result file, a requeued run may still come (see above)

        # The task ends here with os._exit, like `python -m hpc_ddp.train`: submitit never regains control,
        # so its result file (what it would write after we return) is written above.
        run_task(f"python -m {self.module}", task)


def _submitit_result(kind: str, value: object) -> None:
    """Write this task's result file as submitit's process_job does after the call returns or raises."""
    from submitit import JobEnvironment
    from submitit.core import utils

    with utils.temporary_save_path(JobEnvironment().paths.result_pickle) as tmp:
        utils.cloudpickle_dump((kind, value), tmp)


def log_path(folder: Path, job_id: str, rank: int = 0) -> Path:
    return folder / SUBMITIT_DIR / f"{job_id}_{rank}_log.out"


def request_from(ns: argparse.Namespace, shape: JobShape) -> SlurmRequest:
    """Validate the Slurm flags (raises UsageError)."""
    minutes = parse_time(ns.time)
    check_signal_delay(ns.signal_delay_s, minutes)
    if ns.cpus_per_task is not None and ns.cpus_per_task <= 0:
        raise UsageError(f"--cpus-per-task {ns.cpus_per_task}: must be at least 1")
    if not ns.job_name.strip() or any(c.isspace() for c in ns.job_name):
        raise UsageError(f"--job-name {ns.job_name!r}: use a name without spaces, e.g. --job-name resnet50")
    return SlurmRequest(
        nodes=shape.nodes,
        tasks_per_node=shape.tasks_per_node,
        gpus_per_node=shape.gpus_per_node,
        minutes=minutes,
        signal_delay_s=ns.signal_delay_s,
        job_name=ns.job_name,
        cpus_per_task=ns.cpus_per_task,
        mem=mem_text(ns.mem_gb) if ns.mem_gb is not None else None,
        partition=ns.partition,
        account=ns.account,
        qos=ns.qos,
        constraint=ns.constraint,
        exclusive=ns.exclusive,
        setup=tuple(ns.setup),
        extras=tuple(parse_extras(ns.slurm).items()),
    )


def sbatch_text(request: SlurmRequest, folder: Path, module: str = "", argv: tuple[str, ...] = ()) -> str:
    """The sbatch script submitit writes for this request (what `--print-sbatch` shows)."""
    from submitit.slurm.slurm import _make_sbatch_string

    python = shlex.quote(sys.executable)
    command = f"{python} -u -m submitit.core._submit {shlex.quote(str(folder / SUBMITIT_DIR))}"
    return _make_sbatch_string(
        command=command, folder=folder / SUBMITIT_DIR, **_parameters(request, folder, module, argv)
    )


def _parameters(request: SlurmRequest, folder: Path, module: str, argv: tuple[str, ...]) -> dict[str, Any]:
    """submitit's parameters; a training job gets the batch shell's steps around srun (attempts, retries)."""
    params = request.executor_parameters()
    if module != TRAIN:
        return params
    return with_batch_steps(params, shlex.quote(sys.executable), argv, str(folder / SUBMITIT_DIR))


def prepare_folder(folder: Path) -> None:
    """Create the run folder and its submitit folder, owner-only; refuse one that others can write."""
    for path in (folder, folder / SUBMITIT_DIR):
        run_folder.prepare(path, private=True)


@contextmanager
def submission_environ() -> Iterator[None]:
    """os.environ without an enclosing job's variables, while sbatch runs (sbatch exports it into the job)."""
    saved = dict(os.environ)
    clean = submit_environ(saved)
    for key in set(saved) - set(clean):
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def submit(ns: argparse.Namespace, shape: JobShape, cfg: TrainConfig, module: str) -> int:
    """The non-local path of `python -m hpc_ddp.submit`; returns the exit code."""
    request = request_from(ns, shape)
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{module} is not available in this installation of hpc_ddp")
    folder = Path(cfg.folder).absolute() if cfg.folder else run_folder.default_for_submission(ns.job_name)
    cfg = cfg.with_folder(str(folder))  # the tasks, and a requeued run, write to and resume from here
    argv = (
        *cfg.to_argv(),
        *(["--collective"] if getattr(ns, "collective", False) else []),
    )  # a doctor option
    if ns.print_sbatch:
        print(sbatch_text(request, folder, module, argv), end="")
        print(f"# every task runs: python -m {module} {shlex.join(argv)}", file=sys.stderr)
        return exitcodes.OK
    if shutil.which("sbatch") is None:
        raise UsageError(
            "sbatch not found on PATH: this machine is not a Slurm submit host. Fix: run on a login "
            "node (or load the Slurm module), use --print-sbatch to see the script, or --local"
        )
    existed = folder.exists()
    prepare_folder(folder)
    try:
        job_id = _submit(
            request,
            folder,
            TaskEntry(module, argv),
            cfg.max_requeue,
            _parameters(request, folder, module, argv),
        )
    except UsageError:
        if not existed:  # leave nothing behind for a job that never was
            shutil.rmtree(folder, ignore_errors=True)
        raise
    submitted_at = time.time()
    log = log_path(folder, job_id)
    print(
        f"Submitted job {job_id}: {shape.nodes} node(s) x {shape.tasks_per_node} task(s), run folder {folder}",
        flush=True,
    )
    if not ns.wait:
        print(
            f"  rank 0 log:  {log}  (rank N: {job_id}_N_log.out)\n"
            f"  follow it:   tail -F {log}\n"
            f"  state:       sacct -j {job_id}    cancel: scancel {job_id}",
            flush=True,
        )
        return exitcodes.OK
    print(f"Following {log} until the job ends (Ctrl-C stops following; the job keeps running)", flush=True)
    try:
        return follow(job_id, folder, shape.world_size, submitted_at)
    except KeyboardInterrupt:
        print(f"\nStopped following job {job_id}; it keeps running (scancel {job_id} to stop it)", flush=True)
        return 130


def _submit(
    request: SlurmRequest, folder: Path, entry: TaskEntry, max_requeue: int, params: dict[str, Any]
) -> str:
    import submitit
    from submitit.core.utils import FailedJobError

    executor = submitit.SlurmExecutor(folder=folder / SUBMITIT_DIR, max_num_timeout=max_requeue)
    executor.update_parameters(**params)
    # submitit prints sbatch's stderr when sbatch fails; it is in the exception too, and becomes one line.
    with submission_environ(), redirect_stderr(io.StringIO()):
        try:
            job = executor.submit(entry)
        except FailedJobError as e:
            raise UsageError(sbatch_error(str(e))) from None
    return str(job.job_id)


# ----- following a job ---------------------------------------------------------------------------------


def _run(argv: list[str]) -> str | None:
    """A Slurm command's output, or None when it failed (the caller asks again at its next poll)."""
    out = proc.run(argv)
    return out.stdout if out.ok else None


def job_state(job_id: str) -> JobState | None:
    """The job's current state from sacct, else from scontrol (clusters without accounting)."""
    text = _run(["sacct", "-X", "-n", "-P", "-o", "State,ExitCode", "-j", job_id])
    state = parse_sacct(text) if text else None
    if state is None:
        text = _run(["scontrol", "show", "job", "-o", job_id])
        state = parse_scontrol(text) if text else None
    return state


def _pending_reason(job_id: str) -> str:
    return (_run(["squeue", "-h", "-j", job_id, "-o", "%r"]) or "").strip()


def _wait_while_completing(job_id: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and (_run(["squeue", "-h", "-j", job_id, "-o", "%T"]) or "").strip():
        time.sleep(0.5)
    time.sleep(0.5)  # the log's last lines may land just after the processes are gone


def _chatter(line: str) -> bool:
    """submitit's own progress lines ("Starting with JobEnvironment...", "Bypassing signal SIGCONT")."""
    return line.startswith(("submitit INFO", "submitit WARNING"))


class _LogFollower:
    """Prints what a growing log file gains, whole lines only, skipping submitit's chatter."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out, self.offset, self.partial = path, out, 0, b""
        self.folded = TracebackFold(str(path))

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            line = self.folded.feed(raw.decode("utf-8", "replace"))
            if line is not None and not _chatter(line):
                self.out.write(line + "\n")
        self.out.flush()


def follow(
    job_id: str,
    folder: Path,
    world_size: int,
    submitted_at: float,
    out: TextIO = sys.stdout,
    state_of: Callable[[str], JobState | None] = job_state,
) -> int:
    """--wait: print rank 0's log as it grows until the job ends, then report; returns the exit code. The
    progress line of the job's metrics.jsonl is shown below it (in place on a terminal), with each start."""
    metrics = progress.MetricsView(folder / run_folder.METRICS, out)
    out = cast(TextIO, metrics.stream)  # what else is written erases the live line first
    follower = _LogFollower(log_path(folder, job_id), out)
    last, last_reason = "", ""
    unknown_since = time.monotonic()
    attempts_seen = 0
    done_since: float | None = None
    while True:
        state = state_of(job_id)
        follower.poll()
        metrics.poll()
        if state is None:  # sacct may lag behind a fresh submission for a moment
            if time.monotonic() - unknown_since > 300:
                out.write(
                    f"[submit] cannot get the state of job {job_id} from sacct or scontrol for 5 minutes; "
                    f"stopped following. Check: sacct -j {job_id}\n"
                )
                return exitcodes.FAILED
            time.sleep(POLL_S)
            continue
        unknown_since = time.monotonic()
        if state.state == "PENDING":
            reason = _pending_reason(job_id)
            if reason not in ("", "None", last_reason):
                out.write(f"[submit] job {job_id} pending: {pending_hint(reason)}\n")
                out.flush()
            last_reason = reason
        if state.state != last:
            if state.state in ("REQUEUED", "PENDING") and last in ("RUNNING", "COMPLETING", "REQUEUED"):
                out.write(f"[submit] job {job_id} was requeued; waiting for it to start again\n")
            last = state.state
        attempts_seen = _show_attempts(folder, job_id, attempts_seen, out)
        if state.done and not _over(job_id, folder, state, done_since := done_since or time.monotonic()):
            time.sleep(
                POLL_S
            )  # requeued: Slurm's accounting shows the last run's end (NODE_FAIL) for a while
            continue
        done_since = None if not state.done else done_since
        if state.done:
            # Slurm marks a cancelled or timed-out job done at once, while its tasks may still be saving
            # (they have KillWait seconds): wait until the last process is gone before reporting.
            _wait_while_completing(job_id)
            follower.poll()
            metrics.poll()
            metrics.stream.keep()
            out.flush()
            return report(job_id, folder, world_size, state, submitted_at, out)
        time.sleep(POLL_S)


REQUEUE_GRACE_S = 90.0  # a job seen done while its attempts record says "requeued": how long to wait for it


def _show_attempts(folder: Path, job_id: str, seen: int, out: TextIO) -> int:
    """Print each new attempt of the job as it starts ("attempt 2 on node1,node3: resumed from step 120");
    how it ended comes through the batch log (hpc_ddp.launch.slurm.batch). Returns the starts seen so far."""
    started = [a for a in attempts.of_job(attempts.read(folder), job_id) if a.started is not None]
    for a in started[seen:]:
        out.write(f"[submit] {attempts.start_line(a)}\n")
        out.flush()
    return max(seen, len(started))


def _over(job_id: str, folder: Path, state: JobState, done_since: float) -> bool:
    """Is a job that Slurm's accounting shows done really over? Not while the controller has it pending or
    running again (a requeue: sacct still shows the last run's NODE_FAIL), nor, for a while, when its
    attempts record says the last attempt was requeued and the controller has not caught up yet."""
    fields = dict(re.findall(r"(\w+)=(\S*)", _run(["scontrol", "show", "job", "-o", job_id]) or ""))
    current = fields.get("JobState", "").upper()
    if current and current not in (
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    ):
        return False
    ends = [a for a in attempts.of_job(attempts.read(folder), job_id) if a.ended is not None]
    requeued = bool(ends) and ends[-1].decision == outcomes.REQUEUE or state.state == "NODE_FAIL"
    return not requeued or time.monotonic() - done_since > REQUEUE_GRACE_S


def report(
    job_id: str, folder: Path, world_size: int, state: JobState, submitted_at: float, out: TextIO
) -> int:
    """The final word on a finished job, and the exit code that `--wait` returns."""

    def say(text: str) -> None:
        print(f"[submit] {text}", file=out, flush=True)

    saved = preemption_record.since(folder, submitted_at)
    resume = f"; the ranks saved a checkpoint first: run the same command to resume from {folder}"
    if state.state == "COMPLETED":
        say(f"job {job_id} completed; run folder {folder}")
        return exitcodes.OK
    # A hang verdict decides, not the exit code alone: srun reports the highest task code or 128+signal.
    verdict = hang_verdict.read(folder, since=submitted_at)
    if verdict is not None and state.state != "CANCELLED":
        say(f"job {job_id}: {verdict.get('line', 'hang')}; every rank's report: {hang_verdict.path(folder)}")
        return exitcodes.HANG
    if state.state == "FAILED" and state.exit_code == exitcodes.NONFINITE:
        say(
            f"job {job_id} stopped: the loss became NaN or infinite (exit code {exitcodes.NONFINITE}); every rank "
            f"stopped before applying that update and nothing was saved after the last finite step (see the log "
            f"above). Fix: check the data, a smaller --lr or --clip-grad, then resume from {folder}"
        )
        return exitcodes.NONFINITE
    if state.state == "FAILED" and state.exit_code == exitcodes.PREEMPTED:
        say(f"job {job_id} stopped after a signal and was not requeued (see the log above){resume}")
        return exitcodes.PREEMPTED
    how = {
        "CANCELLED": "was cancelled",
        "TIMEOUT": "hit its time limit",
        "PREEMPTED": "was preempted",
        "OUT_OF_MEMORY": "ran out of memory (--mem-gb)",
        "NODE_FAIL": "lost a node",
    }.get(state.state, f"ended {state.state}")
    if saved:
        say(f"job {job_id} {how}{resume}")
        return exitcodes.PREEMPTED
    signal = f", signal {state.signal}" if state.signal else ""
    say(f"job {job_id} {how} (exit code {state.exit_code}{signal})")
    ends = [a for a in attempts.of_job(attempts.read(folder), job_id) if a.ended is not None]
    if ends and ends[-1].decision == outcomes.STOP:
        # The batch shell's `end` step showed the first error's traceback and every attempt (above): once.
        last = ends[-1]
        who = (
            f"rank {last.rank} failed first" + (f" (on {last.node})" if last.node else "") + ": "
            if last.rank is not None
            else ""
        )
        say(
            f"{who}{last.reason}; after {len(ends)} attempt(s) the job stopped: its traceback and every attempt "
            "are shown above"
        )
        return outcomes.exit_code(last.outcome)  # as the batch shell's `end` step exited
    if state.state != "CANCELLED":
        _show_failure(job_id, folder, world_size, say)
    return exitcodes.USAGE if state.exit_code == exitcodes.USAGE else exitcodes.FAILED


def failing_rank(job_id: str, folder: Path, world_size: int) -> int | None:
    """The rank that failed first: the oldest error result (submitit writes it as the exception passes
    through), else the first log with a traceback or an `error:` line."""
    sub = folder / SUBMITIT_DIR
    errors = []
    for rank in range(world_size):
        result = sub / f"{job_id}_{rank}_result.pkl"
        if result.exists() and b"error" in result.read_bytes()[:64]:
            errors.append((result.stat().st_mtime, rank))
    if errors:
        return min(errors)[1]
    for rank in range(world_size):
        text = _read(log_path(folder, job_id, rank))
        if "Traceback (most recent call last)" in text or ": error: " in text:
            return rank
    return None


def _show_failure(job_id: str, folder: Path, world_size: int, say: Callable[[str], Any]) -> None:
    rank = failing_rank(job_id, folder, world_size)
    if rank is None:
        say(f"no rank logged an error; see the logs in {folder / SUBMITIT_DIR}")
        return
    path = log_path(folder, job_id, rank)
    lines = [line for line in _read(path).splitlines() if not _chatter(line)]
    tracebacks = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    shown = lines[tracebacks[-1] :] if tracebacks else lines
    say(f"rank {rank} failed; the end of {path}:")
    for line in shown[-TAIL_LINES:]:
        say(f"    {line}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
