"""One training task: `python -m hpc_ddp.train [training options]`.

Runs the same way under `srun` (one task per GPU), under torchrun, under `submit --local`, or alone:

    srun python -m hpc_ddp.train --epochs 10 --folder /shared/runs/exp1
    torchrun --nproc-per-node 4 -m hpc_ddp.train --folder runs/exp1
    python -m hpc_ddp.train                     # a single process

Order matters: signal handlers first (a preemption signal can come before torch is even imported), then the
cheap checks (flags, environment), then torch, placement, the process group, and training.

The run folder is held by one run at a time (`hold_folder`, `run.lock`), and a start changes nothing in it
until everything has been checked: the task, the checkpoint it resumes, every option (`resume.plan` looks,
`resume.apply` changes; `run.json` is written last, only by a start that trains).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from hpc_ddp import exitcodes, preemption
from hpc_ddp.config import TrainConfig, add_train_arguments, build_parser, from_namespace
from hpc_ddp.errors import UsageError, run_task

if TYPE_CHECKING:  # imported lazily at run time: torch costs seconds, and --help must not wait for it
    import torch

    from hpc_ddp.cluster import DistEnv
    from hpc_ddp.log import RankLog
    from hpc_ddp.loop import Outcome

PROG = "python -m hpc_ddp.train"
T = TypeVar("T")
LOCK_NAME = "run.lock"
LOCK_VAR = "HPC_DDP_FOLDER_LOCK"  # the local launcher holds the folder for its ranks; their rank 0 inherits it
LOCK_HEARTBEAT_S = 10.0  # the holder refreshes the lock's mtime this often
LOCK_STALE_S = 60.0  # a lock from another machine not refreshed for this long: its holder is gone


def default_folder(job_id: str | None) -> str:
    """runs/<job id>: every task of a job, and the job after a requeue, land in the same folder."""
    return os.path.join("runs", job_id or f"single-{os.getpid()}")


def prepare_folder(folder: Path) -> None:
    """Create the run folder and prove it is writable (rank 0, before anyone depends on it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"run folder {folder} is not writable ({e.strerror or e}). Fix: --folder a directory on "
                         "shared storage that you can write") from None


class FolderLock:
    """One run at a time in a run folder: `<folder>/run.lock`, created with O_EXCL by the run's global rank 0 (or
    by the local launcher, whose rank 0 inherits it through $HPC_DDP_FOLDER_LOCK).

    Why a lock file and not flock/fcntl: O_CREAT|O_EXCL is atomic on every shared file system (NFSv3+, Lustre,
    GPFS, BeeGFS), while POSIX locks depend on the mount (Lustre's `localflock` grants them per node, silently)
    and a dead node's lock may outlive it. It dies with its holder: removed when the run ends (any way Python
    ends it); a holder killed outright is recognised as gone at once on the same machine (its pid, with the
    process start time against pid reuse, in the same pid namespace of the same boot), and from another
    machine once the lock's mtime, refreshed every LOCK_HEARTBEAT_S by a thread of the holder, is LOCK_STALE_S
    old, measured by the file system's clock (a file written next to it), not the nodes' clocks. A requeued
    job (same job id, higher SLURM_RESTART_COUNT) takes over its own previous lock at once.
    """

    def __init__(self, path: Path, record: dict[str, Any], owned: bool) -> None:
        self.path, self.record, self.owned = path, record, owned
        self.token = str(record.get("token"))
        self._stop = threading.Event()
        if owned:
            threading.Thread(target=self._beat, name="hpc_ddp-folder-lock", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                if (_read_lock(self.path) or {}).get("token") != self.token:
                    print(f"warning: {self.path} was taken over by another run; this run no longer holds its "
                          "folder", file=sys.stderr, flush=True)
                    return
                os.utime(self.path)
            except OSError:  # a file server hiccup: the next beat tries again
                pass

    def release(self) -> None:
        self._stop.set()
        if self.owned and (_read_lock(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)


def hold_folder(folder: Path, role: str, job_id: str | None, restarts: int,
                inherited: str | None = None) -> FolderLock:
    """Take `folder` for this run, or raise UsageError naming the run that holds it (see FolderLock)."""
    path = folder / LOCK_NAME
    me = {"token": uuid.uuid4().hex, "role": role, "job_id": job_id, "restarts": restarts,
          "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_ticks(os.getpid()),
          "boot_id": _boot_id(), "pid_ns": _pid_ns(), "since": round(time.time(), 3), "argv": sys.argv[1:]}
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is not None and inherited and holder.get("token") == inherited:
                return FolderLock(path, holder, owned=False)
            gone = _holder_gone(path, holder, me)
            if gone is None:
                raise UsageError(_held_message(folder, path, holder)) from None
            if _break_lock(path, holder):
                print(f"warning: took over {path}: {gone}", file=sys.stderr, flush=True)
            continue
        except OSError as e:
            raise UsageError(f"cannot create {path} ({e.strerror or e}). Fix: --folder a directory you can "
                             "write") from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return FolderLock(path, me, owned=True)
    raise UsageError(f"{path} changed hands 5 times while this run tried to take it: more than one run is starting "
                     "in this folder. Fix: start one run per --folder")


def _read_lock(path: Path) -> dict[str, Any] | None:
    """The holder's record; None if there is no readable one (gone, or being written right now)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None if there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _lock_age(path: Path) -> float:
    """Seconds since the lock was last refreshed, by the file system's clock (which sets both mtimes)."""
    probe = path.with_name(f".{LOCK_NAME}.clock-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        probe.write_bytes(b"")
        now = probe.stat().st_mtime
    finally:
        probe.unlink(missing_ok=True)
    return now - path.stat().st_mtime


def _holder_gone(path: Path, holder: dict[str, Any] | None, me: dict[str, Any]) -> str | None:
    """Why the lock's holder is known to be gone, or None while it may be alive."""
    try:
        age = _lock_age(path)
    except FileNotFoundError:
        return "it was released meanwhile"
    if holder is None:
        return f"an unreadable lock, not refreshed for {age:.0f} s" if age > LOCK_STALE_S else None
    if holder.get("job_id") and holder.get("job_id") == me["job_id"] and \
            int(holder.get("restarts") or 0) < me["restarts"]:
        return f"job {me['job_id']} was restarted (restart {me['restarts']}); the lock was its previous run's"
    if me["boot_id"] and holder.get("boot_id") == me["boot_id"] and holder.get("pid_ns") == me["pid_ns"]:
        alive = holder.get("pid_start") is not None and _start_ticks(int(holder.get("pid", -1))) == holder["pid_start"]
        return None if alive else f"its holder, pid {holder.get('pid')} on this machine, is gone"
    if age > LOCK_STALE_S:
        return (f"its holder on {holder.get('host')} has not refreshed it for {age:.0f} s (every "
                f"{LOCK_HEARTBEAT_S:g} s while it runs)")
    return None


def _break_lock(path: Path, holder: dict[str, Any] | None) -> bool:
    """Remove the lock judged gone, unless it changed hands meanwhile (then it is put back)."""
    aside = path.with_name(f".{LOCK_NAME}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _read_lock(aside) == holder:
        aside.unlink(missing_ok=True)
        return True
    try:
        os.link(aside, path)  # another run took it between our look and the rename: give it back
    except OSError:
        pass
    aside.unlink(missing_ok=True)
    return False


def _held_message(folder: Path, path: Path, holder: dict[str, Any] | None) -> str:
    if holder is None:
        return (f"run folder {folder} is being taken by another run ({path} is being written). Fix: start one run "
                "per --folder")
    job = holder.get("job_id")
    role = "the local launcher" if holder.get("role") == "launcher" else "rank 0"
    who = f"{role} of job {job}" if job else f"{role} of another run"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since") or 0)))
    try:
        refreshed = f", refreshed {_lock_age(path):.0f} s ago"
    except OSError:
        refreshed = ""
    stop = f"stop it (scancel {job}, or Ctrl-C its launcher)" if job else "stop it"
    return (f"run folder {folder} is in use by {who} (pid {holder.get('pid')} on {holder.get('host')}, since "
            f"{since}{refreshed}; {path}). Two runs in one folder overwrite each other's checkpoints and records. "
            f"Fix: wait for it to end or {stop}, or use another --folder")


def main(argv: list[str] | None = None) -> int:
    preemption.install()
    parser = build_parser(PROG, __doc__ or "")
    add_train_arguments(parser)
    cfg = from_namespace(parser.parse_args(argv))
    code = run(cfg, os.environ)
    preemption.ignore()  # done: the checkpoint and model are written; nothing left for a signal to save
    return code


def cli() -> NoReturn:
    """The `hpc-ddp-train` console script: `python -m hpc_ddp.train`, usage errors as one line and exit 2."""
    run_task(PROG, main)


def run(cfg: TrainConfig, environ: Mapping[str, str]) -> int:
    """Detect, place, join, train, save; returns the exit code (exitcodes.OK or PREEMPTED)."""
    from hpc_ddp import cluster

    env = cluster.detect(environ)
    folder = Path(cfg.folder or default_folder(env.job_id))
    cfg = cfg.with_folder(str(folder))
    lock = None
    if env.is_main:
        # Before torch (seconds) and the rendezvous: a bad --folder, or a folder another run holds, is a
        # one-line error at once. Only rank 0 writes there; the other ranks are stopped by their launcher (srun
        # --kill-on-bad-exit, torchrun).
        prepare_folder(folder)
        lock = hold_folder(folder, "rank0", env.job_id, int(environ.get("SLURM_RESTART_COUNT") or 0),
                           environ.get(LOCK_VAR))
        preemption.tell_folder(folder, environ)  # where slurm/ddp.sbatch finds preempted.json
    try:
        return _run_holding(cfg, env, folder, environ)
    finally:
        if lock is not None:
            lock.release()


def _run_holding(cfg: TrainConfig, env: DistEnv, folder: Path, environ: Mapping[str, str]) -> int:
    import torch

    from hpc_ddp import placement
    from hpc_ddp.log import RankLog
    from hpc_ddp.process_group import process_group

    log = RankLog(env.rank)
    os.environ.update(env.torch_env())  # what user code and libraries expect from torchrun
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    device = placement.select_device(env.local_rank, env.local_world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plan = placement.plan_cpus(placement.current_affinity(), env.local_rank, env.local_world_size, environ)
    placement.apply_cpu_plan(plan)
    if env.is_main:
        for override in env.overrides:
            log.info(f"using {override} from the environment")
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if environ.get(var):
                log.info(f"using {var}={environ[var]} from the environment")
    with process_group(env, device, cfg.backend or None, cfg.timeout_s) as backend:
        log.info(f"Process {env.rank} initialized on {socket.gethostname()} (node {env.node_rank}, "
                 f"local rank {env.local_rank}, {device}, {backend}, {plan.threads} threads; "
                 f"world size {env.world_size})")
        code = _train(cfg, env, device, folder, log, environ)
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

    from hpc_ddp import placement

    mine = (env.rank, env.node_rank, placement.gpu_uuid(device))
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    clashes = placement.shared_gpus(everyone)
    if clashes:
        node, ranks, uuid = clashes[0]
        raise UsageError(f"ranks {ranks} on node {node} share one GPU ({uuid}). Each rank needs its own GPU: check "
                         "--gpus-per-node vs --ntasks-per-node, and CUDA_VISIBLE_DEVICES / --gpu-bind")


def _check_in_sync(model: torch.nn.Module, env: DistEnv, log: RankLog) -> None:
    """DDP keeps replicas equal only if every rank applies the same update; prove it once at the end.
    Bitwise-equal parameters give bitwise-equal float64 sums, so two numbers per rank are enough."""
    import torch
    import torch.distributed as dist

    from hpc_ddp.errors import NonFinite

    with torch.no_grad():
        flat = [p.detach().double() for p in model.parameters()]
        mine = (sum(float(t.sum()) for t in flat), sum(float((t * t).sum()) for t in flat))
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    # NaN equals nothing, itself included: non-finite weights are their own finding, not a difference.
    broken = [r for r, fp in enumerate(everyone) if not all(math.isfinite(x) for x in fp)]
    if broken:
        raise NonFinite(f"the weights are not finite at the end of training (ranks {broken}): model.pth was not "
                        "written. Fix: a smaller --lr or --clip-grad, then resume from the last good checkpoint")
    differing = [r for r, fp in enumerate(everyone) if fp != everyone[0]]
    if differing and env.is_main:
        log.warn(f"parameters differ between rank 0 and ranks {differing} at the end of training")
    elif not differing:
        log.main(f"Parameters identical on all {env.world_size} ranks")


def _train(cfg: TrainConfig, env: DistEnv, device: torch.device, folder: Path, log: RankLog,
           environ: Mapping[str, str]) -> int:
    import torch
    import torch.distributed as dist

    from hpc_ddp import checkpoint, resume, tasks
    from hpc_ddp.loop import Trainer

    if device.type == "cuda":
        _check_gpus(env, device)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    task = tasks.build(cfg)  # the user's code and --task are checked before anything in the folder changes
    plan = _rank0(env, lambda: resume.plan(cfg, folder, environ, log.warn))  # looks; changes nothing
    start = plan.start
    # Leaving the block closes the trainer on every path, errors included: the checkpoint in flight is
    # durable and DDP, whose Reducer holds the process group, is gone before the group is destroyed.
    with Trainer(cfg, env, device, task, folder, log) as trainer:
        if start is not None:
            trainer.restore(checkpoint.load(start, verify=False), start)  # rank 0 verified it in plan()
            if trainer.finished():
                _rank0(env, lambda: _finished_already(trainer, folder, log))
                return exitcodes.OK
        # Everything is checked: only now does this start change the folder, and record itself.
        _rank0(env, lambda: _take_folder(cfg, env, folder, plan, log))
        for note in trainer.notes:
            log.main(note)
        if start is not None:
            log.main(f"Resuming from {start} at epoch {trainer.pos.epoch}, step {trainer.pos.step}")
        outcome = trainer.run()
        if not outcome.finished:
            log.main(f"{preemption.signal_name()}: every rank stopped at step {trainer.pos.step}; saving a "
                     "checkpoint")
        signals = preemption.count()
        trainer.save(final=True)  # rank 0 waits until the checkpoint is durable
        if preemption.count() > signals and env.is_main:
            log.info("another signal came during the save: noted, the save went on to the end")
        trainer.metrics.end(trainer.pos)
    if outcome.finished:
        _check_in_sync(trainer.model, env, log)
        if env.is_main:
            model_path = folder / "model.pth"
            checkpoint.atomic_save(checkpoint.to_cpu(trainer.model.state_dict()), model_path)
            log.info(f"Model saved by rank 0 to {model_path}")
        dist.barrier()
        return exitcodes.OK
    return _preempted(cfg, env, folder, log, environ, outcome)


def _take_folder(cfg: TrainConfig, env: DistEnv, folder: Path, plan: Any, log: RankLog) -> None:
    """Rank 0, once the start is fully checked: tidy, apply the resume plan, write run.json."""
    from hpc_ddp import checkpoint, resume, runinfo

    checkpoint.remove_stale_temporaries(folder)  # a previous run killed mid-save; never promoted
    resume.apply(plan, folder, log.info)
    runinfo.write(folder, cfg.as_dict(), env.__dict__, os.getcwd())


def _finished_already(trainer: Any, folder: Path, log: RankLog) -> None:
    """Rank 0: a rerun of a finished run trains nothing and writes nothing (but a missing model.pth)."""
    from hpc_ddp import checkpoint

    cfg, pos = trainer.cfg, trainer.pos
    limits = f"--epochs {cfg.epochs}" + (f" --max-steps {cfg.max_steps}" if cfg.max_steps else "")
    model_path = folder / "model.pth"
    if not model_path.is_file():
        checkpoint.atomic_save(checkpoint.to_cpu(trainer.model.state_dict()), model_path)
        log.info(f"model.pth was missing: written from the final checkpoint to {model_path}")
    log.info(f"The run in {folder} already finished at epoch {pos.epoch}, step {pos.step} ({limits}): nothing to "
             "train, nothing written. To train further, raise --epochs or --max-steps; to start over, use "
             "another --folder or --resume never --overwrite")


def _preempted(cfg: TrainConfig, env: DistEnv, folder: Path, log: RankLog, environ: Mapping[str, str],
               outcome: Outcome) -> int:
    """After the agreed save: every rank is past it (barrier), then rank 0 requeues or reports."""
    import json

    import torch.distributed as dist

    from hpc_ddp import checkpoint

    dist.barrier()  # a requeue makes Slurm SIGTERM every task: all must be past the save first
    if env.is_main:
        decision = preemption.decide(outcome.requeue_votes, outcome.stop_votes, environ, cfg.max_requeue)
        mode = preemption.requeue_mode(environ, env.launcher)
        # The launcher (local run) or a batch script reads this to decide whether to start the job again.
        record = {"requeue": decision.requeue, "signal": preemption.signal_name(), "mode": mode}
        checkpoint.atomic_write_bytes(folder / "preempted.json", (json.dumps(record) + "\n").encode())
        log.info(f"{preemption.signal_name()}: {decision.message}")
        if decision.requeue and mode == "scontrol" and env.job_id:
            error = preemption.scontrol_requeue(env.job_id)
            log.info(f"requeued job {env.job_id}" if error is None else
                     f"scontrol requeue {env.job_id} failed: {error}; exiting {exitcodes.PREEMPTED} instead")
    # Nobody exits before rank 0 has requeued: under `srun --kill-on-bad-exit=1` the first task to exit
    # PREEMPTED (non-zero) gets the whole step killed, rank 0 included, maybe before its scontrol call.
    dist.barrier()
    return exitcodes.PREEMPTED


if __name__ == "__main__":
    cli()
