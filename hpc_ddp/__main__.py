"""`python -m hpc_ddp` lists the entry points."""

print("""hpc_ddp entry points:
  python -m hpc_ddp.submit --local        run 2 nodes x 2 processes on this machine (gloo, CPU)
  python -m hpc_ddp.submit --nodes 2 ...  submit to Slurm with submitit (--print-sbatch to see the script)
  sbatch slurm/ddp.sbatch ...             the same job as a plain sbatch script
  python -m hpc_ddp.train ...             one task (under srun, torchrun, or alone)
  python -m hpc_ddp.doctor                pre-flight checks, on every rank
  python -m hpc_ddp.bench                 measured performance
  python -m hpc_ddp.report FOLDER         a run's report.html: plots, attempts, goodput
Each takes --help.""")
