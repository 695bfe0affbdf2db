"""Slurm: `request` turns flags into an sbatch request (pure); `submitter` submits the job with submitit and
defines what each task runs (`TaskEntry`); `client` runs every Slurm command, read by `parse` (one parser per
command) and `states` (the job-state table); `follow` is `submit --wait`, `outcome` its final word; `batch`
holds the batch shell's steps around srun."""
