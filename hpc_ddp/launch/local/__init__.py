"""The local launcher: N emulated nodes x T tasks on this machine, each task given what `srun` would give it.

    srun_env    the job (LocalJob) and each rank's environment (child_environ): the emulated srun step of
                hpc_ddp.scheduler.local (slurm_env, nodelist, fresh_job_id)
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

from __future__ import annotations

import importlib
from typing import Any

# Each name is imported from its module when first used, not here: `python -m hpc_ddp.launch.local.forkserver`
# imports this package first, and a package that imported its own `forkserver` already would make runpy warn
# on every local run ("found in sys.modules after import of package ..."): the server would run a second copy.
_WHERE = {
    "Console": f"{__name__}.console",
    "Launcher": f"{__name__}.launcher",
    "gpu_count": f"{__name__}.run",
    "run_local": f"{__name__}.run",
    "LocalJob": f"{__name__}.srun_env",
    "child_environ": f"{__name__}.srun_env",
    "fresh_job_id": "hpc_ddp.scheduler.local",
    "nodelist": "hpc_ddp.scheduler.local",
    "slurm_env": "hpc_ddp.scheduler.local",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
