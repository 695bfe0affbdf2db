"""The one judge of how an attempt ended, pure: its outcome, the first cause, whom to blame.

Every ending of the kit is judged here, whoever saw it:

- `judge(evidence)`: what a supervisor saw when the attempt's last task was gone (the exit code, the ranks'
  exit notes, a hang verdict, the preemption record, ranks killed by a signal, nodes the scheduler took away,
  srun's refusal of its options, a run folder that cannot be written). It names the first cause: its rank,
  node and signature, and whether it points at the node. The local launcher and the batch shell's `end` step
  ask it (through hpc_ddp.launch.supervisor).
- `requeued_by_scheduler`: the scheduler requeued the job itself with every node up (`scontrol requeue`,
  PreemptMode=REQUEUE): a preemption.
- `unrecorded`: an attempt whose batch shell died before it could record it (its own node failed, a time limit
  or a cancel killed it), as the scheduler's accounting tells it (hpc_ddp.launch.slurm.lost).
- `job_end`: a job `submit --wait` followed to its end that the record does not close (no attempt recorded, or
  its last one did not stop it): how the scheduler says it ended (hpc_ddp.scheduler.base.End), with a hang
  verdict and a preemption record of this submission (hpc_ddp.launch.slurm.outcome).

`follow` turns a node's blame into the code's once the same error follows the job to another node, and `close`
writes the ending into the attempt. What the job does next is hpc_ddp.ledger.rules; the exit code of each
outcome is hpc_ddp.ledger.outcomes. Blame: a hardware-looking error (hpc_ddp.ledger.faults), a rank dying by a
signal, a hang or an unresponsive rank, or a node the scheduler set down points at that node.
"""

from __future__ import annotations

import signal as signals
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hpc_ddp import exitcodes
from hpc_ddp.ledger import faults
from hpc_ddp.ledger import outcomes as record
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.signature import signature
from hpc_ddp.scheduler.base import End

__all__ = [
    "Ending",
    "Evidence",
    "close",
    "follow",
    "job_end",
    "judge",
    "named_first",
    "requeued_by_scheduler",
    "signature",
    "unrecorded",
]

# Errors a rank raises because *another* rank ended (its peers' sockets closed, an aborted communicator,
# rank 0's forwarded failure): never the first cause when a first cause is known.
SECONDARY = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "communicator was aborted",
    "remote process exited",
    "rank 0 failed (",
    "socket closed",
    "ncclremoteerror",
    "dist_backend_error",
    "recvbytes",
    "sendbytes",
    "read error",
    "early eof",
)

# Of those, the words gloo, NCCL and the rendezvous store use when a peer's connection went away under an
# established group: the peer ended, and a rank that ended without a note of its own (a signal leaves none) is
# the one that went. Only as torch.distributed raises them: a Python ConnectionResetError says "Connection
# reset by peer" too (a dataset's download), and no peer went then.
VANISHED = ("connection closed by peer", "connection reset by peer", "remote process exited", "early eof")
VANISHED_TYPES = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError")

# The signals that mean "preempted" to every task of the kit (hpc_ddp.run.loop.preemption): a task killed by one
# died of a preemption that came before its handler existed (while the interpreter started), never of a crash.
PREEMPTION_SIGNALS = ("SIGUSR1", "SIGUSR2")

# How the scheduler stopping a run reads when nobody of the kit recorded the attempt: its signature (the word
# recorded before there were neutral ones) and its reason.
STOPS = {
    End.TIME_LIMIT: ("timeout", "its time limit ended it before its batch shell could record the attempt"),
    End.CANCELLED: ("cancelled", "cancelled before its batch shell could record the attempt"),
    End.DEADLINE: ("deadline", "its deadline ended it before its batch shell could record the attempt"),
}


def node_fault(text: str) -> bool:
    """An error that blames the node it was raised on, seen for the first time (hpc_ddp.ledger.faults)."""
    return faults.blame(text, None)


def secondary(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in SECONDARY)


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class Evidence:
    """What the supervisor saw when the attempt's last task was gone."""

    code: int  # the job step's exit code: the first failing rank's (local), srun's (Slurm); < 0 = -signal
    rank_nodes: tuple[str, ...] = ()  # the node of each rank
    notes: tuple[dict[str, Any], ...] = ()  # the ranks' exit notes (hpc_ddp.ledger.exits), oldest first
    verdict: dict[str, Any] | None = None  # hang.json written in this attempt
    killed: tuple[
        tuple[int, str], ...
    ] = ()  # (rank, signal name) of ranks that died by a signal, first first
    first_rank: int | None = None  # the rank that ended first, when the supervisor knows it (local)
    ends: tuple[tuple[int, str], ...] = ()  # every task end srun reported, in its order: (rank, signal name
    # or "exit C"); srun may report a survivor's exit before the death that caused it (Slurm)
    requeue: bool | None = None  # a preemption: do the signals ask for a requeue (preempted.json); None: none
    rank0_requeued: bool | None = None  # a preemption rank 0 decided alone (--requeue-by scontrol): did it?
    lost: tuple[str, ...] = ()  # this attempt's nodes that failed under it (never a drained one: draining is
    # an administrator's word for "no new jobs", not a failure), first first
    node_fail: bool = False  # the scheduler says a node failure ended the attempt, even if not which node
    refused: str = ""  # srun refused its own options before starting a task: why, as one line
    unwritable: str = ""  # the run folder cannot be written (read-only, no permission): why, as one line


@dataclass(frozen=True)
class Ending:
    outcome: str
    reason: str
    signature: str = ""
    rank: int | None = None
    node: str | None = None
    blamed: bool = False
    traceback: str = ""  # the first cause's traceback, when a rank left one
    retryable: bool = True  # False: the kit stopped the run on purpose (hpc_ddp.errors.RunStopped)
    decided: bool = False  # rank 0 already decided about this preemption (and requeued, or not): it stands
    lost: tuple[str, ...] = ()  # every node that failed under the attempt (a node failure): all are blamed
    saved: bool = True  # a stop or preemption: the ranks saved at it (False: the scheduler ended them first)

    @property
    def blames_a_rank(self) -> bool:
        """An ending some rank caused (not a finish, nor a preemption the ranks saved for)."""
        return self.outcome not in (record.COMPLETED, record.PREEMPTED, record.STOPPED)

    @property
    def exit_code(self) -> int:
        """The exit code of a job that stops with this ending (hpc_ddp.ledger.outcomes: the one mapping)."""
        return record.exit_code(self.outcome, saved=self.saved)


def _node(ev: Evidence, rank: int | None) -> str | None:
    return ev.rank_nodes[rank] if rank is not None and 0 <= rank < len(ev.rank_nodes) else None


# ----- what a supervisor saw ---------------------------------------------------------------------------------


def judge(ev: Evidence) -> Ending:
    """The first cause of the attempt's end (pure). Without a better witness (an exit note, a verdict), the
    rank that ended first, when the supervisor saw it (`first_rank`), is the one named."""
    ending = _judge(ev)
    if ending.rank is None and ev.verdict is None and ev.first_rank is not None and ending.blames_a_rank:
        return replace(ending, rank=ev.first_rank, node=_node(ev, ev.first_rank))
    return ending


def _judge(ev: Evidence) -> Ending:
    """The rules in order: what decides first wins (a node failure before what the survivors raised after)."""
    node_fail = ev.node_fail or bool(ev.lost)
    if ev.code == exitcodes.OK and not node_fail:
        return Ending(record.COMPLETED, "finished")
    if ev.refused:
        return Ending(record.USAGE, ev.refused, "usage srun")
    if ev.unwritable:  # whatever the ranks died of next, nothing can be saved: a retry fails the same way
        return Ending(record.FAILED, ev.unwritable, "unwritable run folder", retryable=False)
    if ev.code == exitcodes.PREEMPTED and ev.requeue is not None and not node_fail:
        return _preempted(ev.requeue, ev.rank0_requeued)
    usage = _usage_note(ev.notes)
    if ev.code == exitcodes.USAGE or usage is not None:
        return _usage(ev, usage)
    if ev.code == exitcodes.NONFINITE:
        return Ending(record.NONFINITE, "the loss became NaN or infinite", "nonfinite")
    if node_fail:
        # Before the ranks' own words: what the survivors raised or died of came after their peers vanished.
        return _node_failure(ev.lost)
    if ev.verdict is not None:
        return _hang(ev)
    return _failed(ev)


def _usage_note(notes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first note of a usage error (a user's mistake, hpc_ddp.errors.UsageError), never one a peer's end
    caused: rank 0's alone, while the others failed on it in a collective, is the cause whoever was seen first."""
    return next(
        (n for n in notes if n.get("usage") and not secondary(f"{n.get('type')}: {n.get('message')}")), None
    )


def _usage(ev: Evidence, note: dict[str, Any] | None) -> Ending:
    """A usage error: its rank's line (the first usage note), else the first rank's own error, else the log."""
    if note is None:
        note = next((n for n in ev.notes if not secondary(f"{n.get('type')}: {n.get('message')}")), None)
    if note is None:
        return Ending(record.USAGE, "usage error (see the log)", "usage")
    rank = int(note["rank"])
    return Ending(
        record.USAGE,
        f"{note.get('type')}: {note.get('message')}",
        "usage",
        rank,
        note.get("node") or _node(ev, rank),
        traceback=str(note.get("traceback") or ""),
        retryable=False,
    )


def _preempted(requeue: bool, rank0_requeued: bool | None) -> Ending:
    """The ranks saved at an agreed step after a signal: a preemption (requeue) or a stop (SIGTERM among them).
    Where rank 0 decided alone (--requeue-by scontrol), its decision stands (`decided`)."""
    if rank0_requeued is None:
        return (
            Ending(record.PREEMPTED, "saved a checkpoint, to be resumed")
            if requeue
            else Ending(record.STOPPED, "stopped by a signal after saving a checkpoint; not requeued")
        )
    if rank0_requeued:
        return Ending(record.PREEMPTED, "saved a checkpoint; rank 0 requeued the job", decided=True)
    return Ending(
        record.STOPPED,
        "stopped by a signal after saving a checkpoint; not requeued"
        if not requeue
        else "saved a checkpoint; rank 0 did not requeue the job (--max-requeue spent, "
        "or scontrol failed: its log says which)",
        decided=True,
    )


def _node_failure(lost: tuple[str, ...]) -> Ending:
    """Nodes failed under the attempt (or the scheduler says one did, not which): every one is blamed."""
    node = lost[0] if lost else None
    where = f"node {node}" if len(lost) < 2 else f"nodes {','.join(lost)}"
    return Ending(
        record.NODE_FAIL,
        f"{where if node else 'a node'} failed (Slurm took {'them' if len(lost) > 1 else 'it'} away)",
        f"node failure {node or ''}".strip(),
        node=node,
        blamed=node is not None,
        lost=lost,
    )


def _hang(ev: Evidence) -> Ending:
    """The watchdog's verdict names the rank to blame, unless the ranks disagree on what they run (mismatched:
    the code's)."""
    assert ev.verdict is not None
    culprits = [int(r) for r in ev.verdict.get("culprits") or [] if isinstance(r, int)]
    rank = culprits[0] if culprits else None
    line = str(ev.verdict.get("line") or "hang")
    kind = str(ev.verdict.get("reason") or "hang")
    return Ending(
        record.HANG,
        line,
        signature("Hang", f"{kind} in {ev.verdict.get('phase') or 'unknown'}"),
        rank,
        _node(ev, rank),
        blamed=rank is not None and kind != "mismatched",
    )


def _failed(ev: Evidence) -> Ending:
    """A failure: the first rank's own error (not one caused by a peer that vanished), else the first rank
    killed by a signal, else the peer that vanished when every note says one did, else the first note at
    all, else the step's exit code alone."""
    primary = [n for n in ev.notes if not secondary(f"{n.get('type')}: {n.get('message')}")]
    killed = ev.killed
    if ev.first_rank is not None and ev.code < 0:  # the local launcher saw this rank die by a signal first
        primary, killed = [], ((ev.first_rank, signal_name(-ev.code)),)
    if primary:
        first = primary[0]
        rank = int(first["rank"])
        text = f"{first.get('type')}: {first.get('message')}"
        return Ending(
            record.FAILED,
            text,
            str(first.get("signature") or signature(str(first.get("type")), "")),
            rank,
            first.get("node") or _node(ev, rank),
            blamed=node_fault(text),
            traceback=str(first.get("traceback") or ""),
            retryable=first.get("retry") is not False,
        )
    if killed:
        return _killed(ev, *killed[0])
    vanished = _vanished_peer(ev)
    if vanished is not None:
        return _killed(ev, *vanished)
    if ev.notes:
        first = ev.notes[0]
        rank = int(first["rank"])
        return Ending(
            record.FAILED,
            f"{first.get('type')}: {first.get('message')}",
            str(first.get("signature") or ""),
            rank,
            first.get("node") or _node(ev, rank),
            traceback=str(first.get("traceback") or ""),
        )
    code = ev.code
    how = f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"
    return Ending(
        record.FAILED,
        f"the job step ended with {how}",
        f"exit {code}",
        ev.first_rank,
        _node(ev, ev.first_rank),
    )


def _vanished_peer(ev: Evidence) -> tuple[int, str] | None:
    """When every note says a peer's connection went away (`VANISHED`), the peer that went is a rank that left
    no note: the first such that srun reported, if a signal ended it. srun can report the survivor's exit first
    (its node's report reached srun sooner) and the SIGKILL that caused it after, where `srun_deaths` reads a
    kill of srun's own (--kill-on-bad-exit); a note that says a peer went tells the two apart."""
    if not ev.notes or not all(_says_vanished(n) for n in ev.notes):
        return None
    noted = {n.get("rank") for n in ev.notes}
    for rank, how in ev.ends:
        if rank not in noted:
            return (rank, how) if how.startswith("SIG") else None  # an exit code: it had its own end
    return None


def _says_vanished(note: dict[str, Any]) -> bool:
    low = str(note.get("message")).lower()
    return note.get("type") in VANISHED_TYPES and any(p in low for p in VANISHED)


def _killed(ev: Evidence, rank: int, name: str) -> Ending:
    if name in PREEMPTION_SIGNALS:
        # The job's preemption signal reached the task before its handler existed (while python started): a
        # preemption like any other, counted against --max-requeue; only its save did not happen.
        return Ending(
            record.PREEMPTED,
            f"rank {rank} was killed by {name}, the preemption signal, before its handler was installed: "
            "to be resumed from the latest checkpoint",
            f"preempted {name}",
            rank,
            _node(ev, rank),
        )
    return Ending(
        record.FAILED,
        f"rank {rank} was killed by {name}",
        f"signal {name}",
        rank,
        _node(ev, rank),
        blamed=True,
    )


def named_first(seen: int, ending: Ending, codes: Sequence[int | None]) -> int:
    """The rank a local launcher's failure line names (pure): the first cause (`judge`'s rank, from the ranks'
    exit notes) when its process ended with a failure too, else the rank it saw end first (`seen`). A poll sees
    ranks that ended within one interval in rank order, so under load a rank that failed only because the cause
    ended (gloo's "Connection closed by peer") can be seen first."""
    cause = ending.rank
    if (
        cause is None
        or not 0 <= cause < len(codes)
        or codes[cause] in (None, exitcodes.OK, exitcodes.PREEMPTED)
    ):
        return seen
    return cause


# ----- what the scheduler says -------------------------------------------------------------------------------


def requeued_by_scheduler(status: int, requeued: bool, node_fail: bool) -> Ending | None:
    """A requeue the scheduler performed with no node failure under the attempt (`scontrol requeue`, which is
    what PreemptMode=REQUEUE does) is a preemption, counted against --max-requeue (pure). `node_fail`: a node
    of the attempt failed (srun said so, the scheduler removed it, its state says so, or accounting says so)."""
    if not requeued or node_fail or status == exitcodes.OK:
        return None
    return Ending(
        record.PREEMPTED, "Slurm requeued the job (scontrol requeue, or preemption) with every node up"
    )


def unrecorded(ranks: Sequence[str], end: End | None, word: str, lost: Sequence[str]) -> Ending:
    """How an attempt whose batch shell died ended (pure): a node failure when it lost nodes or the scheduler
    says one failed; a time limit, a deadline or a cancel as its accounting says; else lost (its shell was
    killed). `end` and `word`: accounting's record of that run (None and "": none, or not over)."""
    if lost or end is End.NODE_FAILURE:
        return judge(Evidence(code=1, rank_nodes=tuple(ranks), lost=tuple(lost), node_fail=True))
    if end in STOPS:
        sign, reason = STOPS[end]
        return Ending(record.STOPPED, reason, signature=sign, saved=False)
    how = f"its job ended {word}" if end is not None else "its batch shell ended"
    return Ending(
        record.LOST,
        f"{how} before its batch shell recorded it (the shell was killed, or its node failed)",
        "lost",
    )


# What `job_end` names each way a followed job ended (its signature): `submit --wait` words each its own way.
SIGNALLED, SAVED, TIMED_OUT, UNWRITABLE = "signal", "saved", "timeout", "unwritable run folder"


def job_end(end: End, exit_code: int, hang: bool, saved: bool, unwritable: str = "") -> Ending:
    """How a job that `submit --wait` followed ended, when its record does not say (no attempt of it stopped
    it) and it did not succeed: `end` is how the scheduler says its last run ended, `exit_code` its batch
    script's, `hang` a hang verdict of this submission, `saved` a preemption record of it, `unwritable` why
    the run folder cannot be written (pure). The rules in order: what decides first wins. The reason is a
    short word; `submit --wait` says it in full, by the signature."""
    if (
        hang and end is not End.CANCELLED
    ):  # srun reports the highest task code or 128+signal: the verdict wins
        return Ending(record.HANG, "hang", "hang")
    if end is End.EXITED and exit_code == exitcodes.NONFINITE:
        return Ending(record.NONFINITE, "the loss became NaN or infinite", "nonfinite")
    if (
        end is End.EXITED and exit_code == exitcodes.PREEMPTED
    ):  # the ranks saved, and nobody started them again
        return Ending(record.STOPPED, "stopped after a signal and not requeued", SIGNALLED)
    if saved:
        return Ending(record.STOPPED, end.value, SAVED)
    if end is End.TIME_LIMIT:
        return Ending(record.STOPPED, end.value, TIMED_OUT, saved=False)
    if unwritable:  # nothing could be saved or recorded there: a retry fails the same way
        return Ending(record.FAILED, unwritable, UNWRITABLE, retryable=False)
    if exit_code == exitcodes.USAGE:
        return Ending(record.USAGE, "usage error", "usage")
    if end is End.NODE_FAILURE:
        return Ending(record.NODE_FAIL, end.value, "node failure")
    if end in (End.EXITED, End.OUT_OF_MEMORY):  # the job's own processes failed
        return Ending(record.FAILED, end.value, f"exit {exit_code}")
    return Ending(record.STOPPED, end.value, end.value, saved=False)  # the scheduler ended it, nothing saved


# ----- the attempt as it ended ---------------------------------------------------------------------------------


def follow(before: Sequence[Attempt], ending: Ending) -> Ending:
    """An ending that blames a node the first time but is the code's once it follows the job to another node
    (pure): a SUSPECT error (hpc_ddp.ledger.faults: an illegal memory access), and a hang (a rank stuck in the
    same phase on every attempt is stuck in the code: blaming each new node in turn would exclude healthy
    ones until the job no longer fits, and stop it for a node shortage that is not the cause)."""
    if not ending.blamed or not ending.signature:
        return ending
    if ending.outcome == record.HANG:
        seen = [a.node for a in before if a.outcome == record.HANG and a.signature == ending.signature]
        return replace(ending, blamed=False) if any(n != ending.node for n in seen) else ending
    fault = faults.classify(ending.reason)
    # Only a SUSPECT error is reconsidered: other blame (a death by a signal, a hardware fault) stands.
    if ending.outcome != record.FAILED or fault is None or fault.blame is not faults.Blame.SUSPECT:
        return ending
    seen = [a.node for a in before if a.failed and a.signature == ending.signature]
    return ending if faults.blame(ending.reason, ending.node, seen) else replace(ending, blamed=False)


def close(this: Attempt, ending: Ending, step: int | None, checkpoint: int | None, now: float) -> Attempt:
    """`this` attempt as it ended: `ending`, the last step recorded and the latest checkpoint (pure)."""
    if step is not None and checkpoint is not None:
        step = max(
            step, checkpoint
        )  # progress records are periodic; the checkpoint's step was surely reached
    return replace(
        this,
        ended=now,
        outcome=ending.outcome,
        step=step,
        checkpoint=checkpoint,
        rank=ending.rank,
        node=ending.node,
        blamed=ending.blamed,
        reason=ending.reason,
        signature=ending.signature,
        lost=ending.lost,
    )
