"""The run folder, in one place: its layout, where it goes by default, the check that it can be written, and
the lock that keeps it to one run at a time. What ranks and supervisors leave for each other there
(attempts.jsonl, exits/, preempted.json, hang.json) is the ledger's (hpc_ddp.ledger).

    <folder>/checkpoints/     ckpt-<step>.pt and `latest` (hpc_ddp.run.checkpoint)
    <folder>/model.pth        the final weights
    <folder>/metrics.jsonl    rank 0's progress records (hpc_ddp.run.records.metrics)
    <folder>/step.json        the last step rank 0 finished, rewritten every step (hpc_ddp.run.records.metrics)
    <folder>/tb/              --tensorboard: rank 0's event files and logged.json (hpc_ddp.run.records.tblog)
    <folder>/run.json         what ran, with which settings and versions (hpc_ddp.run.records.record)
    <folder>/config.toml      the resolved training options, for --config (hpc_ddp.run.configfile)
    <folder>/logs/            per-rank output of a local run (hpc_ddp.launch.local)
    <folder>/preempted.json   after a preemption, what the ranks agreed on (hpc_ddp.ledger.preemption)
    <folder>/attempts.jsonl   every attempt's start and end, and what came next (hpc_ddp.ledger.attempts)
    <folder>/exits/           what each rank that raised left for its supervisor (hpc_ddp.ledger.exits)
    <folder>/hang.json        the hang watchdog's verdict (hpc_ddp.ledger.verdict)
    <folder>/submitit/        a Slurm submission's job files (hpc_ddp.launch.slurm.submitter)
    <folder>/run.lock         held by the one run that uses the folder now (`hold_folder`)

The folder is on storage every node sees: the tasks, the launcher that restarts them and the batch script that
requeues them all find each other's files here. No torch: launchers and `--help` paths import this.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp.cluster.env import order
from hpc_ddp.errors import DiskFull, UsageError
from hpc_ddp.ledger import files

# The atomic writes live in the ledger (below this layer, which also writes with them); the run folder's own
# files are written with them too: hpc_ddp.run.folder.atomic_write is the same function.
from hpc_ddp.ledger.files import atomic_write as atomic_write
from hpc_ddp.ledger.files import atomic_write_bytes as atomic_write_bytes
from hpc_ddp.ledger.files import fsync_dir as fsync_dir
from hpc_ddp.variables import FOLDER_FILE, FOLDER_LOCK

CHECKPOINTS = "checkpoints"
MODEL = "model.pth"
METRICS = "metrics.jsonl"
REACHED = "step.json"
TENSORBOARD = "tb"  # --tensorboard: rank 0's event files (hpc_ddp.run.records.tblog)
RUN_RECORD = "run.json"
CONFIG_FILE = "config.toml"  # the resolved training options, for --config (hpc_ddp.run.configfile)
LOGS = "logs"
SWEEP_RECORD = "sweep.json"  # in a sweep's folder, above its trials' run folders (hpc_ddp.launch.sweep.state)
SUBMITIT = "submitit"
LOCK_NAME = "run.lock"
LOCK_VAR = FOLDER_LOCK  # the local launcher holds the folder for its ranks; their rank 0 inherits it
LOCK_HEARTBEAT_S = 10.0  # the holder refreshes the lock's mtime this often
LOCK_STALE_S = 60.0  # a lock from another machine not refreshed for this long: its holder is gone


# ----- where the folder is when --folder is not given -------------------------------------------------------


def default_for_task(job_id: str | None) -> Path:
    """runs/<job id>, relative to the task's working directory: every task of a job, and the job after a
    requeue, land in the same folder. A process outside any job gets runs/single-<pid>."""
    return Path("runs", job_id or f"single-{os.getpid()}")


def default_for_local_run(task: str) -> Path:
    """runs/<task>, relative to where the launcher runs (`mytasks:build` -> runs/mytasks-build): the same command
    comes back to the same folder and resumes there (a run with other MUST_MATCH options is refused there by
    the launcher, hpc_ddp.launch.local.run). The ranks are told its path, so they never fall back to theirs."""
    return Path("runs", re.sub(r"[^A-Za-z0-9._-]+", "-", task).strip("-.") or "task")


def default_for_local_check(job_id: str) -> Path:
    """runs/doctor-<fake job id>: a doctor run (`submit --local --doctor`) trains nothing to come back to."""
    return Path("runs", f"doctor-{job_id}")


def default_for_submission(job_name: str, task: str) -> Path:
    """runs/<job name>-<task>, absolute (`hpc_ddp`, `mytasks:build` -> runs/hpc_ddp-mytasks-build): the same
    `submit` command comes back to it and resumes there, as `--local`'s runs/<task> does; a requeued run (the
    same pickled command) too. Apart from the local run's folder: a Slurm job's world size is another."""
    return Path("runs", f"{job_name}-{default_for_local_run(task).name}").absolute()


def default_for_submitted_check(job_name: str, now: float | None = None) -> Path:
    """runs/doctor-<job name>-<timestamp>, absolute: a doctor job (`submit --doctor`) trains nothing to come
    back to."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs", f"doctor-{job_name}-{stamp}").absolute()


# ----- can it be written? ---------------------------------------------------------------------------------


def write_test(folder: Path, name: str) -> str:
    """Write (and remove) the file `name` in `folder`: '' if that worked, else why not. A real write, since
    os.access() says yes to root for any directory, a read-only mount or sysfs included."""
    try:
        _probe(folder / name)
    except OSError as e:
        return e.strerror or str(e)
    return ""


def _probe(probe: Path) -> None:
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError:
        try:  # created, then its write failed (a full disk): not left behind
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def prepare(folder: Path, private: bool = False, warn: Callable[[str], None] | None = None) -> None:
    """Create the run folder and prove it is writable, before anyone depends on it (UsageError if not).

    A full disk is no usage error: it is waited out for the retry window (`warn` hears it once), and a disk
    still full then is DiskFull (a failure, retried like one; the same command works once there is space).

    `private`: owner-only (mode 0700), and a folder that others can write is refused: submitit unpickles, and
    so runs, what is in a submission's folder."""
    fix = "Fix: --folder a directory on shared storage that you can write"
    try:
        files.patiently(
            lambda: folder.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True),
            f"run folder {folder}",
            warn,
        )
    except OSError as e:
        _refuse(folder, e, fix)
    if private:
        mode = folder.stat().st_mode
        if mode & 0o022:
            raise UsageError(
                f"run folder {folder} is writable by others (mode {mode & 0o777:o}); submitit loads "
                f"and runs pickles from it. Fix: chmod go-w {folder}, or use another --folder"
            )
    try:
        files.patiently(lambda: _probe(folder / f".write-test-{os.getpid()}"), f"run folder {folder}", warn)
    except OSError as e:
        _refuse(folder, e, fix)


def _refuse(folder: Path, error: OSError, fix: str) -> NoReturn:
    if files.is_full(error):
        raise DiskFull(
            f"run folder {folder} cannot be written: {error.strerror or error}, still after waiting "
            f"{files.window_s():g} s for space. Fix: free space (or quota) there, then run the same command"
        ) from None
    raise UsageError(f"run folder {folder} is not writable ({error.strerror or error}). {fix}") from None


# ----- one run at a time ----------------------------------------------------------------------------------


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
            _HELD.add(self)
            threading.Thread(target=self._beat, name="hpc_ddp-folder-lock", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                if (_read_lock(self.path) or {}).get("token") != self.token:
                    print(
                        f"warning: {self.path} was taken over by another run; this run no longer holds its "
                        "folder",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                os.utime(self.path)
            except OSError:  # a file server hiccup: the next beat tries again
                pass

    def release(self) -> None:
        """Remove the lock. Never raises: on a folder that turned read-only it stays, and is known for a dead
        holder's by the next run (its pid, its heartbeat), as a killed holder's is."""
        self._stop.set()
        _HELD.discard(self)
        if self.owned and (_read_lock(self.path) or {}).get("token") == self.token:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass


_HELD: set[FolderLock] = set()  # the locks this process holds (owned, not yet released)


def release_held() -> None:
    """Release every lock this process holds: for a path that leaves with os._exit, which runs no `finally`
    (the hang watchdog). Never raises: the process is on its way out."""
    for lock in list(_HELD):
        try:
            lock.release()
        except OSError:
            pass


def hold_folder(
    folder: Path,
    role: str,
    job_id: str | None,
    restarts: int,
    inherited: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> FolderLock:
    """Take `folder` for this run, or raise UsageError naming the run that holds it (see FolderLock). Its record
    is written patiently (a full disk is waited out: `warn` hears it; DiskFull after the retry window)."""
    path = folder / LOCK_NAME
    me = {
        "token": uuid.uuid4().hex,
        "role": role,
        "job_id": job_id,
        "restarts": restarts,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _start_ticks(os.getpid()),
        "boot_id": _boot_id(),
        "pid_ns": _pid_ns(),
        "since": round(time.time(), 3),
        "argv": sys.argv[1:],
    }
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
            raise UsageError(
                f"cannot create {path} ({e.strerror or e}). Fix: --folder a directory you can write"
            ) from None
        try:
            files.patiently(functools.partial(_fill_lock, fd, me), str(path), warn)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)  # an empty lock would read as another run taking the folder
            _refuse(folder, e, "Fix: --folder a directory you can write")
        os.close(fd)
        return FolderLock(path, me, owned=True)
    raise UsageError(
        f"{path} changed hands 5 times while this run tried to take it: more than one run is starting "
        "in this folder. Fix: start one run per --folder"
    )


def _fill_lock(fd: int, me: dict[str, Any]) -> None:
    """The lock's record, whole (a retry after a full disk starts it again), and durable."""
    data = (json.dumps(me) + "\n").encode()
    os.ftruncate(fd, 0)
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], written)
    os.fsync(fd)


def is_held(folder: Path) -> bool:
    """Whether a run holds `folder` now: its lock is there and the holder is not known to be gone (a lock left by
    a killed run on this machine, or one not refreshed for LOCK_STALE_S, is not a run). Takes nothing over."""
    path = folder / LOCK_NAME  # no lock at all: _holder_gone says "released"
    onlooker = {"job_id": None, "restarts": 0, "boot_id": _boot_id(), "pid_ns": _pid_ns()}
    # Looking writes nothing (the folder may be read-only to the onlooker): the lock's age by this machine's
    # clock, not the file system's.
    return _holder_gone(path, _read_lock(path), onlooker, look_only=True) is None


def holder_job(folder: Path) -> str | None:
    """The job id of the run that holds `folder` now ("" for a run without one, a local run); None when no
    run holds it. A batch step reads it so that a job never writes into another job's run folder."""
    if not is_held(folder):
        return None
    return str((_read_lock(folder / LOCK_NAME) or {}).get("job_id") or "")


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


def _lock_age(path: Path, look_only: bool = False) -> float:
    """Seconds since the lock was last refreshed, by the file system's clock (which sets both mtimes); with
    `look_only`, by this machine's clock, writing nothing."""
    if look_only:
        return time.time() - path.stat().st_mtime
    probe = path.with_name(f".{LOCK_NAME}.clock-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        probe.write_bytes(b"")
        now = probe.stat().st_mtime
    finally:
        probe.unlink(missing_ok=True)
    return now - path.stat().st_mtime


def _holder_gone(
    path: Path, holder: dict[str, Any] | None, me: dict[str, Any], look_only: bool = False
) -> str | None:
    """Why the lock's holder is known to be gone, or None while it may be alive."""
    try:
        age = _lock_age(path, look_only)
    except FileNotFoundError:
        return "it was released meanwhile"
    if holder is None:
        return f"an unreadable lock, not refreshed for {age:.0f} s" if age > LOCK_STALE_S else None
    if (
        holder.get("job_id")
        and holder.get("job_id") == me["job_id"]
        and order(int(holder.get("restarts") or 0)) < order(me["restarts"])  # a requeue, or a step in place
    ):
        return f"job {me['job_id']} was restarted (restart {me['restarts']}); the lock was its previous run's"
    if me["boot_id"] and holder.get("boot_id") == me["boot_id"] and holder.get("pid_ns") == me["pid_ns"]:
        alive = (
            holder.get("pid_start") is not None
            and _start_ticks(int(holder.get("pid", -1))) == holder["pid_start"]
        )
        return None if alive else f"its holder, pid {holder.get('pid')} on this machine, is gone"
    if age > LOCK_STALE_S:
        return (
            f"its holder on {holder.get('host')} has not refreshed it for {age:.0f} s (every "
            f"{LOCK_HEARTBEAT_S:g} s while it runs)"
        )
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
        return (
            f"run folder {folder} is being taken by another run ({path} is being written). Fix: start one run "
            "per --folder"
        )
    job = holder.get("job_id")
    role = "the local launcher" if holder.get("role") == "launcher" else "rank 0"
    who = f"{role} of job {job}" if job else f"{role} of another run"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since") or 0)))
    try:
        refreshed = f", refreshed {_lock_age(path):.0f} s ago"
    except OSError:
        refreshed = ""
    if holder.get("role") == "launcher":  # a local job's id is made up: no scancel knows it
        stop = f"stop it (Ctrl-C its launcher, or kill {holder.get('pid')})"
    elif job and re.fullmatch(r"\d+(?:[_+]\d+)?", str(job)):  # a Slurm job id
        stop = f"stop it (scancel {job})"
    else:
        stop = f"stop it (kill {holder.get('pid')} on {holder.get('host')}, or its launcher)"
    return (
        f"run folder {folder} is in use by {who} (pid {holder.get('pid')} on {holder.get('host')}, since "
        f"{since}{refreshed}; {path}). Two runs in one folder overwrite each other's checkpoints and records. "
        f"Fix: wait for it to end or {stop}, or use another --folder"
    )


def tell_folder(folder: Path, environ: Mapping[str, str]) -> None:
    """Write the run folder's absolute path to the file named by $HPC_DDP_FOLDER_FILE, if set (global rank 0).

    slurm/ddp.sbatch names a file on its own node (rank 0 runs on the step's first node, the batch host) and
    after srun returns reads it to find `<folder>/preempted.json`: the folder as the task resolved it (its
    --folder or runs/<job id>, from the task's working directory), whatever the script's arguments say.
    """
    path = environ.get(FOLDER_FILE)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(f"{folder.absolute()}\n")
    except (
        OSError
    ) as e:  # costs only the batch script's requeue after a preemption: not worth failing the run
        print(
            f"warning: cannot write the run folder to {FOLDER_FILE}={path} ({e.strerror or e}): the batch "
            "script will not requeue this job after a preemption",
            file=sys.stderr,
            flush=True,
        )
