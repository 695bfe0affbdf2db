"""A task's start, held open until a preemption signal has reached it: for the early-signal test on the
local cluster (tests/test_launch_slurm_early_signal.py).

A stand-in python (the test's `--python`) runs every task as

    python -u -m hpc_ddp.launch.slurm.start -u -m slow_start -u -m submitit.core._submit <folder>

so this module runs after the starter's first instruction and before submitit unpickles the task, whose
first act installs the preemption handler: the window a USR2 racing a real start falls into (0.15-0.3 s of
imports), here as long as the test needs. On a job's first run, each task leaves `starting.<rank>` in
SLOW_START_DIR and waits until SIGUSR2 is pending (the starter blocked it), then runs submitit. Without the
block, the signal's default action ends the task right here. Later runs start at once.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

WAIT_S = 120.0  # only against a signal that never comes: the test fails on its own assertions then


def main() -> None:
    args = sys.argv[1:]
    while args and args[0] == "-u":
        args.pop(0)
    if len(args) < 2 or args[0] != "-m":
        sys.exit(f"usage: python -m slow_start [-u] -m MODULE [args...]; found {sys.argv[1:]!r}")
    gate = os.environ.get("SLOW_START_DIR")
    if gate and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
        Path(gate, f"starting.{os.environ.get('SLURM_PROCID', '?')}").write_text(str(os.getpid()))
        deadline = time.monotonic() + WAIT_S
        while signal.SIGUSR2 not in signal.sigpending() and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
