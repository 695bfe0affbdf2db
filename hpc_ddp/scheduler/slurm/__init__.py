"""Slurm, the kit's first scheduler: `client` (every command: the scheduler interface and the supervisors'
questions), `parse` (one parser per command's output, srun's lines included), `states` (the one table of job
and node states), `env` (the job's variables), `request` (flags to sbatch options, sbatch's refusals in one
line), `runtime` (which python, container and srun options the tasks run with), `submit` (submitit: the
script and the submission, built once), `steps` (a step started on given nodes of the allocation: srun's
variables and host file, for --spare-nodes)."""
