"""The batch shell's two steps around `srun`: `begin` before it, `end` after it. Both kit jobs run them
(`slurm/ddp.sbatch`, and the job `submit` builds, as submitit's setup and teardown lines):

    python -m hpc_ddp.launch.slurm.batch begin -- <training options>
    srun ... python -m hpc_ddp.train <training options>
    python -m hpc_ddp.launch.slurm.batch end --status $? -- <training options>

Why the batch shell: it is the one process of the job that outlives every task, so the decision about an
attempt runs even when every task died (a node lost, a rank SIGKILLed, a hang verdict). The kit's jobs run with
`--no-kill` (hpc_ddp.scheduler.slurm.request), so it outlives the loss of any node but its own: Slurm removes the
failed node, srun ends the step. `end` reads what the attempt left (the ranks' exit notes, hang.json,
preempted.json, srun's "task N: Killed" and "Node failure on node2" lines, srun's refusal of an option,
Slurm's view of the job and its nodes, whether the run folder can be written), judges the first cause
(hpc_ddp.ledger.judge and rules, through hpc_ddp.launch.supervisor), appends the attempt's end to attempts.jsonl, and
acts:

- finished: exit 0. A preemption the ranks agreed to requeue: `scontrol requeue` (the tasks run with
  HPC_DDP_BATCH set, so they leave the requeue to this shell).
- a failure within --max-restarts, not a crash loop: requeue from the latest checkpoint. When the failure
  points at a node, the requeued job excludes every node blamed so far. Slurm 22.05 refuses ExcNodeList on a
  running job, so: `scontrol requeuehold` (the job pends, held), `scontrol update ExcNodeList=...`,
  `scontrol release`, with SIGTERM blocked meanwhile (the requeue ends this very shell). If the job no longer
  fits on the partition's usable nodes, it stops instead of pending forever; with --min-nodes M, it goes on
  with the usable nodes left while there are at least M (the same update lowers its node and task counts:
  a smaller world size, which the tasks' sharded checkpoint reshards, --allow-resize); with --wait-for-nodes
  it is requeued all the same, to pend until enough nodes are back.
- otherwise: stop, with the first error's traceback once and the attempts so far. Its exit ends the job;
  one Slurm requeued itself meanwhile is cancelled.

This is the one place a job's attempt is decided while it runs; a later in-allocation restart (a new srun on
the nodes left) would be one more action of `end`, on the same decision.

`begin` stops the job before srun when its run folder cannot be written, or belongs to another job (held by
it, or taken over since this job's last attempt: `taken_over`); closes the open attempts of other jobs that
are over, and this job's own attempt whose batch shell died before `end` could (hpc_ddp.launch.slurm.lost,
the same judge `submit --wait` uses), applying --max-restarts to it; and notes when this attempt began (a hang
verdict or preemption record older than that is not its own) and where its srun lines start in the batch log.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp import exitcodes
from hpc_ddp.cli import build_parser
from hpc_ddp.cluster import allocator
from hpc_ddp.cluster.env import in_place, order, requeues, restart_count
from hpc_ddp.errors import UsageError, run_main
from hpc_ddp.launch import spares, supervisor
from hpc_ddp.launch.slurm import inplace, lost, min_nodes
from hpc_ddp.ledger import attempts as record
from hpc_ddp.ledger import exits, judge, outcomes, preemption, rules
from hpc_ddp.ledger import verdict as hang_verdict
from hpc_ddp.run import configfile
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.config import TrainConfig, add_train_arguments, check_min_nodes, from_namespace
from hpc_ddp.scheduler.base import End, Size
from hpc_ddp.scheduler.slurm import env as slurm_env
from hpc_ddp.scheduler.slurm import parse, steps
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.parse import JobInfo, first_exit, hosts, srun_deaths, srun_refusal
from hpc_ddp.variables import FOLDER_FILE, IN_PLACE

PROG = "python -m hpc_ddp.launch.slurm.batch"
STATE = "batch.json"  # in exits/<job>-<restart>/: when this attempt began, where its srun lines start


def say(text: str) -> None:
    print(f"[hpc_ddp] {text}", file=sys.stderr, flush=True)


# ----- pure parts ----------------------------------------------------------------------------------------


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
    folder = (
        Path(cfg.folder) if cfg.folder else run_folder.default_for_task(slurm_env.job_id(environ) or None)
    )
    # A relative folder is the tasks': srun starts them in SLURM_WORKING_DIR when that is set, not here.
    return cfg, Path(slurm_env.working_dir(environ) or ".") / folder


def _identity(environ: Mapping[str, str]) -> tuple[str, int]:
    me = slurm_env.identity(environ)  # the batch shell is no srun step: the job's count, as its tasks read it
    if not me.job:
        raise UsageError("SLURM_JOB_ID is not set: this runs in a Slurm batch script (slurm/ddp.sbatch)")
    return me.job, me.restart


def _state_path(folder: Path, job: str, restart: int) -> Path:
    return exits.attempt_folder(folder, job, restart) / STATE


def _read_state(folder: Path, job: str, restart: int) -> dict[str, Any]:
    try:
        data = json.loads(_state_path(folder, job, restart).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _close_other_jobs(journal: supervisor.Journal, job: str, client: SlurmClient) -> None:
    """Close what other jobs left open in this folder once they are over (hpc_ddp.launch.slurm.lost): their
    budgets are theirs, and they are over."""
    for line in lost.close_over(journal, client, lambda a: a.job != job):
        say(line)


def attempts_of_others(journal: supervisor.Journal, job: str) -> list[record.Attempt]:
    return [a for a in record.merge(record.read_lines(journal.folder)) if a.job != job]


def begin(argv: Sequence[str], log: str, environ: Mapping[str, str], client: SlurmClient) -> int:
    cfg, folder = _resolve(argv, environ)
    job, restart = _identity(environ)
    # Here, not only at submission: slurm/ddp.sbatch takes the options as they come. The node count is what
    # Slurm allocated (fewer than asked once the job went on without bad nodes: M is still at most that).
    first = _first_step(cfg, environ, _trained_on(folder, job))
    size = len(first.nodes) if first is not None else job_size(environ, None)
    check_min_nodes(cfg, size, slurm_env.tasks_per_node(environ))
    taken = taken_over(folder, job)
    if taken is not None:
        # Before srun: its rank 0 would be refused the folder (or, once the other job is gone, resume the
        # other job's checkpoint). Two jobs never take turns on one folder: this one stops, writing nothing.
        say(taken)
        return exitcodes.USAGE
    unwritable = _unwritable(folder)
    if unwritable:
        say(unwritable)
        return exitcodes.FAILED
    journal = supervisor.Journal(store.of_run(folder, cfg.checkpoint_storage))  # its checkpoints: built once
    _close_other_jobs(journal, job, client)
    own = [a for a in journal.history(job) if order(a.restart) < order(restart) and a.ended is None]
    found = lost.ask(client, job) if own else None
    for open_attempt in own:
        # Its batch shell died before its `end` (its node failed, or it was killed), and the job was requeued
        # by Slurm or by a `submit --wait` that did not record it (hpc_ddp.launch.slurm.lost).
        assert found is not None
        closed = lost.close(journal, open_attempt, found, _budgets(cfg))
        say(closed.line)
        if closed.decision.action == outcomes.STOP:
            say(f"job {job} stops here: {closed.decision.message}")
            return exitcodes.FAILED
    _note_start(folder, job, restart, log, first.nodes if first is not None else ())
    # The script evals this: the strategy's malloc settings for every task of the job (hpc_ddp.cluster.allocator).
    print(allocator.exports(environ, cfg.strategy), end="", flush=True)
    if first is not None:
        # The script evals this: its srun starts the first step on these nodes (hpc_ddp.launch.slurm.inplace).
        per_node = slurm_env.tasks_per_node(environ) or 1
        print(steps.first_step(first.nodes, per_node, job), end="", flush=True)
        say(
            f"--spare-nodes {cfg.spare_nodes}: the step runs on {','.join(first.nodes)}; "
            f"spare(s) {','.join(first.spares) or 'none'}"
        )
    # The number attempts.jsonl will give this attempt: its place among the folder's attempts, every job's.
    everyone = record.merge(record.read_lines(folder))
    known = record.find(everyone, job, restart)
    number = known.number if known is not None else len(everyone) + 1
    say(
        f"attempt {number} of job {job} (restart {restart}) on {slurm_env.job_nodelist(environ) or '?'}; run "
        f"folder {folder.absolute()}"
    )
    return exitcodes.OK


def _trained_on(folder: Path, job: str) -> int | None:
    """How many nodes this job's latest attempt trained on (None before its first): a requeued job with
    spares keeps that size, whatever spares its new allocation still holds."""
    started = [a for a in record.of_job(record.read(folder), job) if a.nodes]
    return len(started[-1].nodes) if started else None


def _first_step(
    cfg: TrainConfig, environ: Mapping[str, str], size: int | None = None
) -> spares.Placement | None:
    """The first step's nodes in a job with spares (None without): every node of the allocation but
    --spare-nodes of them (or `size` of them: what the job trained on before a requeue), the batch shell's own
    kept as a spare."""
    if cfg.spare_nodes <= 0:
        return None
    if slurm_env.tasks_per_node(environ) is None:
        raise UsageError(
            f"--spare-nodes {cfg.spare_nodes}: the job has no --ntasks-per-node, so a step on fewer nodes than "
            "the allocation could not say how many tasks to run. Fix: submit with --ntasks-per-node (one "
            "task per GPU)"
        )
    allocation = steps.allocation(environ)
    if len(allocation) <= cfg.spare_nodes:
        say(
            f"--spare-nodes {cfg.spare_nodes}: the allocation has {len(allocation)} node(s) "
            f"({','.join(allocation)}), no more than its spares: the step runs on all of them, no spare left"
        )
    held = len(allocation) - size if size is not None and 0 < size <= len(allocation) else cfg.spare_nodes
    return spares.first(allocation, held, steps.batch_host(environ))


def _note_start(folder: Path, job: str, restart: int, log: str, nodes: Sequence[str] = ()) -> None:
    """When this attempt began and where its srun lines start in the batch log, for `end` (exits/<job>-<r>/
    batch.json). Not in a folder that does not exist yet: the tasks create it on a first start, and `end` then
    goes by rank 0's start record. Advisory: a folder that refuses it is judged by `end`."""
    if not folder.is_dir():
        return
    offset = 0
    if log:
        try:
            offset = os.path.getsize(log)
        except OSError:
            offset = 0
    where = exits.attempt_folder(folder, job, restart)
    try:
        where.mkdir(parents=True, exist_ok=True)
        run_folder.atomic_write_bytes(
            where / STATE,
            json.dumps({"began": time.time(), "log": log, "offset": offset, "nodes": list(nodes)}).encode(),
        )
    except OSError:
        pass


def _unwritable(folder: Path) -> str:
    """'' when the run folder can be written (or does not exist yet: the tasks create it), else the one line
    that says it cannot and what to do. A folder that turned read-only (a file system remounted after an
    error) fails every start the same way: the job stops instead of being requeued to fail again."""
    if not folder.is_dir():
        return ""
    error = run_folder.write_test(folder, f".write-test-batch-{os.getpid()}")
    if not error:
        return ""
    return (
        f"run folder {folder} cannot be written ({error}): nothing can be saved or recorded there, and every "
        "attempt would fail the same way, so the job stops (not requeued). Fix the file system or its "
        "permissions, then run the same command again to resume from its latest checkpoint"
    )


def taken_over(folder: Path, job: str) -> str | None:
    """Why this job must not use `folder` any more, or None: another job holds it now (its run.lock), or began
    an attempt in it after this job's last one (a rerun while this job waited for its requeue: it resumed this
    job's checkpoint and trains on from there). The line to say; this job then stops and writes nothing there."""
    holder = other_job(folder, job)
    if holder is not None:
        owner = f"job {holder}" if holder else "another run"
        return (
            f"run folder {folder} is held by {owner}: this job recorded nothing there and stops (a usage "
            "error, not retried). Fix: give this job its own --folder"
        )
    newer = after_this_job(record.merge(record.read_lines(folder)), job)
    if newer is None:
        return None
    return (
        f"run folder {folder} was taken over by job {newer} since this job's last attempt (the same command, "
        "run again while this job waited to start again): two jobs never take turns on one folder, so this job "
        f"stops here and records nothing; job {newer}'s run is the one that goes on"
    )


def after_this_job(history: Sequence[record.Attempt], job: str) -> str | None:
    """The other job that began an attempt after this job's last one began, if any (pure)."""
    mine = [a.started or 0 for a in history if a.job == job]
    if not mine:
        return None  # a new job in a folder others used before: it continues their run
    since = max(mine)
    later = [a for a in history if a.job != job and (a.started or 0) > since]
    return later[0].job if later else None


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
    return slurm_env.job_size(environ) or max(info.num_nodes if info else 0, 1)


def slurm_requeued(info: JobInfo | None, restart: int) -> bool:
    """Slurm requeued the job itself (a node failure, `scontrol requeue`, PreemptMode=REQUEUE): the job is on
    its way back to pending, or has been restarted more often than this attempt's restart count (pure)."""
    if info is None or info.gone:
        return False
    return info.state.kind.waiting or info.restarts > restart


def end(argv: Sequence[str], status: int, log: str, environ: Mapping[str, str], client: SlurmClient) -> int:
    """Judge the step srun ran and act; in a job with spares (--spare-nodes), a failure that would be requeued
    starts the next step here instead, inside the allocation, and that step is judged in turn
    (hpc_ddp.launch.slurm.inplace)."""
    lines: Sequence[str] | None = None
    ran_on: tuple[str, ...] = ()
    try:
        while True:
            result = _end_step(argv, status, log, environ, client, lines, ran_on)
            if isinstance(result, int):
                return result
            args = steps.step_args(environ) or []
            per_node = slurm_env.tasks_per_node(environ) or 1
            ran = steps.run(result.placement.nodes, result.number, args, per_node, environ)
            environ, status, lines, ran_on = ran.environ, ran.status, ran.lines, result.placement.nodes
    finally:
        steps.remove_step_files(environ)


@dataclass(frozen=True)
class _Step:
    """What `end` read about a step that ended (`_read_step`): the judge's evidence and what it acts on."""

    evidence: judge.Evidence | judge.Ending  # an Ending: Slurm requeued the job with every node up
    info: JobInfo | None  # the controller's view of the job
    requeued: bool  # Slurm requeued the job itself
    by_rank0: bool  # rank 0 decided about a preemption and requeued itself (--requeue-by scontrol)
    nodes: list[str]  # the step's nodes


def _end_step(
    argv: Sequence[str],
    status: int,
    log: str,
    environ: Mapping[str, str],
    client: SlurmClient,
    given: Sequence[str] | None = None,
    ran_on: Sequence[str] = (),
) -> int | inplace.Next:
    """One step's end: its record, and the exit code of the batch shell, or the next step to start in place.
    `given`: srun's lines of a step this process ran (else the batch log's, from where `begin` noted);
    `ran_on`: that step's nodes."""
    cfg, folder = _resolve(argv, environ)
    folder = _told_folder(environ) or folder
    try:  # the tasks may have ended before rank 0 made it (srun could not start them, a usage error)
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        say(f"cannot record this attempt in {folder} ({e.strerror or e}); exiting as srun did ({status})")
        return status
    job, restart = _identity(environ)
    taken = taken_over(folder, job) if status != exitcodes.OK else None
    if taken is not None:
        # Rank 0 was refused the folder (it exited 2): not this job's record to write, nor its checkpoint.
        say(taken)
        return exitcodes.USAGE
    state = _read_state(folder, job, restart)
    journal = supervisor.Journal(store.of_run(folder, cfg.checkpoint_storage))  # its checkpoints: built once
    this = record.find(journal.history(job), job, restart)
    began = float(state.get("began") or (this.started if this else 0) or 0)
    step = _read_step(folder, job, restart, status, state, this, began, log, environ, client, given, ran_on)
    info, requeued = step.info, step.requeued
    size = job_size(environ, info)
    rule = min_nodes.smaller(cfg, environ, journal.checkpoints)
    placed: list[spares.Placement] = []

    def adjust(this: record.Attempt, decision: rules.Decision) -> rules.Decision:
        # Inside the allocation first (--spare-nodes): a spare in place of the blamed node, or fewer nodes
        # (--min-nodes); else today's requeue, checked against the partition's usable nodes.
        if not requeued and info is not None and steps.step_args(environ) is not None:
            decision, placement = inplace.plan(
                decision,
                this.outcome,
                cfg.spare_nodes,
                info.nodes,
                step.nodes,
                info.batch_host or steps.batch_host(environ),
                rule,
                this.signature,
                this.node,
            )
            if placement is not None:
                placed.append(placement)
                return decision
        return _fits(client, decision, info, size, rule, cfg.wait_for_nodes, cfg.spare_nodes)

    closed = supervisor.end_attempt(
        journal,
        job,
        restart,
        step.evidence,
        _budgets(cfg),
        began=began,
        checkpoint=supervisor.latest_step(journal.checkpoints),
        adjust=adjust,
        exclude=lambda decision: _excluded(decision, info),
        nodes=step.nodes,
    )
    return _act(closed, journal, step, placed, environ, client, status)


def _read_step(
    folder: Path,
    job: str,
    restart: int,
    status: int,
    state: dict[str, Any],
    this: record.Attempt | None,
    began: float,
    log: str,
    environ: Mapping[str, str],
    client: SlurmClient,
    given: Sequence[str] | None,
    ran_on: Sequence[str],
) -> _Step:
    """What the step left and what Slurm says of it, as the judge's evidence (see the module docstring)."""
    info = client.job(job)
    slurm_run = requeues(restart)  # Slurm's number of this run: a restart in place is a step of the same one
    requeued = slurm_requeued(info, slurm_run)
    nodes = (
        list(ran_on)
        or (list(this.nodes) if this else [])
        or list(state.get("nodes") or ())
        or list(hosts(slurm_env.job_nodelist(environ)))
    )
    lines = list(given) if given is not None else _srun_lines(state, log)
    said = parse.srun_node_failures(lines)
    failed = status != exitcodes.OK
    gone = lost.lost_nodes(nodes, said, info, client.nodes(), slurm_run) if failed else ()
    # Slurm requeued the job itself: accounting says whether a node failure ended this run (the node may be
    # back already: a live slurmd returns at once, ReturnToService=2), or a requeue with every node up.
    run = lost.run_of(client.history(job), slurm_run) if failed and requeued else None
    node_fail = bool(gone) or (run is not None and run.end is End.NODE_FAILURE)
    # This attempt's own preemption record only: an older one (kept for the user) is no decision about it.
    preempted = preemption.read_since(folder, began) if status == exitcodes.PREEMPTED else None
    by_rank0 = preempted is not None and preempted.mode == "scontrol"  # rank 0 decided and requeued itself
    usage = failed and first_exit(lines) == exitcodes.USAGE
    evidence = judge.Evidence(
        code=exitcodes.USAGE if usage else status,
        rank_nodes=this.ranks if this else (),
        notes=tuple(exits.read(folder, job, restart)),
        verdict=hang_verdict.read(folder, since=began) if began else None,
        killed=srun_deaths(lines),
        ends=parse.srun_task_ends(lines),
        requeue=preempted.requeue if preempted else None,
        rank0_requeued=(bool(preempted.requeued) if by_rank0 and preempted else None),
        lost=gone,
        node_fail=node_fail,
        refused=srun_refusal(lines) if failed else "",
        unwritable=_unwritable(folder) if failed else "",
    )
    found = judge.requeued_by_scheduler(status, requeued, node_fail) or evidence
    return _Step(found, info, requeued, by_rank0, nodes)


def _act(
    closed: supervisor.Closed,
    journal: supervisor.Journal,
    step: _Step,
    placed: Sequence[spares.Placement],
    environ: Mapping[str, str],
    client: SlurmClient,
    status: int,
) -> int | inplace.Next:
    """Say the attempt's end and do what was decided: done, the next step in place, a requeue, or a stop."""
    folder, job, restart = journal.folder, closed.attempt.job, closed.attempt.restart
    this, decision, ending = closed.attempt, closed.decision, closed.ending
    if this.outcome == outcomes.HANG:
        say(f"{this.reason}; every rank's report: {hang_verdict.path(folder)}")
    say(closed.line + (" (Slurm requeued the job itself)" if step.requeued else ""))
    if not journal.flush():
        say(journal.lost())
    if decision.action == outcomes.DONE:
        return exitcodes.OK
    if decision.action == outcomes.RESTART and placed:
        number = in_place(restart) + 1
        following = restart_count({**environ, IN_PLACE: str(number)})
        _note_start(folder, job, following, "", placed[0].nodes)
        return inplace.Next(placed[0], number)
    if decision.action == outcomes.REQUEUE:
        # Rank 0 requeued the job itself after an agreed save (--requeue-by scontrol): nothing left to do here.
        resize = min_nodes.size(decision, environ)
        requeued, info = step.requeued, step.info
        code = (
            _requeue(client, job, this.exclude, info, requeued, resize) if not step.by_rank0 else exitcodes.OK
        )
        return status if code == exitcodes.OK else code  # a requeued job's shell ends as its tasks did
    _stop(job, ending, decision, journal.history(job))
    if step.requeued:
        _cancel(client, job)
    return outcomes.exit_code(this.outcome)


def _cancel(client: SlurmClient, job: str) -> None:
    """A stop decision ends the job whoever requeued it: Slurm requeued this one already (a node failure,
    `scontrol requeue`), and left alone it would run again, or pend forever when it no longer fits. Cancelled,
    not held: a held job pends forever too (only quieter), and `--wait` would follow it for good; a cancelled
    one is over, and attempts.jsonl keeps why. The cancel ends this shell: SIGTERM is blocked until then."""
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP))
    done = client.cancel(job)
    say(
        f"cancelled job {job}: Slurm had requeued it, and it stops here"
        if done.ok
        else f"scancel {job} failed ({done.message}): cancel it yourself (scancel {job}), or it may run again"
    )


def _budgets(cfg: TrainConfig) -> supervisor.Budgets:
    return supervisor.Budgets(cfg.max_restarts, cfg.max_requeue, outcomes.REQUEUE)


def _excluded(decision: rules.Decision, info: JobInfo | None) -> tuple[str, ...]:
    return min_nodes.excluded(decision, info.excluded if info else ())


def _fits(
    client: SlurmClient,
    decision: rules.Decision,
    info: JobInfo | None,
    needed: int,
    rule: min_nodes.Smaller = min_nodes.EVERY_NODE,
    wait: bool = False,
    spares: int = 0,
) -> rules.Decision:
    """min_nodes.fit, with the partition's nodes as sinfo has them now (asked only for a requeue that
    excludes nodes)."""
    if decision.action != outcomes.REQUEUE or not _excluded(decision, info):
        return decision
    partition = info.partition if info else ""
    states = client.nodes(partition)
    return min_nodes.fit(
        decision, states, info.excluded if info else (), partition, needed, rule, wait, spares
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
    job: str, ending: judge.Ending, decision: rules.Decision, history: Sequence[record.Attempt]
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
