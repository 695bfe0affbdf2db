"""`python -m hpc_ddp.doctor`: one task of the pre-flight check (see hpc_ddp.doctor.checkup)."""

from hpc_ddp.doctor.checkup import PROG, main
from hpc_ddp.errors import run_task

if __name__ == "__main__":
    run_task(PROG, main)
