"""The kit's side of a Slurm job (Slurm itself is asked through hpc_ddp.scheduler.slurm): `submitter` submits
the job and defines what each task runs (`TaskEntry`); `start` starts each task with the preemption signals
blocked; `batch` holds the batch shell's steps around srun; `lost` closes the attempts whose batch shell died;
`min_nodes` says whether a requeued job still fits; `follow` is `submit --wait`, `outcome` its final word."""
