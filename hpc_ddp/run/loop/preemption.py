"""Preemption and time limits: signal handlers that only take note, and what to do once all ranks agreed.

Slurm signals each task on its own schedule, and a handler runs between two bytecodes, maybe in the middle of
a collective. Saving inside the handler (Lightning #21406) deadlocks or tears; requeueing from rank 0 alone
(submitit #9) leaves the other ranks in an all-reduce. So a handler here only records which signal came. The
training loop then folds the flags into the all-reduce it does anyway for the loss, so every rank learns at
the same optimizer step that *some* rank was signalled, and they stop together: save, barrier, then

- SIGUSR1/SIGUSR2 (`--signal=USR2@90` ahead of the time limit, or `scancel --signal=USR2`): ask to start
  again; rank 0 writes the facts (hpc_ddp.ledger.preemption) and every rank exits PREEMPTED. The attempt's
  supervisor (the local launcher, the kit's batch shell) decides within --max-requeue; with none of the kit
  there (a plain srun step, --requeue-by scontrol), rank 0 decides alone and asks its scheduler to requeue the
  job (hpc_ddp.scheduler: `scontrol requeue`).
- SIGTERM (scancel, Slurm's own preemption, the end of a grace period): save and exit PREEMPTED, never
  requeue (Slurm's preemption requeues by itself; a user's scancel must stay cancelled).

`install()` runs first thing in the task, before torch is imported: the signal may come seconds after start,
and the default action of SIGUSR1/2 is to kill the process.

Under torchrun, SIGTERM is different until training starts (`arm()`): torchrun's agent sends it to the
survivors when a worker failed, and SIGKILLs them 30 s later. A rank that is still joining the group is blocked
in C++ (the store, gloo's connect), where no Python handler runs, so a noted SIGTERM would only cost those
30 s, and there is nothing to save yet: until `arm()`, SIGTERM keeps its default action there and ends the rank.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from hpc_ddp import scheduler
from hpc_ddp.ledger import decision, outcomes
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.variables import BATCH

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
BATCH_VAR = BATCH  # set by the kit's batch scripts: their shell decides and requeues after srun
STOP_SIGNALS = (signal.SIGTERM,)

# Index of each flag in the tensor the loop all-reduces every optimizer step (see hpc_ddp.run.loop.agreed).
REQUEUE, STOP = 0, 1

_received: list[int] = [0, 0]
_last_signal: list[int] = [0]
_count: list[int] = [0]  # signals noted so far, so a caller can tell whether one came during its work


def _note(signum: int, _frame: object) -> None:
    # Only record: anything more (I/O, collectives, locks) is unsafe at an arbitrary point of the program.
    _received[STOP if signum in STOP_SIGNALS else REQUEUE] = 1
    _last_signal[0] = signum
    _count[0] += 1


def install(environ: Mapping[str, str] = os.environ) -> None:
    """Replace the handlers of SIGUSR1, SIGUSR2 and SIGTERM (submitit's included) with `_note`, then unblock
    them: the local launcher starts its ranks with these signals blocked, so that one sent while a rank is
    still starting waits in the kernel and is delivered here, to `_note`, instead of killing the process.
    Under torchrun (`environ` names its run) SIGTERM ends the rank until `arm()` (see the module docstring)."""
    under_torchrun = bool(environ.get("TORCHELASTIC_RUN_ID"))
    for sig in REQUEUE_SIGNALS + STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL if under_torchrun and sig in STOP_SIGNALS else _note)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, REQUEUE_SIGNALS + STOP_SIGNALS)


def arm() -> None:
    """Training starts now: a stop signal is noted from here on, and saved for at the next agreed step."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def ignore(_worker_id: int = 0) -> None:
    """Ignore the preemption signals: in DataLoader workers (their rank handles them, and they die with it),
    and in a task whose training is over (Python restores the default, fatal, handlers while it shuts down,
    so a late USR2 would turn a finished run into a killed one)."""
    for sig in REQUEUE_SIGNALS + STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def pending() -> tuple[int, int]:
    """(requeue_requested, stop_requested) as seen by this rank, as 0/1."""
    return _received[REQUEUE], _received[STOP]


def count() -> int:
    """How many preemption signals this process has noted (a second one during the agreed save is only
    counted: the save goes on and the decision is the one already agreed)."""
    return _count[0]


def signal_name() -> str:
    return signal.Signals(_last_signal[0]).name if _last_signal[0] else "a signal on another rank"


@dataclass(frozen=True)
class Choice:
    """The ledger's decision as rank 0 acts on it and says it (`decide`)."""

    requeue: bool
    message: str


def decide(requeue_votes: float, stop_votes: float, preempted: int, max_requeue: int) -> Choice:
    """What rank 0 does after the agreed save when it decides alone (mode "scontrol": no supervisor of the
    kit): the supervisors' one decision (hpc_ddp.ledger.decision.decide), in rank 0's words. Stop (SIGTERM)
    wins over requeue. `preempted` is how many earlier attempts of this job were preempted
    (hpc_ddp.ledger.rules.preemptions): the budget counts preemptions only, not the requeues after failures
    (SLURM_RESTART_COUNT counts both). Pure."""
    outcome = outcomes.STOPPED if stop_votes > 0 else outcomes.PREEMPTED
    history = [Attempt("", r, number=r + 1, outcome=outcomes.PREEMPTED) for r in range(preempted)]
    this = Attempt("", preempted, number=preempted + 1, outcome=outcome)
    decided = decision.decide(history, this, decision.Budgets(0, max_requeue, outcomes.REQUEUE))
    if outcome == outcomes.STOPPED:
        return Choice(False, "stopped by SIGTERM: checkpoint saved, not requeued")
    requeue = decided.action == outcomes.REQUEUE
    return Choice(requeue, f"preempted: checkpoint saved{',' if requeue else ';'} {decided.said}")


def requeue_mode(requeue_by: str, launcher: str, supervised: bool = False) -> str:
    """Who restarts the run after a preempted exit, as preempted.json's "mode" says it: "scontrol" (rank 0
    requeues the job) or "exit" (the tasks exit PREEMPTED and their launcher or batch script starts them
    again). `requeue_by` is --requeue-by; "auto" means scontrol in an srun step (`launcher` "slurm") when
    scontrol is on PATH and no batch supervisor is there, else exit. Under the kit's own batch scripts
    (`supervised`: hpc_ddp.launch.slurm.batch exported BATCH_VAR) the batch shell requeues after srun returns,
    so that one place decides about every end of an attempt. The local launcher says "launcher": its fake job
    id is no Slurm job."""
    if requeue_by == "scontrol":
        return "scontrol"
    if (
        requeue_by == "auto"
        and launcher == "slurm"
        and not supervised
        and scheduler.detect(launcher, requeue_by).can_requeue()
    ):
        return "scontrol"
    return "exit"


def supervisor(requeue_by: str, environ: Mapping[str, str]) -> str | None:
    """The kit's supervisor of this task's attempt: "launcher" (the local launcher, which says
    --requeue-by launcher), "batch" (a kit batch script: BATCH_VAR), or None (torchrun, a plain srun step)."""
    if requeue_by == "launcher":
        return "launcher"
    return "batch" if environ.get(BATCH_VAR) else None
