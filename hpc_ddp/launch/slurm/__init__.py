"""Slurm: `request` turns flags into an sbatch request and reads Slurm's answers (pure functions);
`submitter` submits the job with submitit, follows it, and defines what each task runs (`TaskEntry`)."""
