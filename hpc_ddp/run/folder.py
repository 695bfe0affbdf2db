"""The run folder, in one place: its layout, where it goes by default, the check that it can be written, how
files in it are written (atomically), and the preemption record the launchers read.

    <folder>/checkpoints/     ckpt-<step>.pt and `latest` (hpc_ddp.run.checkpoint)
    <folder>/model.pth        the final weights
    <folder>/metrics.jsonl    rank 0's progress records (hpc_ddp.run.metrics)
    <folder>/run.json         what ran, with which settings and versions (hpc_ddp.run.record)
    <folder>/logs/            per-rank output of a local run (hpc_ddp.launch.local)
    <folder>/preempted.json   after a preemption, the decision all ranks agreed on
    <folder>/submitit/        a Slurm submission's job files (hpc_ddp.launch.slurm.submitter)

The folder is on storage every node sees: the tasks, the launcher that restarts them and the batch script that
requeues them all find each other's files here. No torch: launchers and `--help` paths import this.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from hpc_ddp.dist.env import FOLDER_FILE_VAR
from hpc_ddp.errors import UsageError

CHECKPOINTS = "checkpoints"
MODEL = "model.pth"
METRICS = "metrics.jsonl"
RUN_RECORD = "run.json"
LOGS = "logs"
PREEMPTED = "preempted.json"
SUBMITIT = "submitit"



# ----- where the folder is when --folder is not given -------------------------------------------------------

def default_for_task(job_id: str | None) -> Path:
    """runs/<job id>, relative to the task's working directory: every task of a job, and the job after a
    requeue, land in the same folder. A process outside any job gets runs/single-<pid>."""
    return Path("runs", job_id or f"single-{os.getpid()}")


def default_for_local_run(job_id: str) -> Path:
    """runs/local-<fake job id>: a local run's tasks are told its path, so they never fall back to theirs."""
    return Path("runs", f"local-{job_id}")


def default_for_submission(job_name: str, now: float | None = None) -> Path:
    """runs/<job name>-<timestamp>, absolute: chosen when the job is submitted, so a requeued run (the same
    pickled command) comes back to it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs", f"{job_name}-{stamp}").absolute()


# ----- can it be written? ---------------------------------------------------------------------------------

def write_test(folder: Path, name: str) -> str:
    """Write (and remove) the file `name` in `folder`: '' if that worked, else why not. A real write, since
    os.access() says yes to root for any directory, a read-only mount or sysfs included."""
    probe = folder / name
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return ""


def prepare(folder: Path, private: bool = False) -> None:
    """Create the run folder and prove it is writable, before anyone depends on it (UsageError if not).

    `private`: owner-only (mode 0700), and a folder that others can write is refused: submitit unpickles, and
    so runs, what is in a submission's folder."""
    fix = "Fix: --folder a directory on shared storage that you can write"
    try:
        folder.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"run folder {folder} is not writable ({e.strerror or e}). {fix}") from None
    if private:
        mode = folder.stat().st_mode
        if mode & 0o022:
            raise UsageError(f"run folder {folder} is writable by others (mode {mode & 0o777:o}); submitit loads "
                             f"and runs pickles from it. Fix: chmod go-w {folder}, or use another --folder")
    error = write_test(folder, f".write-test-{os.getpid()}")
    if error:
        raise UsageError(f"run folder {folder} is not writable ({error}). {fix}")


# ----- atomic writes ------------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry, not only the file's data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> int:
    """Let `write` fill a temporary file next to `path`, make it durable, then rename it into place: readers
    see the old file or the whole new one, never a part, whenever the writer dies. Returns the file's size."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    atomic_write(path, lambda f: f.write(data))


# ----- the preemption record ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Preempted:
    """What rank 0 writes to preempted.json after the agreed save of a preemption.

    Read by the local launcher (restart?), `submit --wait` (did the ranks save?) and slurm/ddp.sbatch, which
    greps the JSON text for `"requeue": true` and `"mode": "exit"`: keep the keys and their spelling."""

    requeue: bool  # the agreed decision: start the run again
    signal: str  # the signal that stopped it (SIGUSR2, SIGTERM, ...)
    mode: str  # "scontrol": rank 0 requeued the job itself; "exit": the launcher or batch script must


def write_preempted(folder: Path, record: Preempted) -> None:
    atomic_write_bytes(folder / PREEMPTED, (json.dumps(asdict(record)) + "\n").encode())


def read_preempted(folder: Path) -> Preempted | None:
    """The record of the last preemption, or None (none, or unreadable: then nobody restarts anything)."""
    try:
        data = json.loads((folder / PREEMPTED).read_text())
        return Preempted(bool(data["requeue"]), str(data.get("signal", "")), str(data.get("mode", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_preempted(folder: Path) -> None:
    """Forget an earlier preemption before the ranks start (the local launcher, at each start)."""
    (folder / PREEMPTED).unlink(missing_ok=True)


def preempted_since(folder: Path, since: float) -> bool:
    """Did the ranks save after a preemption since `since` (a time.time())?"""
    try:
        return (folder / PREEMPTED).stat().st_mtime >= since
    except OSError:
        return False


def tell_folder(folder: Path, environ: Mapping[str, str]) -> None:
    """Write the run folder's absolute path to the file named by $HPC_DDP_FOLDER_FILE, if set (global rank 0).

    slurm/ddp.sbatch names a file on its own node (rank 0 runs on the step's first node, the batch host) and
    after srun returns reads it to find `<folder>/preempted.json`: the folder as the task resolved it (its
    --folder or runs/<job id>, from the task's working directory), whatever the script's arguments say.
    """
    path = environ.get(FOLDER_FILE_VAR)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(f"{folder.absolute()}\n")
    except OSError as e:  # costs only the batch script's requeue after a preemption: not worth failing the run
        print(f"warning: cannot write the run folder to {FOLDER_FILE_VAR}={path} ({e.strerror or e}): the batch "
              "script will not requeue this job after a preemption", file=sys.stderr, flush=True)
