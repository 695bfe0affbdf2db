"""The supervisor core: how every supervisor of the kit ends an attempt, in one pipeline.

A *supervisor* is the process that outlives an attempt's tasks and decides what the job does next: the local
launcher (hpc_ddp.launch.local, after its ranks are gone) and the batch shell's steps around srun
(hpc_ddp.launch.slurm.batch: `end` after srun returns, `begin` for an attempt whose batch shell died). Both call
`end_attempt`, which

1. finds this attempt in attempts.jsonl (rank 0 wrote its start) or makes it up (it never started training),
2. judges the evidence (exit code, the ranks' exit notes, a hang verdict, the preemption record: judge.judge),
3. closes it (when, how far it got: the last step recorded, the latest checkpoint: judge.close),
4. decides once (hpc_ddp.ledger.decision.decide): both budgets, --max-restarts to failures, --max-requeue to
   preemptions, and the allocation's facts, which the supervisor gathers (`survey`) and never edits after,
5. records its end (Journal: a record that cannot be written now is kept and written later, and the decision
   never waits for it),

and returns the attempt as recorded and the decision. Each supervisor then acts in its own way (start the
ranks again, `scontrol requeue`, stop with `outcomes.exit_code`), and says it in one line (attempts.line).

Who requeues, and who applies --max-requeue: exactly one place per situation.

- A local run (`submit --local`): the launcher restarts its ranks. Its ranks are told `--requeue-by launcher`
  (their job id is fake): rank 0 only writes the facts (preempted.json) and exits PREEMPTED.
- A kit batch job (slurm/ddp.sbatch, or the job `submit` builds; the tasks see HPC_DDP_BATCH=1): the batch
  shell's `end` step requeues, after a preemption and after a failure. Rank 0 writes the facts only.
- A plain srun step without the kit's batch steps (a user's own sbatch script), `--requeue-by auto` with
  scontrol on PATH, or `--requeue-by scontrol` anywhere: rank 0 decides alone after the agreed save, applying
  --max-requeue, and requeues with scontrol (hpc_ddp.run.session); a kit batch step that finds such a record
  (mode "scontrol") keeps rank 0's decision and requeues nothing itself.
- A node failure: Slurm requeues the job itself (--requeue); `end` (or the next attempt's `begin`) records it
  and requeues nothing more, only excludes the blamed node.
- torchrun: its agent restarts the workers after a failure (torchrun --max-restarts); nobody requeues.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.ledger import attempts, decision, judge, rules
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.decision import Budgets as Budgets

if TYPE_CHECKING:
    from hpc_ddp.run.checkpoint.store import CheckpointStore

Writer = Callable[[Path, dict[str, Any]], None]


class Journal:
    """attempts.jsonl as a supervisor writes it. A record that cannot be written (a full disk, a folder gone
    read-only) is kept in memory, taken into account by `history` as if written, and written before the next
    one; `lost` says what is still unwritten, for the supervisor to say once at its end. Never raises.
    `write` is the seam a test replaces with a failing writer."""

    def __init__(self, checkpoints: CheckpointStore, write: Writer = attempts.append) -> None:
        self.folder = Path(checkpoints.folder)
        # The run's checkpoints and their storage (built once by the supervisor's process): `latest_step`.
        self.checkpoints = checkpoints
        self._write = write
        self.pending: list[dict[str, Any]] = []
        self.error = ""  # why the last write failed

    def history(self, job: str) -> list[Attempt]:
        """This job's attempts, the file's and the ones not written yet, in order."""
        return attempts.of_job(attempts.merge([*attempts.read_lines(self.folder), *self.pending]), job)

    def append(self, record: dict[str, Any]) -> bool:
        """Write what is pending, then `record`; False if it could not (then it is pending too)."""
        self.pending.append(record)
        while self.pending:
            try:
                self._write(self.folder, self.pending[0])
            except OSError as e:
                self.error = e.strerror or str(e)
                return False
            self.pending.pop(0)
        return True

    def flush(self) -> bool:
        """Try once more to write what is pending; True when nothing is left unwritten."""
        if not self.pending:
            return True
        record = self.pending.pop()
        return self.append(record)

    def lost(self) -> str:
        """'' when everything was written, else one line saying what was not, and why."""
        if not self.pending:
            return ""
        return (
            f"{len(self.pending)} record(s) could not be written to {attempts.path(self.folder)} "
            f"({self.error}); the decisions were made from them all the same, and the file lacks them"
        )


@dataclass(frozen=True)
class Closed:
    """An attempt's end, as `end_attempt` recorded it."""

    attempt: Attempt  # ended, with its outcome, decision and the nodes to exclude
    decision: rules.Decision
    ending: judge.Ending
    recorded: bool  # written to attempts.jsonl now (else kept in the Journal, or not worth recording)

    @property
    def line(self) -> str:
        return attempts.line(self.attempt, self.decision.said)


# The allocation's facts about an attempt as it ended, gathered by its supervisor: called once, with the attempt
# as judged and the nodes blamed in the job so far (what a next start would leave out).
Survey = Callable[[Attempt, tuple[str, ...]], decision.Facts]


def end_attempt(
    journal: Journal,
    job: str,
    restart: int,
    found: judge.Evidence | judge.Ending,
    budgets: Budgets,
    began: float,
    checkpoint: int | None,
    now: float | None = None,
    survey: Survey | None = None,
    exclude: Callable[[rules.Decision], Sequence[str]] | None = None,
    nodes: Sequence[str] = (),
) -> Closed:
    """Find, judge, close, decide, record (see the module docstring). `found` is the evidence, or an ending
    the supervisor knows without judging (its stop ran out of time); `began` is when the attempt began (the
    steps recorded since then are its own); `checkpoint` the step of the latest checkpoint (the caller's:
    the checkpoint layout is the run layer's). `survey` gathers what only the supervisor knows (a stop it was
    asked for, its allocation's nodes and spares, the usable nodes left): the decision's facts; `exclude` what it records
    as excluded (default: the decision's); `nodes` the step's nodes as the supervisor placed it, recorded for an
    attempt whose ranks never wrote their start (killed while they started: else it reads "on ?")."""
    history = journal.history(job)
    this = attempts.find(history, job, restart) or Attempt(job, restart, number=len(history) + 1)
    before = [a for a in history if a.key != this.key and a.number < this.number]
    ending = judge.judge(found) if isinstance(found, judge.Evidence) else found
    ending = judge.follow(before, ending)  # an error that follows the job from node to node is the code's
    closed = judge.close(this, ending, step_reached(journal.folder, began), checkpoint, now or time.time())
    facts = survey(closed, rules.blamed_nodes([*before, closed])) if survey is not None else decision.Facts()
    decided = decision.decide(
        before, closed, budgets, facts, retryable=ending.retryable, decided=ending.decided
    )
    listed = tuple(exclude(decided)) if exclude is not None else decided.exclude
    final = replace(
        closed,
        nodes=closed.nodes or tuple(nodes),
        decision=decided.action,
        exclude=listed,
        left=decided.left,
        spares_in=decided.spares_in,
    )
    recorded = journal.append(attempts.end_record(final)) if attempts.worth_recording(final) else False
    return Closed(final, decided, ending, recorded)


def step_reached(folder: Path, since: float) -> int | None:
    """The last step rank 0 finished since `since` (epoch seconds): where an attempt got to, also when it died
    between two progress records (hpc_ddp.run.records.reached owns the answer; no torch)."""
    from hpc_ddp.run.records.reached import step_reached as reached

    return reached(folder, since)


def latest_step(checkpoints: CheckpointStore) -> int | None:
    """The step of the run's latest checkpoint, without torch, read through the run's storage: the checkpoint
    store's own rule (a file or a `ckpt-<step>/` directory, its `latest` pointer, else the newest complete one)."""
    return checkpoints.latest_step()


def resume_step(checkpoints: CheckpointStore, job: str, environ: Mapping[str, str]) -> int | None:
    """Where a restart of `job` resumes from, as far as this machine can tell: the newer of the run's latest
    checkpoint and the newest snapshot in memory every rank has (--snapshot-every-steps; issue 45). The input
    the restart decision takes as the attempt's `checkpoint` (a crash loop is one without a newer one)."""
    from hpc_ddp.run.snapshot import store as memory

    disk = latest_step(checkpoints)
    snapshot = memory.newest_reachable(memory.root(environ), job, memory.run_key(checkpoints.folder))
    if snapshot is None or (disk is not None and disk >= snapshot):
        return disk
    return snapshot
