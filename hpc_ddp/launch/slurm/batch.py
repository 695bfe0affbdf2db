"""The batch shell's two steps around `srun`: `begin` before it, `end` after it. Both kit jobs run them
(`slurm/ddp.sbatch`, and the job `submit` builds, as submitit's setup and teardown lines):

    python -m hpc_ddp.launch.slurm.batch begin -- <training options>
    srun ... python -m hpc_ddp.train <training options>
    python -m hpc_ddp.launch.slurm.batch end --status $? -- <training options>

Why the batch shell: it is the one process of the job that outlives every task, so the decision about an
attempt runs even when every task died (a node lost, a rank SIGKILLed, a hang verdict). `end` reads what the
attempt left (the ranks' exit notes, hang.json, preempted.json, srun's "task N: Killed" lines, Slurm's view of
the job and its nodes), judges the first cause (hpc_ddp.launch.retry, through hpc_ddp.launch.supervisor), appends the attempt's end to
attempts.jsonl, and acts:

- finished: exit 0. A preemption the ranks agreed to requeue: `scontrol requeue` (the tasks run with
  HPC_DDP_BATCH set, so they leave the requeue to this shell).
- a failure within --max-restarts, not a crash loop: requeue from the latest checkpoint. When the failure
  points at a node, the requeued job excludes every node blamed so far. Slurm 22.05 refuses ExcNodeList on a
  running job, so: `scontrol requeuehold` (the job pends, held), `scontrol update ExcNodeList=...`,
  `scontrol release`, with SIGTERM blocked meanwhile (the requeue ends this very shell). If the job no longer
  fits on the partition's usable nodes, it stops instead of pending forever; with --min-nodes M, it goes on
  with the usable nodes left while there are at least M (the same update lowers its node and task counts:
  a smaller world size, which the tasks' sharded checkpoint reshards, --allow-resize).
- otherwise: stop, with the first error's traceback once and the attempts so far.

`begin` closes the previous attempt when its batch shell died before `end` could (its node went down: Slurm
requeued the job itself, NODE_FAIL), applies --max-restarts to it, and notes when this attempt began (a
hang verdict or preemption record older than that is not its own) and where its srun lines start in the
batch log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp import exitcodes
from hpc_ddp.cli import build_parser
from hpc_ddp.cluster.env import restart_count
from hpc_ddp.errors import UsageError, run_main
from hpc_ddp.launch import retry, supervisor
from hpc_ddp.launch.slurm import min_nodes
from hpc_ddp.launch.slurm.client import Size, SlurmClient
from hpc_ddp.launch.slurm.parse import JobInfo, hosts
from hpc_ddp.ledger import attempts as record
from hpc_ddp.ledger import exits, outcomes, preemption
from hpc_ddp.ledger import verdict as hang_verdict
from hpc_ddp.run import configfile
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig, add_train_arguments, check_min_nodes, from_namespace
from hpc_ddp.variables import FOLDER_FILE

PROG = "python -m hpc_ddp.launch.slurm.batch"
STATE = "batch.json"  # in exits/<job>-<restart>/: when this attempt began, where its srun lines start

_SRUN_LINE = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.+)$")
_SIGNAL_TEXT = {signal.strsignal(s) or "": s.name for s in signal.Signals}


def say(text: str) -> None:
    print(f"[hpc_ddp] {text}", file=sys.stderr, flush=True)


# ----- pure parts ----------------------------------------------------------------------------------------


def srun_deaths(lines: Sequence[str]) -> tuple[tuple[int, str], ...]:
    """srun's "task N: <signal text>" lines -> ((rank, signal name), ...), but only when a death by a signal
    came first: after a task exits with an error, srun's --kill-on-bad-exit kills the others and reports them
    the same way (pure)."""
    deaths: list[tuple[int, str]] = []
    for line in lines:
        match = _SRUN_LINE.search(line)
        if not match:
            continue
        what = match.group(3).strip()
        if what.startswith("Exited with exit code"):
            if not deaths:
                return ()  # a task failed on its own first: its exit note tells the cause
            continue
        name = _SIGNAL_TEXT.get(what, what)
        for part in match.group(2).split(","):
            low, _, high = part.partition("-")
            deaths.extend((rank, name) for rank in range(int(low), int(high or low) + 1))
    return tuple(deaths)


def _down(client: SlurmClient, nodes: Sequence[str]) -> tuple[str, ...]:
    """The nodes of `nodes` that Slurm reports down, drained or failed (one that sinfo does not list is not)."""
    states = client.nodes()
    return tuple(n for n in nodes if retry.usable({n: states.get(n, "idle")}, ()) == [])


def first_exit(lines: Sequence[str]) -> int | None:
    """The exit code of the first task that exited on its own ("task 0: Exited with exit code 2"), unless a
    task died by a signal first; None when srun said neither (pure). A task that exits 2 made a usage error
    (a bad option, a run folder another job holds): srun's own status is then 1 or a signal's, not 2."""
    for line in lines:
        match = _SRUN_LINE.search(line)
        if not match:
            continue
        what = match.group(3).strip()
        if not what.startswith("Exited with exit code"):
            return None
        code = what.rsplit(" ", 1)[-1]
        return int(code) if code.isdigit() else None
    return None


def other_job(folder: Path, job: str) -> str | None:
    """The job that holds `folder` now when it is not this one ("" for a run without a job id); else None.
    A job never writes into, nor resumes from, another job's run folder."""
    holder = run_folder.holder_job(folder)
    return holder if holder is not None and holder != job else None


def _resolve(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[TrainConfig, Path]:
    parser = build_parser(PROG, "training options, as the tasks get them")
    configfile.add_argument(parser)  # sbatch slurm/ddp.sbatch --config run.toml: the tasks read it too
    add_train_arguments(parser)
    cfg = from_namespace(configfile.parse(parser, list(argv)))
    folder = Path(cfg.folder) if cfg.folder else run_folder.default_for_task(environ.get("SLURM_JOB_ID"))
    # A relative folder is the tasks': srun starts them in SLURM_WORKING_DIR when that is set, not here.
    return cfg, Path(environ.get("SLURM_WORKING_DIR") or ".") / folder


def _identity(environ: Mapping[str, str]) -> tuple[str, int]:
    job = environ.get("SLURM_JOB_ID") or ""
    if not job:
        raise UsageError("SLURM_JOB_ID is not set: this runs in a Slurm batch script (slurm/ddp.sbatch)")
    return job, restart_count(
        environ
    )  # the batch shell is no srun step: the job's count, as its tasks read it


def _state_path(folder: Path, job: str, restart: int) -> Path:
    return exits.attempt_folder(folder, job, restart) / STATE


def _read_state(folder: Path, job: str, restart: int) -> dict[str, Any]:
    try:
        data = json.loads(_state_path(folder, job, restart).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# Why a job that is over ended, when its own batch shell could not record it (Slurm SIGKILLs the shell KillWait
# after the time limit's SIGTERM, while its tasks still save): accounting's state of its last run.
_OVER = {
    "TIMEOUT": (outcomes.STOPPED, "its time limit ended it before its batch shell could record the attempt"),
    "CANCELLED": (outcomes.STOPPED, "cancelled before its batch shell could record the attempt"),
    "DEADLINE": (outcomes.STOPPED, "its deadline ended it before its batch shell could record the attempt"),
}


def close_over(
    journal: supervisor.Journal, client: SlurmClient, which: Callable[[record.Attempt], bool]
) -> list[str]:
    """Close the open attempts of the folder that `which` selects once Slurm says their jobs are over (a time
    limit before the first checkpoint: Slurm SIGKILLed the batch shell KillWait after its SIGTERM, before
    `end`), with what ended them; the lines that say so. A job still running, or one Slurm does not answer
    for, is left alone. Nothing to decide: the job is over, each is recorded as stopped. Called by the next
    job's `begin` (for other jobs) and by `submit --wait` once its own job is over."""
    left = [a for a in record.merge(record.read_lines(journal.folder)) if which(a) and a.ended is None]
    if not left:
        return []
    histories = client.histories(sorted({a.job for a in left})) or {}
    lines = []
    for attempt in left:
        history = histories.get(attempt.job)
        if history is None or not history.current.done:
            continue
        outcome, reason = _OVER.get(
            history.current.state,
            (outcomes.LOST, f"its job ended {history.current.state} before its batch shell recorded it"),
        )
        closed = supervisor.end_attempt(
            journal,
            attempt.job,
            attempt.restart,
            retry.Ending(outcome, reason, signature=history.current.state.lower()),
            _no_budgets(),
            began=attempt.started or 0,
            checkpoint=supervisor.latest_step(journal.folder),
            adjust=lambda _this, decision: retry.Decision(outcomes.STOP, "the job is over", decision.exclude),
        )
        lines.append(f"job {attempt.job}: {closed.line}")
    return lines


def _close_other_jobs(journal: supervisor.Journal, job: str, client: SlurmClient) -> None:
    """Close what other jobs left open in this folder (`close_over`): their budgets are theirs."""
    for line in close_over(journal, client, lambda a: a.job != job):
        say(line)


def attempts_of_others(journal: supervisor.Journal, job: str) -> list[record.Attempt]:
    return [a for a in record.merge(record.read_lines(journal.folder)) if a.job != job]


def _no_budgets() -> supervisor.Budgets:
    return supervisor.Budgets(0, 0, outcomes.REQUEUE)


def begin(argv: Sequence[str], log: str, environ: Mapping[str, str], client: SlurmClient) -> int:
    cfg, folder = _resolve(argv, environ)
    job, restart = _identity(environ)
    # Here, not only at submission: slurm/ddp.sbatch takes the options as they come. The node count is what
    # Slurm allocated (fewer than asked once the job went on without bad nodes: M is still at most that).
    check_min_nodes(cfg, job_size(environ, None), min_nodes.tasks_per_node(environ))
    journal = supervisor.Journal(folder)
    if other_job(folder, job) is None:
        _close_other_jobs(journal, job, client)
    history = journal.history(job)
    for open_attempt in [a for a in history if a.restart < restart and a.ended is None]:
        # Its batch shell died before its `end` (its node went down with it, most likely): close it now.
        nodes = list(open_attempt.nodes)
        down = _down(client, nodes) if nodes else ()
        ending = retry.judge(
            retry.Evidence(code=exitcodes.FAILED, rank_nodes=open_attempt.ranks, down=down, node_fail=True)
        )
        if not down:
            ending = replace(
                ending,
                outcome=outcomes.LOST,
                reason="its batch shell ended without a word (the node it ran on failed, or it was killed)",
                signature="lost",
            )
        closed = supervisor.end_attempt(
            journal,
            job,
            open_attempt.restart,
            ending,
            _budgets(cfg),
            began=open_attempt.started or 0,
            checkpoint=supervisor.latest_step(folder),
        )
        say(closed.line)
        if closed.decision.action == outcomes.STOP:
            say(f"job {job} stops here: {closed.decision.message}")
            return exitcodes.FAILED
    offset = 0
    if log:
        try:
            offset = os.path.getsize(log)
        except OSError:
            offset = 0
    if (
        folder.is_dir() and other_job(folder, job) is None
    ):  # else the tasks create it (a first start); `end` then goes by rank 0's start record
        where = exits.attempt_folder(folder, job, restart)
        where.mkdir(parents=True, exist_ok=True)
        run_folder.atomic_write_bytes(
            where / STATE, json.dumps({"began": time.time(), "log": log, "offset": offset}).encode()
        )
    number = len(journal.history(job)) + 1
    say(
        f"attempt {number} of job {job} (restart {restart}) on {environ.get('SLURM_JOB_NODELIST', '?')}; run "
        f"folder {folder.absolute()}"
    )
    return exitcodes.OK


def _srun_lines(state: dict[str, Any], log: str) -> list[str]:
    path = log or state.get("log") or ""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(int(state.get("offset") or 0))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _told_folder(environ: Mapping[str, str]) -> Path | None:
    """The run folder global rank 0 resolved and wrote to HPC_DDP_FOLDER_FILE (slurm/ddp.sbatch), if any: the
    tasks may resolve it otherwise than these options say (an edited srun line, srun's --chdir)."""
    try:
        text = Path(environ.get(FOLDER_FILE) or "").read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def job_size(environ: Mapping[str, str], info: JobInfo | None) -> int:
    """How many nodes the job asked for: the batch environment's SLURM_JOB_NUM_NODES (or SLURM_NNODES), what
    the submission got. Slurm's NumNodes only when neither is set: while Slurm requeues a job it is
    COMPLETING, and NumNodes then counts only the nodes still completing (`sbatch -N2 --requeue` with a node
    lost: `JobState=COMPLETING Restarts=1 NumNodes=1`), so a job that no longer fits looked as if it did and
    pended forever (pure)."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        text = environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return max(info.num_nodes if info else 0, 1)


def slurm_requeued(info: JobInfo | None, restart: int) -> bool:
    """Slurm requeued the job itself (a node failure, `scontrol requeue`, PreemptMode=REQUEUE): the job is on
    its way back to pending, or has been restarted more often than this attempt's restart count (pure)."""
    if info is None or info.gone:
        return False
    return info.state.kind.waiting or info.restarts > restart


def requeued_healthy(status: int, requeued: bool, down: Sequence[str]) -> retry.Ending | None:
    """A requeue Slurm performed with every node of the attempt healthy (`scontrol requeue`, which is what
    PreemptMode=REQUEUE does) is a preemption, counted against --max-requeue, not a node failure (pure)."""
    if not requeued or down or status == exitcodes.OK:
        return None
    return retry.Ending(
        outcomes.PREEMPTED,
        "preempted: Slurm requeued the job (scontrol requeue, or preemption) with every node up",
    )


def end(argv: Sequence[str], status: int, log: str, environ: Mapping[str, str], client: SlurmClient) -> int:
    cfg, folder = _resolve(argv, environ)
    folder = _told_folder(environ) or folder
    try:  # the tasks may have ended before rank 0 made it (srun could not start them, a usage error)
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        say(f"cannot record this attempt in {folder} ({e.strerror or e}); exiting as srun did ({status})")
        return status
    job, restart = _identity(environ)
    holder = other_job(folder, job) if status != exitcodes.OK else None
    if holder is not None:
        # Rank 0 was refused the folder (it exited 2): not this job's record to write, nor its checkpoint.
        owner = f"job {holder}" if holder else "another run"
        say(
            f"run folder {folder} is held by {owner}: this job recorded nothing there and stops (a usage "
            "error, not retried). Fix: give this job its own --folder"
        )
        return exitcodes.USAGE
    state = _read_state(folder, job, restart)
    journal = supervisor.Journal(folder)
    this = record.find(journal.history(job), job, restart)
    began = float(state.get("began") or (this.started if this else 0) or 0)
    info = client.job(job)
    requeued = slurm_requeued(info, restart)
    nodes = (list(this.nodes) if this else []) or list(hosts(environ.get("SLURM_JOB_NODELIST", "")))
    down = _down(client, nodes) if status != exitcodes.OK else ()
    # This attempt's own preemption record only: an older one (kept for the user) is no decision about it.
    preempted = preemption.read_since(folder, began) if status == exitcodes.PREEMPTED else None
    by_rank0 = preempted is not None and preempted.mode == "scontrol"  # rank 0 decided and requeued itself
    lines = _srun_lines(state, log)
    usage = status != exitcodes.OK and first_exit(lines) == exitcodes.USAGE
    evidence = retry.Evidence(
        code=exitcodes.USAGE if usage else status,
        rank_nodes=this.ranks if this else (),
        notes=tuple(exits.read(folder, job, restart)),
        verdict=hang_verdict.read(folder, since=began) if began else None,
        killed=srun_deaths(lines),
        requeue=preempted.requeue if preempted else None,
        rank0_requeued=(bool(preempted.requeued) if by_rank0 and preempted else None),
        down=down,
        node_fail=requeued and status != exitcodes.OK,
    )
    size = job_size(environ, info)
    closed = supervisor.end_attempt(
        journal,
        job,
        restart,
        requeued_healthy(status, requeued, down) or evidence,
        _budgets(cfg),
        began=began,
        checkpoint=supervisor.latest_step(folder),
        adjust=lambda _this, decision: _fits(
            client, decision, info, size, min_nodes.smaller(cfg, environ, folder)
        ),
        exclude=lambda decision: _excluded(decision, info),
    )
    this, decision, ending = closed.attempt, closed.decision, closed.ending
    if this.outcome == outcomes.HANG:
        say(f"{this.reason}; every rank's report: {hang_verdict.path(folder)}")
    say(closed.line + (" (Slurm requeued the job itself)" if requeued else ""))
    if not journal.flush():
        say(journal.lost())
    if decision.action == outcomes.DONE:
        return exitcodes.OK
    if decision.action == outcomes.REQUEUE:
        # Rank 0 requeued the job itself after an agreed save (--requeue-by scontrol): nothing left to do here.
        resize = min_nodes.size(decision, environ)
        code = _requeue(client, job, this.exclude, info, requeued, resize) if not by_rank0 else exitcodes.OK
        return status if code == exitcodes.OK else code  # a requeued job's shell ends as its tasks did
    _stop(job, ending, decision, journal.history(job))
    if requeued:
        _cancel(client, job)
    return outcomes.exit_code(this.outcome)


def _cancel(client: SlurmClient, job: str) -> None:
    """A stop decision ends the job whoever requeued it: Slurm requeued this one already (a node failure,
    `scontrol requeue`), and left alone it would run again, or pend forever when it no longer fits. Cancelled,
    not held: a held job pends forever too (only quieter), and `--wait` would follow it for good; a cancelled
    one is over, and attempts.jsonl keeps why. The cancel ends this shell: SIGTERM is blocked until then."""
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP))
    out = client.cancel(job)
    say(
        f"cancelled job {job}: Slurm had requeued it, and it stops here"
        if out.ok
        else f"scancel {job} failed ({out.error}): cancel it yourself (scancel {job}), or it may run again"
    )


def _budgets(cfg: TrainConfig) -> supervisor.Budgets:
    return supervisor.Budgets(cfg.max_restarts, cfg.max_requeue, outcomes.REQUEUE)


def _excluded(decision: retry.Decision, info: JobInfo | None) -> tuple[str, ...]:
    """The nodes the requeued job must avoid: those it already avoids, and every node blamed so far."""
    if decision.action != outcomes.REQUEUE or not decision.exclude:
        return decision.exclude
    return tuple(dict.fromkeys([*(info.excluded if info else ()), *decision.exclude]))


def _fits(
    client: SlurmClient,
    decision: retry.Decision,
    info: JobInfo | None,
    needed: int,
    rule: min_nodes.Smaller = min_nodes.EVERY_NODE,
) -> retry.Decision:
    """A requeue that excludes nodes must leave the job enough usable ones, or it would pend forever: stop.
    `needed` is the size the job ran on (`job_size`), never the controller's NumNodes of the moment. With
    --min-nodes (`rule.least`), fewer will do: the job goes on with every usable node left, if at least
    that many remain (`Decision.nodes`)."""
    exclude = _excluded(decision, info)
    if decision.action != outcomes.REQUEUE or not exclude:
        return decision
    partition = info.partition if info else ""
    usable = retry.usable(client.nodes(partition), exclude)
    if len(usable) >= needed:
        return decision
    least = min_nodes.least(needed, rule)
    if len(usable) >= least:
        return min_nodes.go_on(decision, needed, len(usable), exclude, rule)
    minimum = f" (at least {least}, --min-nodes)" if least < needed else ""
    return retry.Decision(
        outcomes.STOP,
        f"cannot requeue: the job needs {needed} node(s){minimum} and only "
        f"{len(usable)} usable one(s) remain in partition "
        f"{partition or '?'} once {','.join(exclude)} are "
        "excluded (the others are down, drained or excluded)",
        exclude,
    )


def _requeue(
    client: SlurmClient,
    job: str,
    exclude: Sequence[str],
    info: JobInfo | None,
    already: bool,
    size: Size | None = None,
) -> int:
    """Requeue the job (unless Slurm did), excluding `exclude`, on `size` if given. The requeue ends this shell
    with SIGTERM, then SIGKILL after KillWait: SIGTERM is blocked until the job is released again."""
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP))
    done = client.requeue_excluding(job, exclude, info.excluded if info else (), already, size)
    say(done.message)
    return exitcodes.OK if done.ok else exitcodes.FAILED


def _stop(
    job: str, ending: retry.Ending, decision: retry.Decision, history: Sequence[record.Attempt]
) -> None:
    """The job ends here: the first error's traceback first, once, then the attempts in one table."""
    if ending.traceback:
        say(f"the error (rank {ending.rank} on {ending.node}):")
        for line in ending.traceback.splitlines():
            print(f"    {line}", file=sys.stderr)
    say(f"job {job} stops: {decision.message}. Attempts:")
    for a in history:
        print(f"    {record.summary(a)}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is the tasks' training options, parsed by the training parser (_resolve).
    own, train = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    parser = build_parser(PROG, __doc__ or "")
    parser.add_argument("step", choices=("begin", "end"), help="before srun (begin) or after it (end)")
    parser.add_argument("--status", type=int, default=0, help="srun's exit status (end)")
    parser.add_argument("--log", default="", help='a file that holds srun\'s own lines ("task N: Killed")')
    parser.epilog = "then: -- <training options of the tasks>"
    ns = parser.parse_args(own)
    client = SlurmClient()
    if ns.step == "begin":
        return begin(train, ns.log, environ, client)
    return end(train, ns.status, ns.log, environ, client)


def cli() -> NoReturn:
    run_main(PROG, main)


if __name__ == "__main__":
    cli()
