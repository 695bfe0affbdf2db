"""The supervisors' rules, pure: what ended an attempt, whom to blame, and what comes next.

`judge(evidence)` reads what the supervisor saw when an attempt ended (exit code, the ranks' exit notes, a
hang verdict, ranks killed by a signal, nodes Slurm took away) and names the first cause: its rank, node and
signature, and whether it points at the node. `decide(history, ending, ...)` says what the job does next:

- finished: done. A usage error or a non-finite loss: stop (the same input fails the same way again).
- a preemption the ranks saved for (preempted.json): requeue/restart while the preemptions of this job stay
  within --max-requeue; a stop signal (SIGTERM) among them: stop. Where rank 0 decided alone (--requeue-by
  scontrol) its decision stands and no budget is applied here.
- a failure (a rank raising, a peer vanishing, a hang verdict, a node failure): start again from the latest
  checkpoint while the failures of this job stay within --max-restarts, except a *crash loop*: an attempt that
  fails with the same signature as the attempt before it, without a newer checkpoint in between, is an error
  in the code or data, not bad luck, and the job stops.
- blame: a hardware-looking error (the node rows of hpc_ddp.launch.faults.TABLE; an illegal memory access
  only until it follows the job to a second node), a rank dying by a signal, a hang or
  unresponsive rank, or a node Slurm set DOWN points at that node. On Slurm the requeued job then excludes
  every node blamed so far (hpc_ddp.launch.slurm.batch); locally the blame is only recorded.

Everything here is data in, data out: the supervisor core (hpc_ddp.launch.supervisor) reads the evidence
and records the attempt, and the supervisors (hpc_ddp.launch.local, hpc_ddp.launch.slurm.batch) act.
"""

from __future__ import annotations

import signal as signals
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hpc_ddp import exitcodes
from hpc_ddp.launch import faults
from hpc_ddp.ledger import outcomes as record
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.signature import signature

__all__ = ["Decision", "Ending", "Evidence", "decide", "judge", "signature"]

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


def node_fault(text: str) -> bool:
    """An error that blames the node it was raised on, seen for the first time (hpc_ddp.launch.faults)."""
    return faults.blame(text, None)


def follow(before: Sequence[Attempt], ending: Ending) -> Ending:
    """An ending that blames a node the first time but is the code's once it follows the job to another node
    (pure): a SUSPECT error (hpc_ddp.launch.faults: an illegal memory access), and a hang (a rank stuck in the
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


def secondary(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in SECONDARY)


# The signals that mean "preempted" to every task of the kit (hpc_ddp.run.preemption): a task killed by one
# died of a preemption that came before its handler existed (while the interpreter started), never of a crash.
PREEMPTION_SIGNALS = ("SIGUSR1", "SIGUSR2")


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
    requeue: bool | None = None  # a preemption: do the signals ask for a requeue (preempted.json); None: none
    rank0_requeued: bool | None = None  # a preemption rank 0 decided alone (--requeue-by scontrol): did it?
    lost: tuple[str, ...] = ()  # this attempt's nodes that failed under it (never a drained one: draining is
    # an administrator's word for "no new jobs", not a failure), first first
    node_fail: bool = False  # Slurm says a node failure ended the attempt, even if not which node
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

    @property
    def blames_a_rank(self) -> bool:
        """An ending some rank caused (not a finish, nor a preemption the ranks saved for)."""
        return self.outcome not in (record.COMPLETED, record.PREEMPTED, record.STOPPED)


def _node(ev: Evidence, rank: int | None) -> str | None:
    return ev.rank_nodes[rank] if rank is not None and 0 <= rank < len(ev.rank_nodes) else None


def judge(ev: Evidence) -> Ending:
    """The first cause of the attempt's end (pure). Without a better witness (an exit note, a verdict), the
    rank that ended first, when the supervisor saw it (`first_rank`), is the one named."""
    ending = _judge(ev)
    if ending.rank is None and ev.verdict is None and ev.first_rank is not None and ending.blames_a_rank:
        return replace(ending, rank=ev.first_rank, node=_node(ev, ev.first_rank))
    return ending


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


def _judge(ev: Evidence) -> Ending:
    node_fail = ev.node_fail or bool(ev.lost)
    if ev.code == exitcodes.OK and not node_fail:
        return Ending(record.COMPLETED, "finished")
    if ev.refused:
        return Ending(record.USAGE, ev.refused, "usage srun")
    if ev.unwritable:  # whatever the ranks died of next, nothing can be saved: a retry fails the same way
        return Ending(record.FAILED, ev.unwritable, "unwritable run folder", retryable=False)
    if ev.code == exitcodes.PREEMPTED and ev.requeue is not None and not node_fail:
        if ev.rank0_requeued is not None:
            return (
                Ending(record.PREEMPTED, "saved a checkpoint; rank 0 requeued the job", decided=True)
                if ev.rank0_requeued
                else Ending(
                    record.STOPPED,
                    "stopped by a signal after saving a checkpoint; not requeued"
                    if not ev.requeue
                    else "saved a checkpoint; rank 0 did not requeue the job (--max-requeue spent, "
                    "or scontrol failed: its log says which)",
                    decided=True,
                )
            )
        return (
            Ending(record.PREEMPTED, "saved a checkpoint, to be resumed")
            if ev.requeue
            else Ending(record.STOPPED, "stopped by a signal after saving a checkpoint; not requeued")
        )
    if ev.code == exitcodes.USAGE:
        note = ev.notes[0] if ev.notes else {}
        return Ending(record.USAGE, "usage error (see the log)", "usage", note.get("rank"), note.get("node"))
    if ev.code == exitcodes.NONFINITE:
        return Ending(record.NONFINITE, "the loss became NaN or infinite", "nonfinite")
    if node_fail:
        # Before the ranks' own words: what the survivors raised or died of came after their peers vanished.
        node = ev.lost[0] if ev.lost else None
        where = f"node {node}" if len(ev.lost) < 2 else f"nodes {','.join(ev.lost)}"
        return Ending(
            record.NODE_FAIL,
            f"{where if node else 'a node'} failed (Slurm took {'them' if len(ev.lost) > 1 else 'it'} away)",
            f"node failure {node or ''}".strip(),
            node=node,
            blamed=node is not None,
            lost=ev.lost,
        )
    if ev.verdict is not None:
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
        rank, name = killed[0]
        if name in PREEMPTION_SIGNALS:
            # The job's preemption signal reached the task before its handler existed (while python started):
            # a preemption like any other, counted against --max-requeue; only its save did not happen.
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


@dataclass(frozen=True)
class Decision:
    action: str  # attempts.DONE, RESTART (local) / REQUEUE (Slurm), or STOP
    message: str
    exclude: tuple[str, ...] = field(default_factory=tuple)  # every node blamed in this job so far
    crash_loop: bool = False
    nodes: int | None = None  # the nodes a requeued job goes on with, fewer than it ran on (--min-nodes)
    left: tuple[str, ...] = ()  # a restart in place (--spare-nodes): the nodes the next step leaves out
    spares_in: tuple[str, ...] = ()  # ... and the spares it takes in their place


def blamed_nodes(history: Sequence[Attempt]) -> tuple[str, ...]:
    """Every node blamed in `history`, first first: the failing rank's node, and each node lost with it."""
    nodes: list[str] = []
    for a in history:
        for node in (a.node, *a.lost) if a.blamed else ():
            if node and node not in nodes:
                nodes.append(node)
    return tuple(nodes)


def decide(
    history: Sequence[Attempt],
    this: Attempt,
    max_restarts: int,
    again: str = record.REQUEUE,
    retryable: bool = True,
    *,
    max_requeue: int | None = None,
) -> Decision:
    """What the job does after `this` attempt ended. `history` is this job's attempts before it, in order;
    `again` is how it starts again here (outcomes.REQUEUE on Slurm, RESTART locally); `retryable` is False
    when the kit itself stopped the run (Ending.retryable). The two budgets: `max_restarts` counts failures,
    `max_requeue` preemptions (None: rank 0 decided about this preemption itself, Ending.decided). Pure."""
    exclude = blamed_nodes([*history, this])
    if this.outcome == record.COMPLETED:
        return Decision(record.DONE, "finished", exclude)
    if this.outcome == record.PREEMPTED:
        if max_requeue is None:
            return Decision(again, "resuming from the checkpoint it saved", exclude)
        done = sum(1 for a in history if a.outcome == record.PREEMPTED)
        if done >= max_requeue:
            return Decision(
                record.STOP,
                f"requeue budget spent ({done} of --max-requeue {max_requeue}), "
                "not requeued. Resume with the same command and --folder",
                exclude,
            )
        return Decision(
            again,
            f"requeue {done + 1} of --max-requeue {max_requeue}, resuming from the latest checkpoint",
            exclude,
        )
    if this.outcome == record.STOPPED:
        return Decision(record.STOP, "stopped after saving a checkpoint (not requeued)", exclude)
    if this.outcome in (record.USAGE, record.NONFINITE):
        return Decision(record.STOP, "not retried: the same input fails the same way again", exclude)
    if not retryable:
        return Decision(record.STOP, "not retried: the run stopped itself (see its one-line error)", exclude)
    failures = sum(1 for a in history if a.failed) + 1
    before = history[-1] if history else None
    elsewhere = before is not None and before.blamed and this.blamed and before.node != this.node
    if (
        before is not None
        and before.failed
        and before.signature == this.signature
        and not elsewhere
        and (this.checkpoint if this.checkpoint is not None else -1)
        <= (before.checkpoint if before.checkpoint is not None else -1)
    ):
        return Decision(
            record.STOP,
            f"crash loop: attempt {this.number} failed with the same error as attempt "
            f"{before.number} and no newer checkpoint in between; not retried "
            "(an error in the code or data, not bad luck)",
            exclude,
            crash_loop=True,
        )
    if failures > max_restarts:
        return Decision(
            record.STOP,
            f"restart budget spent: {failures} failure(s), --max-restarts {max_restarts}",
            exclude,
        )
    since = (
        f"the checkpoint at step {this.checkpoint}"
        if this.checkpoint is not None
        else "the start (no checkpoint yet)"
    )
    return Decision(
        again, f"restarting from {since} (failure {failures} of --max-restarts {max_restarts})", exclude
    )
