"""The batch shell's job, read once: its environment and the tasks' options as one typed description (`Job`).

Both steps of the batch shell (hpc_ddp.launch.slurm.batch: `begin` before srun, `end` after it) start by reading
`Job.read(argv, environ)` and decide from its fields; nothing after that reads the raw environment but to hand it
on unchanged to the next srun step (`environ`: a restart in place, hpc_ddp.scheduler.slurm.steps.run). Also the
batch shell's own note of an attempt (exits/<job>-<restart>/batch.json: when it began, where its srun lines start
in the batch log, its nodes), which `begin` writes and `end` reads.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import exits
from hpc_ddp.run import configfile
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig, add_train_arguments, from_namespace
from hpc_ddp.scheduler.slurm import env as slurm_env
from hpc_ddp.scheduler.slurm import steps
from hpc_ddp.scheduler.slurm.parse import JobInfo
from hpc_ddp.variables import FOLDER_FILE

PROG = "python -m hpc_ddp.launch.slurm.batch"
STATE = "batch.json"  # in exits/<job>-<restart>/: when this attempt began, where its srun lines start


@dataclass(frozen=True)
class Job:
    """What the batch shell knows of its job, read once from its environment (`read`)."""

    cfg: TrainConfig  # the tasks' training options
    folder: Path  # the run folder as the tasks resolve it (a relative one from SLURM_WORKING_DIR)
    id: str  # SLURM_JOB_ID
    restart: int  # this attempt's restart count (Slurm's requeues, and the steps in place before it)
    nodelist: str  # SLURM_JOB_NODELIST, as Slurm writes it
    allocation: tuple[str, ...]  # the job's nodes, in Slurm's order
    batch_host: str  # this shell's node
    tasks_per_node: int | None  # --ntasks-per-node (None: the job has none)
    asked: int | None  # the nodes the submission got (SLURM_JOB_NUM_NODES), None when not said
    folder_file: str  # HPC_DDP_FOLDER_FILE: where global rank 0 writes the run folder it resolved
    step_args: tuple[str, ...] | None  # the srun arguments of the script's step (None: no restart in place)
    environ: Mapping[str, str]  # the environment as it came: handed on unchanged to the next srun step

    @classmethod
    def read(cls, argv: Sequence[str], environ: Mapping[str, str]) -> Job:
        cfg, folder = _resolve(argv, environ)
        me = slurm_env.identity(
            environ
        )  # the batch shell is no srun step: the job's count, as its tasks read it
        if not me.job:
            raise UsageError("SLURM_JOB_ID is not set: this runs in a Slurm batch script (slurm/ddp.sbatch)")
        args = steps.step_args(environ)
        return cls(
            cfg=cfg,
            folder=folder,
            id=me.job,
            restart=me.restart,
            nodelist=slurm_env.job_nodelist(environ),
            allocation=steps.allocation(environ),
            batch_host=steps.batch_host(environ),
            tasks_per_node=slurm_env.tasks_per_node(environ),
            asked=slurm_env.job_size(environ),
            folder_file=environ.get(FOLDER_FILE) or "",
            step_args=tuple(args) if args is not None else None,
            environ=environ,
        )

    def stepped(self, environ: Mapping[str, str]) -> Job:
        """This job at the restart in place whose step ran with `environ` (its HPC_DDP_IN_PLACE names it)."""
        return replace(self, restart=slurm_env.identity(environ).restart, environ=environ)

    def size(self, info: JobInfo | None) -> int:
        """How many nodes the job asked for: the batch environment's SLURM_JOB_NUM_NODES (or SLURM_NNODES),
        what the submission got. Slurm's NumNodes only when neither is set: while Slurm requeues a job it is
        COMPLETING, and NumNodes then counts only the nodes still completing (`sbatch -N2 --requeue` with a node
        lost: `JobState=COMPLETING Restarts=1 NumNodes=1`), so a job that no longer fits looked as if it did
        and pended forever (pure)."""
        return self.asked or max(info.num_nodes if info else 0, 1)

    def told_folder(self) -> Path | None:
        """The run folder global rank 0 resolved and wrote to HPC_DDP_FOLDER_FILE (slurm/ddp.sbatch), if any:
        the tasks may resolve it otherwise than these options say (an edited srun line, srun's --chdir)."""
        try:
            text = Path(self.folder_file).read_text().strip()
        except OSError:
            return None
        return Path(text) if text else None


def job_size(environ: Mapping[str, str], info: JobInfo | None) -> int:
    """`Job.size` from an environment alone (pure)."""
    return slurm_env.job_size(environ) or max(info.num_nodes if info else 0, 1)


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


# ----- the batch shell's note of an attempt (batch.json) -------------------------------------------------


def read_state(folder: Path, job: str, restart: int) -> dict[str, Any]:
    try:
        data = json.loads((exits.attempt_folder(folder, job, restart) / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def note_start(folder: Path, job: str, restart: int, log: str, nodes: Sequence[str] = ()) -> None:
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


def srun_lines(state: dict[str, Any], log: str) -> list[str]:
    """srun's own lines of this attempt: the batch log from where `begin` noted it."""
    path = log or state.get("log") or ""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(int(state.get("offset") or 0))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
