"""Slurm's job states, once: every state word Slurm 22.05 prints (`job_state_string` in its
src/common/slurm_protocol_defs.c: 12 base states, 12 flag states), what each means, and what the kit
does with it. Everything that asks "is this job over?", "did Slurm requeue it?" or "who ended it?" reads this
table (pure).

One word describes two things. `scontrol show job` (the controller) describes the *job*: PENDING after a
requeue, COMPLETING while processes still run, CANCELLED once the last one is gone. `sacct -D` (accounting)
describes each *run* of the job, one record per start: a run ends REQUEUED, PREEMPTED or NODE_FAIL and the
next record (PENDING, RUNNING, ...) is the same job again. So a terminal word ends a run; whether the job is
over is the controller's to say (hpc_ddp.launch.slurm.follow).

PREEMPTED is terminal for a run: Slurm preempted it. With PreemptMode=REQUEUE the job comes back as a new
run (sacct: a PREEMPTED record, then a PENDING one; the controller: PENDING, Restarts + 1); with
PreemptMode=CANCEL the job is over, and `--wait` says "was preempted".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """What a state word means for someone following the job."""

    PENDING = "pending"  # waiting for resources or its begin time; starts by itself
    HELD = "held"  # pending, but starts only once released (scontrol release, a new reservation)
    REQUEUED = "requeued"  # this run is over and the job goes back to pending
    RUNNING = "running"  # has an allocation (running, suspended, being set up or resized)
    COMPLETING = "completing"  # over, but processes may still run on some nodes (KillWait, epilog, stage-out)
    SUCCESS = "success"  # over: every process exited 0
    FAILURE = "failure"  # over: otherwise (an error, a signal, Slurm ended it)
    UNKNOWN = "unknown"  # a word this table lacks ("?" or a newer Slurm's): treated as not over

    @property
    def terminal(self) -> bool:
        return self in (Kind.SUCCESS, Kind.FAILURE)

    @property
    def waiting(self) -> bool:
        """Pending, held or on its way back to pending: no allocation now, one to come (maybe)."""
        return self in (Kind.PENDING, Kind.HELD, Kind.REQUEUED)


@dataclass(frozen=True)
class Meaning:
    kind: Kind
    text: str  # Slurm's own words (squeue(1), JOB STATE CODES), shortened
    by_slurm: bool = False  # a terminal state that Slurm (or a person through it) caused, not the job's exit
    requeues: bool = False  # after a run ends so, Slurm itself may requeue the job (--requeue)


TABLE: dict[str, Meaning] = {
    # base states
    "PENDING": Meaning(Kind.PENDING, "awaiting resource allocation"),
    "RUNNING": Meaning(Kind.RUNNING, "has an allocation"),
    "SUSPENDED": Meaning(Kind.RUNNING, "has an allocation, execution suspended and CPUs released"),
    "COMPLETED": Meaning(Kind.SUCCESS, "every process on every node exited 0"),
    "CANCELLED": Meaning(Kind.FAILURE, "cancelled by the user or an administrator", by_slurm=True),
    "FAILED": Meaning(Kind.FAILURE, "a non-zero exit code or another failure"),
    "TIMEOUT": Meaning(Kind.FAILURE, "reached its time limit", by_slurm=True),
    "NODE_FAIL": Meaning(Kind.FAILURE, "one of its nodes failed", by_slurm=True, requeues=True),
    "PREEMPTED": Meaning(Kind.FAILURE, "preempted", by_slurm=True, requeues=True),
    "BOOT_FAIL": Meaning(Kind.FAILURE, "its nodes failed to boot or launch it", by_slurm=True),
    "DEADLINE": Meaning(Kind.FAILURE, "reached its deadline (--deadline)", by_slurm=True),
    "OUT_OF_MEMORY": Meaning(Kind.FAILURE, "a process ran out of memory"),
    # flag states: shown instead of the base state while the flag is set
    "COMPLETING": Meaning(Kind.COMPLETING, "ending; processes on some nodes may still be active"),
    "STAGE_OUT": Meaning(Kind.COMPLETING, "ended; staging out files (burst buffer)"),
    "CONFIGURING": Meaning(Kind.RUNNING, "allocated; waiting for its nodes to be ready (booting)"),
    "RESIZING": Meaning(Kind.RUNNING, "about to change size"),
    "REQUEUED": Meaning(Kind.REQUEUED, "this run is over; the job is being requeued"),
    "REQUEUE_FED": Meaning(Kind.REQUEUED, "being requeued by a federation"),
    "REQUEUE_HOLD": Meaning(Kind.HELD, "requeued and held (scontrol requeuehold): starts once released"),
    "SPECIAL_EXIT": Meaning(Kind.HELD, "requeued in the special-exit state, held: starts once released"),
    "STOPPED": Meaning(Kind.RUNNING, "has an allocation, execution stopped with SIGSTOP"),
    "REVOKED": Meaning(Kind.FAILURE, "revoked: a sibling started on another cluster", by_slurm=True),
    "RESV_DEL_HOLD": Meaning(Kind.HELD, "held: its reservation was deleted"),
    "SIGNALING": Meaning(Kind.RUNNING, "being signaled"),
}
_UNKNOWN = Meaning(Kind.UNKNOWN, "a state this kit does not know")


def state_word(text: str) -> str:
    """Slurm's state text -> the word: "CANCELLED by 0" -> CANCELLED, "RUNNING+" -> RUNNING (pure)."""
    words = text.split()
    return words[0].rstrip("+").upper() if words else ""


def meaning(word: str) -> Meaning:
    return TABLE.get(word, _UNKNOWN)


@dataclass(frozen=True)
class JobState:
    """One state as a command printed it: the word, and the batch script's exit code and signal."""

    state: str  # RUNNING, COMPLETED, CANCELLED ("CANCELLED by 0" -> CANCELLED), ...
    exit_code: int = 0  # before the colon of Slurm's ExitCode
    signal: int = 0  # after it: the signal that ended the script, if any

    @property
    def kind(self) -> Kind:
        return meaning(self.state).kind

    @property
    def done(self) -> bool:
        """This run is over (for the job: see the module docstring)."""
        return self.kind.terminal

    @property
    def by_slurm(self) -> bool:
        return meaning(self.state).by_slurm


def exit_pair(text: str) -> tuple[int, int]:
    """Slurm's ExitCode "code:signal" -> (code, signal); (0, 0) for anything else (pure)."""
    code, _, sig = text.partition(":")
    try:
        return int(code or 0), int(sig or 0)
    except ValueError:
        return 0, 0
