"""Kept only so that jobs submitted by hpc_ddp 0.1.0 still run after an upgrade.

submitit pickles the function a job runs into `<folder>/submitit/<job id>_submitted.pkl`, and a pickle names
classes by module: a job submitted by 0.1.0 (pending, or requeued after a preemption) unpickles
`hpc_ddp.slurm_job.TaskEntry` when it starts. That class now lives in `hpc_ddp.launch.slurm.submitter`; this
alias makes the old name load the new class. Nothing in hpc_ddp imports this module.
"""

from hpc_ddp.launch.slurm.submitter import TaskEntry

__all__ = ["TaskEntry"]
