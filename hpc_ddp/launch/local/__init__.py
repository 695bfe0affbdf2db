"""The local launcher: N emulated nodes x T tasks on this machine, each task given what `srun` would give it.

    srun_env    the emulated srun step: LocalJob, slurm_env, child_environ, nodelist, fresh_job_id
    processes   process control: start with signals held, die with the launcher, signal, stop and kill
    forkserver  training ranks forked from one process that imported torch once (processes.start: fallback)
    console     console pumping: each rank's pipe drained to its log, the one terminal (Console)
    launcher    the Launcher: start, pass signals on, supervise, end each attempt (launch/supervisor), restart
    run         run_local: `python -m hpc_ddp.submit --local`

Every rank is told `--requeue-by launcher` (its fake job id is no Slurm job for scontrol to requeue): after a
preemption it exits PREEMPTED and the launcher starts it again within --max-requeue. The launcher holds the run
folder (`run.lock`, hpc_ddp.run.folder.hold_folder) from before it touches anything there, or says anything,
until its last rank is gone; its rank 0 inherits the lock. A second run in the same folder is refused.
"""

from hpc_ddp.launch.local.console import Console
from hpc_ddp.launch.local.launcher import Launcher
from hpc_ddp.launch.local.run import gpu_count, run_local
from hpc_ddp.launch.local.srun_env import LocalJob, child_environ, fresh_job_id, nodelist, slurm_env

__all__ = [
    "Console",
    "Launcher",
    "LocalJob",
    "child_environ",
    "fresh_job_id",
    "gpu_count",
    "nodelist",
    "run_local",
    "slurm_env",
]
