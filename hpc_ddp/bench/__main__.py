"""`python -m hpc_ddp.bench`: measure the kit on this machine (see hpc_ddp.bench)."""

from hpc_ddp.bench.suite import PROG, main
from hpc_ddp.errors import run_main

if __name__ == "__main__":
    run_main(PROG, main)
