"""Exit codes of every hpc_ddp process (launcher, task, submitter), documented in one place, and how a task
process leaves.

A batch script can branch on them: `PREEMPTED` means "a consistent checkpoint was written at an agreed
step; start me again and I resume", which is what `slurm/ddp.sbatch` does where `scontrol` is missing.

`leave(code)` ends a task once its code is decided and its files are durable: flush, say so, `os._exit`.
No interpreter teardown runs after that, so no destructor (a gloo group's, a CUDA context's), atexit hook or
leftover non-daemon thread can keep a finished task alive, and the launcher sees exactly `code`.
"""

import faulthandler
import os
import sys
from typing import NoReturn

OK = 0
FAILED = 1  # a task raised or died; the run folder keeps the last good checkpoint
USAGE = 2  # bad flags, bad environment, unwritable folder: a one-line message says what to fix
NONFINITE = 65  # EX_DATAERR: the loss became NaN/inf; stopped before that update, nothing saved after it
PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; resume by starting again
HANG = 76  # the hang watchdog's verdict: <folder>/hang.json names the stalled rank, its host, phase and line
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it

MEANING = {
    OK: "finished",
    FAILED: "failed",
    USAGE: "usage error",
    NONFINITE: "non-finite loss",
    PREEMPTED: "preempted, resumable",
    HANG: "hang, see hang.json",
    INTERRUPTED: "interrupted",
}
LEAVE_BACKSTOP_S = 30.0  # flushing into a pipe nobody reads blocks; faulthandler ends that (exit 1)


def leave(code: int, say: bool = True) -> NoReturn:
    """Flush, say how this task ends (unless `say` is False: a usage error is one line and nothing more), and
    exit with `code` at once (os._exit: see the module docstring)."""
    # A write into a pipe nobody drains blocks for good; faulthandler's timer is a C thread that needs no
    # interpreter, so it still ends the process then (every thread's stack, exit 1).
    faulthandler.dump_traceback_later(LEAVE_BACKSTOP_S, exit=True)
    rank = os.environ.get("RANK")
    who = f"rank {rank}" if rank is not None else f"pid {os.getpid()}"
    try:
        sys.stdout.flush()
        if say:
            sys.stderr.write(f"hpc_ddp: {who} exits with code {code} ({MEANING.get(code, 'failed')})\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed console must not change the exit code
        pass
    os._exit(code)
