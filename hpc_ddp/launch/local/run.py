"""`python -m hpc_ddp.submit --local`: take the run folder, and hand the job to the Launcher (the flags are
checked once before, hpc_ddp.launch.options).

Without --folder a training run's folder is its task's (runs/<task>): the same command comes back to it and
resumes, and a run with other MUST_MATCH options is refused there before any rank starts
(hpc_ddp.launch.rerun).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from hpc_ddp.launch.local import processes
from hpc_ddp.launch.local.console import Console
from hpc_ddp.launch.local.launcher import Launcher
from hpc_ddp.launch.local.srun_env import LocalJob
from hpc_ddp.launch.options import LaunchOptions
from hpc_ddp.launch.rerun import refuse_another_run
from hpc_ddp.log import count
from hpc_ddp.proc import run as run_command
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.records import progress
from hpc_ddp.scheduler.local import fresh_job_id
from hpc_ddp.variables import LOCAL_JOB_ID


def gpu_count() -> int:
    """GPUs on this machine, without importing torch (nvidia-smi, else 0)."""
    out = run_command(["nvidia-smi", "-L"], timeout_s=10).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def run_local(launch: LaunchOptions, cfg: TrainConfig, resume_command: str = "") -> int:
    """`python -m hpc_ddp.submit --local`: prepare the run folder, start the ranks here, supervise them.
    `launch` is checked already (hpc_ddp.launch.options); `resume_command` is what the launcher tells the user
    to run to resume, after a stop or a failure."""
    assert launch.local is not None  # options.read gives a local run its local options
    shape, module, local = launch.shape, launch.module, launch.local
    # Said explicitly to every rank: there is no real Slurm job to requeue (its job id is fake), so after a
    # preemption the ranks exit PREEMPTED and this launcher starts them again (see Launcher.run).
    cfg = dataclasses.replace(cfg, requeue_by="launcher")
    # Every line of the launcher goes through this console: one whose reader is gone (`| head`) must not
    # stop the run, nor stall a rank (Console). Started with stdout closed (`>&-`), it says what it has to
    # say on stderr, and nothing else lands on the free descriptors 0-2 (_standard_fds).
    _standard_fds()
    console = Console(sys.stdout if sys.stdout is not None else sys.stderr)
    # Rank 0's stdout is a pipe to this launcher: tell it whether its progress line ends on a terminal.
    extra = {progress.LIVE_VAR: "1" if console.tty else "0"}
    job_id = os.environ.get(LOCAL_JOB_ID) or fresh_job_id()  # a local sweep's trials: distinct ports
    trains = module in processes.HOLDS_SIGNALS
    default = not cfg.folder and trains  # the task's own folder, which the same command comes back to
    if cfg.folder:
        folder = Path(cfg.folder)
    else:
        folder = (
            run_folder.default_for_local_run(cfg.task)
            if trains
            else run_folder.default_for_local_check(job_id)
        )
    if default and not cfg.overwrite:
        refuse_another_run(folder, cfg, f"--task {cfg.task}")
    say = console.line  # a full disk is waited out for a while (hpc_ddp.ledger.files), and said
    run_folder.prepare(folder, warn=lambda m: say(f"[launcher] warning: {m}"))
    # Before anything in the folder changes, and before it says anything: a second run in this folder is
    # refused here, in one line.
    lock = run_folder.hold_folder(
        folder, "launcher", job_id, 0, warn=lambda m: say(f"[launcher] warning: {m}")
    )
    try:
        (folder / run_folder.LOGS).mkdir(exist_ok=True)
        cfg = cfg.with_folder(str(folder))
        if shape.gpus_per_node > 0:
            have = gpu_count()
            if have < shape.nodes * shape.gpus_per_node:
                console.line(
                    f"[launcher] --gpus-per-node {shape.gpus_per_node} x {shape.nodes} nodes asked, this "
                    f"machine has {have} GPU(s): running {shape.tasks_per_node} CPU processes per node with "
                    "gloo instead"
                )
                extra["CUDA_VISIBLE_DEVICES"] = ""
        job = LocalJob(
            nodes=shape.nodes,
            tasks_per_node=shape.tasks_per_node,
            folder=folder,
            train_argv=cfg.to_argv() + list(launch.task_argv),
            max_requeue=cfg.max_requeue,
            checkpoint_storage=cfg.checkpoint_storage,
            max_restarts=cfg.max_restarts if trains else 0,
            records=trains,
            all_ranks=local.all_ranks,
            job_id=job_id,
            module=module,
            extra_env=extra,
            resume_command=resume_command if trains else "",
            spare_nodes=cfg.spare_nodes if trains else 0,
            strategy=cfg.strategy,
            **({} if local.stop_grace_s is None else {"stop_grace_s": local.stop_grace_s}),
        )
        console.line(
            f"[launcher] local job {job_id}: {count(shape.nodes, 'node')} x "
            f"{count(shape.tasks_per_node, 'process', 'processes')}"
            f"{' + ' + count(job.spare_nodes, 'spare node') if job.spare_nodes else ''}, run folder {folder}"
            f"{' (the default for this task: the same command resumes there)' if default else ''}, "
            f"per-rank logs in {folder / run_folder.LOGS}"
        )
        return Launcher(job, console, lock).run()  # which hands the console all it has before it returns
    finally:
        lock.release()


def _standard_fds() -> None:
    """Open /dev/null on whichever of the descriptors 0, 1, 2 this process was started without (`>&-`): else
    the next file opened (a log, the lock) would get that number, and a write meant for the console would land
    in it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # as a standard descriptor is: os.open's are not (PEP 446)
