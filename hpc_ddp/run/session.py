"""What one task of a job does, from its options to its exit code: detect, place, join, train, save.

`run(cfg, environ)` is `python -m hpc_ddp.train` without the command line. The order matters: the cheap
checks first (environment, run folder), then torch, placement, the process group, and training inside it.
Every rank runs the same code; where only global rank 0 may act (the run folder's files, the choice of the
checkpoint to resume from, the requeue), it acts alone and every rank learns the outcome through a
collective, so no rank ever waits for an answer that will not come.

The run folder is held by one run at a time (`folder.hold_folder`, `run.lock`), and a start changes nothing in
it until everything has been checked: the task, the checkpoint it resumes, every option (`resume.plan` looks,
`resume.apply` changes; `run.json` is written last, only by a start that trains).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hpc_ddp import exitcodes, scheduler
from hpc_ddp.cluster.env import DistEnv, detect
from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import attempts, exits, files, rules
from hpc_ddp.ledger import preemption as preemption_record
from hpc_ddp.log import RankLog, count
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop import preemption
from hpc_ddp.run.loop.position import epochs_done
from hpc_ddp.run.watch.beacon import FINISHING, STARTUP, USER_CODE, Beacon, publish

if TYPE_CHECKING:  # imported lazily at run time: torch costs seconds, and a usage error must not wait for it
    import torch

    from hpc_ddp.run.checkpoint.store import CheckpointStore
    from hpc_ddp.run.loop.position import Outcome
    from hpc_ddp.run.loop.trainer import Trainer

T = TypeVar("T")


def run(cfg: TrainConfig, environ: Mapping[str, str]) -> int:
    """Detect, place, join, train, save; returns the exit code (exitcodes.OK or PREEMPTED)."""
    env = detect(environ, socket.gethostname())
    folder = Path(cfg.folder) if cfg.folder else run_folder.default_for_task(env.job_id)
    cfg = cfg.with_folder(str(folder))
    lock = None
    if env.is_main:
        # Before torch (seconds) and the rendezvous: a bad --folder, or a folder another run holds, is a
        # one-line error at once. Only rank 0 writes there; the other ranks are stopped by their launcher (srun
        # --kill-on-bad-exit, torchrun).
        warn = RankLog(env.rank).warn  # a full disk is waited out for a while, and said
        run_folder.prepare(folder, warn=warn)
        lock = run_folder.hold_folder(
            folder, "rank0", env.job_id, env.restart, environ.get(run_folder.LOCK_VAR), warn
        )
        run_folder.tell_folder(folder, environ)  # where slurm/ddp.sbatch finds preempted.json
    try:
        return _run_holding(cfg, env, folder, environ)
    except BaseException as e:
        _note(folder, env, e)  # unless written already, before the process group went (_run_holding)
        raise
    finally:
        exits.release(
            folder, env.job_id or "", env.restart, env.rank, _slot(env)
        )  # its note's space, if unused
        if lock is not None:
            lock.release()


def _slot(env: DistEnv) -> exits.Slot:
    """Where this rank's exit note has its space: its node's file, a slot per local rank (hpc_ddp.ledger.exits)."""
    return (env.node_rank, env.local_rank, env.local_world_size)


def _note(folder: Path, env: DistEnv, error: BaseException) -> None:
    """For the supervisor (local launcher, batch shell): which error came first, on which node. Once per error.
    A usage error too once training started (rank 0's alone, a tracker's refusal at the first step, while the
    others wait in a collective and fail on it); before, a refused start writes nothing in the folder. Never in
    a folder another job holds (this job's rank 0 was refused it, and this rank failed for that reason); never
    for Ctrl-C or an exit asked for."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or getattr(error, _NOTED, False):
        return
    job = env.job_id or ""
    if isinstance(error, UsageError) and not exits.reserved(folder, job, env.restart, env.rank, _slot(env)):
        return
    holder = run_folder.holder_job(folder) if folder.is_dir() else None
    if folder.is_dir() and not (holder and env.job_id and holder != env.job_id):
        exits.note(folder, job, env.restart, env.rank, env.node, error, _slot(env))
    with contextlib.suppress(AttributeError):  # an exception type that takes no attribute: noted again later
        setattr(error, _NOTED, True)


_NOTED = "_hpc_ddp_noted"  # set on an exception once its exit note is written


def _run_holding(cfg: TrainConfig, env: DistEnv, folder: Path, environ: Mapping[str, str]) -> int:
    from hpc_ddp.run import quiet, startup

    quiet.install()  # one line per warning, from the imports on (run/quiet.py)
    startup.import_torch()  # the first import of torch in this rank: most of its start-up (run/startup.py)

    from hpc_ddp.cluster import placement
    from hpc_ddp.cluster.group import nccl_defaults, process_group

    log = RankLog(env.rank)
    os.environ.update(env.torch_env())  # what user code and libraries expect from torchrun
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    device, plan = placement.place(env.local_rank, env.local_world_size, environ)
    if env.is_main:
        for override in env.overrides:
            log.info(f"using {override} from the environment")
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if environ.get(var):
                log.info(f"using {var}={environ[var]} from the environment")
    if device.type == "cuda":
        nccl = nccl_defaults(environ, str(folder))
        os.makedirs(os.path.join(folder, "nccl-trace"), exist_ok=True)
        os.environ.update(nccl)  # read by torch when the NCCL group is created, just below
        if env.is_main and nccl:
            log.info(f"NCCL settings (unless set): {' '.join(f'{k}={v}' for k, v in nccl.items())}")
    with process_group(env, device, cfg.backend or None, cfg.timeout_s) as backend:
        log.info(
            f"Process {env.rank} initialized on {socket.gethostname()} (node {env.node_rank}, "
            f"local rank {env.local_rank}, {device}, {backend}, {count(plan.threads, 'thread')}; "
            f"world size {env.world_size})"
        )
        try:
            code = _train(cfg, env, device, folder, log, environ)
        except BaseException as e:
            # Before the group goes: the peers waiting in a collective fail on this rank only once it has, so
            # this note comes before theirs, and the supervisor names this rank's error as the first cause.
            _note(folder, env, e)
            raise
    log.info("Process group destroyed")
    return code


def _rank0(env: DistEnv, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and give every rank its result. Any error on rank 0 is raised on every rank at
    once: the others would otherwise wait in the broadcast until the collective timeout."""
    import torch.distributed as dist

    box: list[Any] = [None]
    error: BaseException | None = None
    if env.is_main:
        try:
            box[0] = ("ok", fn())
        except Exception as e:
            # The exception itself may not pickle: the others get its kind and text, rank 0 raises the original.
            error = e
            box[0] = ("usage" if isinstance(e, UsageError) else "error", f"{type(e).__name__}: {e}", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, value, *text = box[0]
    if error is not None:
        raise error
    if kind == "usage":
        raise UsageError(text[0])
    if kind == "error":
        raise RuntimeError(f"rank 0 failed ({value}); see rank 0's log for its traceback")
    return value  # type: ignore[no-any-return]


def _check_gpus(env: DistEnv, device: torch.device) -> None:
    """Fail fast if two ranks of one node hold the same physical GPU (wrong binding, duplicate indices)."""
    import torch.distributed as dist

    from hpc_ddp.cluster import placement

    mine = (env.rank, env.node_rank, placement.gpu_uuid(device))
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    clashes = placement.shared_gpus(everyone)
    if clashes:
        node, ranks, uuid = clashes[0]
        raise UsageError(
            f"ranks {ranks} on node {node} share one GPU ({uuid}). Each rank needs its own GPU: check "
            "--gpus-per-node vs --ntasks-per-node, and CUDA_VISIBLE_DEVICES / --gpu-bind"
        )


def _train(
    cfg: TrainConfig,
    env: DistEnv,
    device: torch.device,
    folder: Path,
    log: RankLog,
    environ: Mapping[str, str],
) -> int:
    import torch

    from hpc_ddp.run import tasks
    from hpc_ddp.run.checkpoint import resume, store
    from hpc_ddp.run.loop import rng
    from hpc_ddp.run.loop.trainer import Trainer
    from hpc_ddp.run.snapshot import recover

    if device.type == "cuda":
        _check_gpus(env, device)
    rng.seed(cfg.seed)  # every generator; the same initial weights on every rank (DDP broadcasts rank 0's)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    beacon = Beacon()
    publish(beacon)  # user code may ask where the loop is (hpc_ddp.run.watch.beacon.current)
    beacon.set(USER_CODE)  # the task's build function is the user's: a hang there is named as such
    task = tasks.build(cfg)  # the user's code and --task are checked before anything in the folder changes
    # The run's checkpoints and their storage (--checkpoint-storage), built once: every reader gets this one.
    checkpoints = store.of_run(folder, cfg.checkpoint_storage)
    plan = _rank0(env, lambda: resume.plan(cfg, checkpoints, environ, log.warn))  # looks; changes nothing
    asked_grad_accum = cfg.grad_accum
    # --allow-resize: another world size, and the --grad-accum that keeps the global batch.
    cfg, resized = resume.resize(cfg, plan.start, env.world_size, checkpoints.storage)
    # Leaving the block closes the trainer on every path, errors included: the checkpoint in flight is
    # durable and DDP, whose Reducer holds the process group, is gone before the group is destroyed. The
    # watchdog is stopped first, and covers everything up to then: training, saves, the final barriers.
    with (
        Trainer(
            cfg, env, device, task, log, checkpoints, beacon=beacon, asked_grad_accum=asked_grad_accum
        ) as trainer,
        _watchdog(cfg, env, folder, log, trainer, environ),
    ):
        beacon.set(STARTUP)  # the user's setup is done; the kit resumes and prepares the folder (rank 0)
        # A restart with --snapshot-every-steps: from memory when a snapshot is newer (hpc_ddp.run.snapshot).
        memory = recover.resume(trainer, plan.start)
        if plan.start is not None and not (memory is not None and memory.source == "memory"):
            trainer.resume_from(plan.start)  # rank 0 verified it in plan()
            if trainer.finished():
                return _finished(trainer, env, folder, log)
        _begin(trainer, env, folder, log, environ, plan, resized, memory)
        preemption.arm()  # from here on a stop signal is saved for at the next agreed step
        trainer.callbacks.start(trainer.pos.step, trainer.pos.epoch)  # the task's (hpc_ddp.run.callbacks)
        outcome = trainer.run()
        return _end(trainer, outcome, env, folder, log, environ)


def _finished(trainer: Trainer, env: DistEnv, folder: Path, log: RankLog) -> int:
    """A rerun of a finished run: nothing to train; a missing model.pth is written from the final checkpoint."""
    trainer.beacon.set(FINISHING)
    model_path = folder / run_folder.MODEL
    if _rank0(env, lambda: not trainer.checkpointer.store.storage.isfile(str(model_path))):
        _write_model(trainer, env, model_path, log)
        log.main(f"model.pth was missing: written from the final checkpoint to {model_path}")
    _rank0(env, lambda: _finished_already(trainer, folder, log))
    return exitcodes.OK


def _begin(
    trainer: Trainer,
    env: DistEnv,
    folder: Path,
    log: RankLog,
    environ: Mapping[str, str],
    plan: Any,
    resized: Any,
    memory: Any = None,
) -> None:
    """Everything is checked: only now does this start change the folder, record itself, and say how it starts.
    `memory`: where a restart with snapshots resumed from (hpc_ddp.run.snapshot.recover.Resumed)."""
    from hpc_ddp.run.checkpoint import exact

    start = plan.start
    from_memory = memory is not None and memory.source == "memory"
    if resized is not None and resized.saved != resized.now:
        trainer.not_exact.append(exact.RESIZED)
    # what cannot resume bit for bit, said before training (hpc_ddp.run.checkpoint.exact)
    if trainer.not_exact:
        log.main(f"not bitwise resumable: {'; '.join(trainer.not_exact)}")
    _rank0(
        env, lambda: _take_folder(trainer.cfg, env, trainer.checkpointer.store, plan, log, trainer.not_exact)
    )
    # Every rank, in the folder rank 0 now holds for this attempt: the space of its exit note, which a disk
    # that fills during training must not lose (hpc_ddp.ledger.exits).
    exits.reserve(folder, env.job_id or "", env.restart, env.rank, _slot(env))
    resumed = start is not None or from_memory
    _record_start(env, folder, environ, trainer.pos.step if resumed else None, trainer.cfg.requeue_by)
    for note in trainer.notes:
        log.main(note)
    if from_memory:
        log.main(memory.describe())
    elif start is not None:
        log.main(f"Resuming from {start} at epoch {trainer.pos.epoch}, step {trainer.pos.step}")
    if resized is not None:
        log.main(resized.describe())
    trainer.metrics.start(
        trainer.pos,
        env.job_id or "",
        env.restart,
        resumed,
        env.world_size,
        _since_process_start(),
        resized.record() if resized is not None else None,
    )
    if memory is not None:
        trainer.metrics.event("resume", memory.record())  # which it resumed from, how many steps were lost


def _end(
    trainer: Trainer, outcome: Outcome, env: DistEnv, folder: Path, log: RankLog, environ: Mapping[str, str]
) -> int:
    """After training, every rank: the final save (a preemption's too), then model.pth or the requeue's facts."""
    import torch.distributed as dist

    beacon = trainer.beacon
    beacon.set(FINISHING)
    if not outcome.finished:
        log.main(
            f"{preemption.signal_name()}: every rank stopped at step {trainer.pos.step}; saving a checkpoint"
        )
    signals = preemption.count()
    trainer.strategy.trained()  # what only steps use goes first: the final save and model.pth are the peak
    trainer.save(final=True)  # rank 0 waits until the checkpoint is durable
    if trainer.snapshots is not None:  # saved to disk: the snapshots in memory go (hpc_ddp.run.snapshot)
        trainer.metrics.event("snapshots", trainer.snapshots.finish())
    beacon.set(FINISHING)
    if preemption.count() > signals and env.is_main:
        log.info("another signal came during the save: noted, the save went on to the end")
    trainer.metrics.end(trainer.pos)
    if not outcome.finished:
        return _preempted(trainer.cfg, env, folder, log, environ, outcome, trainer.pos.step)
    trainer.callbacks.call("on_train_end", trainer.pos.step, trainer.pos.epoch)  # finished, finally saved
    trainer.strategy.check_in_sync(log)
    _write_model(trainer, env, folder / run_folder.MODEL, log)
    log.main(f"Model saved by rank 0 to {folder / run_folder.MODEL}")
    dist.barrier()
    return exitcodes.OK


def _since_process_start() -> float:
    """Seconds since this process was created (the kernel's clock of it, so the interpreter's start counts)."""
    import time

    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def _take_folder(
    cfg: TrainConfig,
    env: DistEnv,
    checkpoints: CheckpointStore,
    plan: Any,
    log: RankLog,
    not_exact: list[str],
) -> None:
    """Rank 0, once the start is fully checked: tidy, apply the resume plan, write run.json."""
    from hpc_ddp.run import configfile
    from hpc_ddp.run.checkpoint import resume, store
    from hpc_ddp.run.records import record

    folder = checkpoints.folder
    # A previous run killed mid-save left them; they were never promoted.
    store.remove_stale_temporaries(folder, checkpoints.storage)
    resume.apply(plan, checkpoints, log.info)
    # A full disk at start is waited out (a restart may come while it still is): hpc_ddp.ledger.files.
    record_ = functools.partial(record.write, folder, cfg.as_dict(), env.__dict__, os.getcwd(), not_exact)
    _patiently(record_, str(folder / run_folder.RUN_RECORD), log)
    configfile.save(folder, cfg)  # the resolved options, for --config


def _record_start(
    env: DistEnv, folder: Path, environ: Mapping[str, str], resumed_from: int | None, requeue_by: str
) -> None:
    """This attempt starts training: rank 0 appends it to attempts.jsonl with the node of every rank (what
    the supervisor blames when a rank fails without a word: killed by a signal, hung). A record that cannot be
    written (a full disk) costs the record, not the run: the supervisor judges the attempt all the same."""
    import torch.distributed as dist

    nodes: list[Any] = [None] * env.world_size
    dist.all_gather_object(nodes, env.node)
    if env.is_main:
        # The step's nodes as its scheduler lists them (in a job with spare nodes, --spare-nodes, the
        # allocation holds more than the step runs on), else the nodes its ranks run on.
        job_nodes = list(scheduler.for_task(requeue_by).identity(environ).nodes or dict.fromkeys(nodes))
        start = functools.partial(
            attempts.record_start, folder, env.job_id or "", env.restart, job_nodes, nodes, resumed_from
        )
        try:
            files.patiently(start, str(attempts.path(folder)), RankLog(env.rank).warn)
        except OSError as e:
            RankLog(env.rank).warn(
                f"cannot record this attempt's start in {attempts.path(folder)} ({e.strerror or e}); "
                "training goes on"
            )


def _write_model(trainer: Any, env: DistEnv, path: Path, log: RankLog) -> None:
    """A collective: `model.pth`, the plain state dict of the bare model (loadable with weights_only), and its
    checksum, written by rank 0 through the run's storage. Sharded state (fsdp): exported by the run's format
    from the newest checkpoint, which holds these very weights (the final save, or the finished run's last), a
    batch of tensors at a time for the sharded one, so that no rank ever holds the whole model; otherwise the
    strategy's full state, gathered into rank 0's CPU memory. A full disk is waited out for the retry window."""
    from hpc_ddp.run.checkpoint import content, formats, store, torchfile

    checkpoints = trainer.checkpointer.store
    if trainer.strategy.shards_state:
        step = trainer.pos.step

        def export() -> None:
            latest = checkpoints.latest()
            if latest is None or store.ckpt_step(latest) != step:  # a bug, not the user's: say what was found
                raise RuntimeError(
                    f"model.pth: the newest checkpoint is {latest}, not the one of step {step}"
                )
            fmt = formats.format_of(latest, checkpoints.storage, type(trainer.checkpointer.format))
            # Written and checksummed by this run moments ago.
            _patiently(lambda: fmt.export(latest, path, checkpoints.storage, verify=False), str(path), log)

        _rank0(env, export)
        return
    weights = trainer.strategy.full_model_state()  # a collective: every rank, rank 0 gets them
    if weights is not None:
        state = content.to_cpu(weights)  # rank 0 only: the others got None
        _patiently(lambda: torchfile.atomic_save(state, path, checkpoints.storage), str(path), log)


def _patiently(write: Callable[[], Any], what: str, log: RankLog) -> None:
    """Rank 0: a write that must happen, retried while the disk is full (hpc_ddp.ledger.files.patiently); a
    disk still full after the retry window stops the run with one line (DiskFull), never a usage error."""
    from hpc_ddp.errors import DiskFull

    try:
        files.patiently(write, what, log.warn)
    except OSError as e:
        if not files.is_full(e):
            raise
        raise DiskFull(
            f"cannot write {what}: {e.strerror or e}, still after waiting {files.window_s():g} s for space. "
            "Fix: free space (or quota) there, then run the same command"
        ) from e


def _finished_already(trainer: Any, folder: Path, log: RankLog) -> None:
    """Rank 0: a rerun of a finished run trains nothing and writes nothing (but a missing model.pth)."""
    cfg, pos = trainer.cfg, trainer.pos
    limits = f"--epochs {cfg.epochs}" + (f" --max-steps {cfg.max_steps}" if cfg.max_steps else "")
    epoch = epochs_done(pos, trainer.batches_per_epoch)  # as its end said it: "ranks ended at epoch 50"
    if pos.stopped:
        log.info(
            f"The run in {folder} already finished at epoch {epoch}, step {pos.step}: a callback stopped it "
            "(hpc_ddp.Callback, state.request_stop()). Nothing to train, nothing written. To start over, use "
            "another --folder or --resume never --overwrite"
        )
        return
    log.info(
        f"The run in {folder} already finished at epoch {epoch}, step {pos.step} ({limits}): nothing to "
        "train, nothing written. To train further, raise --epochs or --max-steps; to start over, use "
        "another --folder or --resume never --overwrite"
    )


def _watchdog(
    cfg: TrainConfig, env: DistEnv, folder: Path, log: RankLog, trainer: Trainer, environ: Mapping[str, str]
) -> contextlib.AbstractContextManager[object]:
    """The hang watchdog for this rank (run/watch/watchdog.py), or nothing with --hang-timeout-s 0."""
    from hpc_ddp.run.watch.watchdog import Identity, Watchdog

    setting = cfg.hang_setting()
    if setting == 0:
        return contextlib.nullcontext()
    # The same on every rank, new for every start of the job: a requeued run's reports never mix with the last.
    run_id = f"{env.job_id or 'pid' + str(trainer.peers[0][1])}-{env.restart}"
    who = Identity(env.rank, env.world_size, socket.gethostname(), tuple(trainer.peers), run_id)
    # Under a supervisor of the kit (the local launcher, a kit batch script) the supervisor prints the verdict's
    # line, once; elsewhere (torchrun, a plain srun) the rank that decided it does.
    announce = preemption.supervisor(cfg.requeue_by, environ) is None
    return Watchdog(
        trainer.beacon,
        who,
        folder,
        setting,
        cfg.timeout_s,
        lambda: trainer.metrics.step_times[-100:],
        log.info if announce else None,
    )


def _preempted(
    cfg: TrainConfig,
    env: DistEnv,
    folder: Path,
    log: RankLog,
    environ: Mapping[str, str],
    outcome: Outcome,
    step: int,
) -> int:
    """After the agreed save: every rank is past it (barrier), then rank 0 writes the facts for the supervisor
    (preempted.json) or, with no supervisor of the kit to decide, decides and requeues itself (scontrol)."""
    import torch.distributed as dist

    dist.barrier()  # a requeue makes Slurm SIGTERM every task: all must be past the save first
    if env.is_main:
        _preemption_facts(cfg, env, folder, log, environ, outcome, step)
    # Nobody exits before rank 0 has requeued: under `srun --kill-on-bad-exit=1` the first task to exit
    # PREEMPTED (non-zero) gets the whole step killed, rank 0 included, maybe before its scontrol call.
    dist.barrier()
    return exitcodes.PREEMPTED


def _preemption_facts(
    cfg: TrainConfig,
    env: DistEnv,
    folder: Path,
    log: RankLog,
    environ: Mapping[str, str],
    outcome: Outcome,
    step: int,
) -> None:
    """Rank 0: the preemption record, and the requeue where rank 0 alone decides (hpc_ddp.launch.supervisor
    says who requeues in which situation)."""
    name = preemption.signal_name()
    supervised = preemption.supervisor(cfg.requeue_by, environ)
    mode = preemption.requeue_mode(cfg.requeue_by, env.launcher, supervised == "batch")
    facts = preemption_record.Preempted(
        requeue=outcome.stop_votes == 0,
        signal=name,
        mode=mode,
        step=step,
        requeue_votes=int(outcome.requeue_votes),
        stop_votes=int(outcome.stop_votes),
    )
    if mode != "scontrol":
        # The launcher (local run) or the batch shell reads this and decides, within --max-requeue.
        _patiently(lambda: preemption_record.write(folder, facts), "preempted.json", log)
        who = {"launcher": "the launcher", "batch": "the batch script"}.get(supervised or "", "its launcher")
        log.info(
            f"{name}: stopped by SIGTERM: checkpoint saved, not requeued"
            if outcome.stop_votes
            else f"{name}: preempted: checkpoint saved at step {step}; {who} decides whether to start it "
            f"again (--max-requeue {cfg.max_requeue})"
        )
        return
    # No supervisor of the kit: rank 0 decides alone, and applies --max-requeue itself.
    preempted = rules.preemptions(attempts.of_job(attempts.read(folder), env.job_id or ""))
    decision = preemption.decide(outcome.requeue_votes, outcome.stop_votes, preempted, cfg.max_requeue)
    # Written before the requeue, which SIGTERMs every task of the job.
    decided = replace(facts, requeued=decision.requeue)
    _patiently(lambda: preemption_record.write(folder, decided), "preempted.json", log)
    log.info(f"{name}: {decision.message}")
    if decision.requeue and env.job_id:
        done = scheduler.for_task(cfg.requeue_by).requeue(env.job_id)
        if done.ok:
            log.info(done.message)
        else:
            preemption_record.write(folder, replace(facts, requeued=False))
            log.info(
                f"scontrol requeue {env.job_id} failed: {done.message}; exiting {exitcodes.PREEMPTED} instead"
            )
