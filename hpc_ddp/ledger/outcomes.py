"""How an attempt ended, what comes next, and the exit code of each ending: the one table of them.

An *outcome* is what ended an attempt (the supervisor's judgement, hpc_ddp.ledger.judge); a *decision*
is what the job does after it. A job that stops leaves with the exit code of the outcome that stopped it
(`exit_code`), whoever supervised it: the local launcher, the batch shell's `end` step, `submit --wait`.
"""

from __future__ import annotations

from hpc_ddp import exitcodes

COMPLETED, PREEMPTED, STOPPED = "completed", "preempted", "stopped"
FAILED, HANG, NODE_FAIL, LOST = "failed", "hang", "node_fail", "lost"
NONFINITE, USAGE, RUNNING = "nonfinite", "usage", "running"
OUTCOMES = (COMPLETED, PREEMPTED, STOPPED, FAILED, HANG, NODE_FAIL, LOST, NONFINITE, USAGE)
FAILURES = (FAILED, HANG, NODE_FAIL, LOST)  # what --max-restarts counts; a preemption is not a failure
# A job that stopped after one of these resumes with the same command, once the cause is fixed (a usage error,
# a non-finite loss or a stop the kit made fail the same way again): what every supervisor advises after.
RESUMABLE = (*FAILURES, PREEMPTED)

DONE, RESTART, REQUEUE, STOP = "done", "restart", "requeue", "stop"  # the decisions

# The exit code of a job that ends with this outcome. An outcome not listed (a failure of any kind) is FAILED.
EXIT_CODES = {
    COMPLETED: exitcodes.OK,
    PREEMPTED: exitcodes.PREEMPTED,  # saved a checkpoint and was not started again: resume by running again
    STOPPED: exitcodes.PREEMPTED,
    HANG: exitcodes.HANG,
    NONFINITE: exitcodes.NONFINITE,
    USAGE: exitcodes.USAGE,
}


def exit_code(outcome: str, saved: bool = True) -> int:
    """The exit code of a job that stops after an attempt with `outcome` (pure). `saved`: a stop or a
    preemption the ranks saved for; one the scheduler ended before they could (a time limit, a cancel) left
    nothing to resume from that attempt, and is a failure."""
    if outcome in (PREEMPTED, STOPPED) and not saved:
        return exitcodes.FAILED
    return EXIT_CODES.get(outcome, exitcodes.FAILED)
