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

Each terminal word also says how the run ended in the kit's neutral words (`End`, hpc_ddp.scheduler.base): by
its processes' exit, or by Slurm and why; the ledger's judge reads that, never a word. The node states sinfo
prints are read here too (`node_failed`, `usable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_ddp.scheduler.base import End, Kind


@dataclass(frozen=True)
class Meaning:
    kind: Kind
    text: str  # Slurm's own words (squeue(1), JOB STATE CODES), shortened
    by_slurm: bool = False  # a terminal state that Slurm (or a person through it) caused, not the job's exit
    requeues: bool = False  # after a run ends so, Slurm itself may requeue the job (--requeue)
    end: End | None = None  # a terminal state: how the run ended, in the kit's neutral words
    said: str = ""  # a terminal state Slurm caused: what it did to the job, as `submit --wait` says it


TABLE: dict[str, Meaning] = {
    # base states
    "PENDING": Meaning(Kind.PENDING, "awaiting resource allocation"),
    "RUNNING": Meaning(Kind.RUNNING, "has an allocation"),
    "SUSPENDED": Meaning(Kind.RUNNING, "has an allocation, execution suspended and CPUs released"),
    "COMPLETED": Meaning(Kind.SUCCESS, "every process on every node exited 0", end=End.EXITED),
    "CANCELLED": Meaning(
        Kind.FAILURE,
        "cancelled by the user or an administrator",
        True,
        end=End.CANCELLED,
        said="was cancelled",
    ),
    "FAILED": Meaning(Kind.FAILURE, "a non-zero exit code or another failure", end=End.EXITED),
    "TIMEOUT": Meaning(
        Kind.FAILURE, "reached its time limit", True, end=End.TIME_LIMIT, said="hit its time limit"
    ),
    "NODE_FAIL": Meaning(
        Kind.FAILURE, "one of its nodes failed", True, True, end=End.NODE_FAILURE, said="lost a node"
    ),
    "PREEMPTED": Meaning(Kind.FAILURE, "preempted", True, True, end=End.PREEMPTED, said="was preempted"),
    "BOOT_FAIL": Meaning(Kind.FAILURE, "its nodes failed to boot or launch it", True, end=End.BOOT_FAILURE),
    "DEADLINE": Meaning(Kind.FAILURE, "reached its deadline (--deadline)", True, end=End.DEADLINE),
    "OUT_OF_MEMORY": Meaning(
        Kind.FAILURE,
        "a process ran out of memory",
        end=End.OUT_OF_MEMORY,
        said="ran out of memory (--mem-gb)",
    ),
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
    "REVOKED": Meaning(Kind.FAILURE, "revoked: a sibling started on another cluster", True, end=End.REVOKED),
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

    @property
    def end(self) -> End | None:
        """How this run ended (None while it has not): by its processes' exit, or by Slurm, and why."""
        return meaning(self.state).end

    @property
    def said(self) -> str:
        """What Slurm did to the job, in a few words ("hit its time limit"); else "ended <STATE>"."""
        return meaning(self.state).said or f"ended {self.state}"


def exit_pair(text: str) -> tuple[int, int]:
    """Slurm's ExitCode "code:signal" -> (code, signal); (0, 0) for anything else (pure)."""
    code, _, sig = text.partition(":")
    try:
        return int(code or 0), int(sig or 0)
    except ValueError:
        return 0, 0


# ----- node states (sinfo's short form) ------------------------------------------------------------------------

# A node state's suffix says more about it (`*` not responding, `~` powered off, `#` powering up, `!` powering
# down, `%` powering down, `$` maintenance reservation, `@` pending reboot, `^` rebooting, `-` planned).
_SUFFIXES = "*~#!%$@^-"
# A state a job cannot start on: down, drained or draining, failed, under maintenance, unknown, future.
_NOT_USABLE = ("down", "drain", "drng", "fail", "maint", "inval", "unk", "futr", "npc")


def node_failed(state: str) -> bool:
    """A node state that says the node failed: DOWN, FAIL/FAILING, or not responding (`*`). Not a drain: an
    administrator drains a healthy node (no new jobs; running ones go on), so a drained node is never blamed
    for an attempt's end (pure)."""
    low = state.lower()
    return low.endswith("*") or low.rstrip(_SUFFIXES).startswith(("down", "fail"))


def usable(states: Mapping[str, str], exclude: Sequence[str]) -> list[str]:
    """The nodes a job could still run on: not excluded and not down, drained or failed (`states` maps node
    -> Slurm state as sinfo prints it). The job fits when it needs no more nodes than these. Pure."""
    return [
        n
        for n, s in states.items()
        if n not in exclude and not s.lower().rstrip(_SUFFIXES).startswith(_NOT_USABLE)
    ]
