"""Exit codes of every hpc_ddp process (launcher, task, submitter), documented in one place.

A batch script can branch on them: `PREEMPTED` means "a consistent checkpoint was written at an agreed
step; start me again and I resume", which is what `slurm/ddp.sbatch` does where `scontrol` is missing.
"""

OK = 0
FAILED = 1  # a task raised or died; the run folder keeps the last good checkpoint
USAGE = 2  # bad flags, bad environment, unwritable folder: a one-line message says what to fix
PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; resume by starting again
