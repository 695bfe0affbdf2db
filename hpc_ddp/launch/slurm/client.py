"""The one Slurm client: every Slurm command the kit runs goes through `SlurmClient.call`, and every answer
through one parser (hpc_ddp.launch.slurm.parse) and one state table (hpc_ddp.launch.slurm.states).

The client is an argument: `submit --wait` (hpc_ddp.launch.slurm.follow) and the batch shell's steps take
one, and tests give them one over a fake cluster (tests/fake_slurm.py) that answers as Slurm 22.05 does and
counts what it was asked. A command that fails, times out or is missing is no answer (None), never an
exception: the callers ask again at their next look, or go without.

Load. The controller (scontrol, squeue) answers from memory; accounting (sacct) asks slurmdbd's database,
which every user's `--wait` shares. One `sacct -D` answers for every run of any number of jobs at once
(`histories`), so a follower asks it once per look, whatever the attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hpc_ddp import proc
from hpc_ddp.launch.slurm.parse import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    JobHistory,
    JobInfo,
    parse_job,
    parse_sacct,
    parse_sinfo,
    parse_squeue,
)
from hpc_ddp.launch.slurm.states import JobState

TIMEOUT_S = 30.0  # a controller that does not answer within this is busy: ask again later
Runner = Callable[[Sequence[str], float], proc.Output]


def _run(argv: Sequence[str], timeout_s: float) -> proc.Output:
    return proc.run(argv, timeout_s=timeout_s)


@dataclass(frozen=True)
class Requeue:
    """What `requeue_excluding` did: whether every step worked, and the line to tell."""

    ok: bool
    message: str


@dataclass(frozen=True)
class Size:
    """A smaller size for a requeued job (--min-nodes): `nodes` nodes, `tasks` tasks in all."""

    nodes: int
    tasks: int


def requeue_steps(
    job: str, exclude: Sequence[str], excluded: Iterable[str], already: bool, size: Size | None = None
) -> list[tuple[str, ...]]:
    """The scontrol commands that requeue `job` (unless Slurm did: `already`) so that it will not run on
    `exclude` (pure). Slurm 22.05 refuses ExcNodeList on a running job, so a job with nodes to exclude is
    requeued held, updated, then released; one Slurm already requeued is held first, unless every node to
    exclude is excluded already (`excluded`). With `size`, the same update lowers the job's node and task
    counts: Slurm keeps the ones of its first start (even for `--nodes=M-N`: a requeued 1-2 job that ran on 2
    nodes pends with BadConstraints once one is left, measured on 22.05), and NumNodes alone is held up by
    the task count."""
    new = set(exclude) - set(excluded)
    change = bool(exclude) and (bool(new) or not already) or size is not None
    steps: list[tuple[str, ...]] = []
    if already and change:
        steps = [("scontrol", "hold", job)]
    elif not already:
        steps = [("scontrol", "requeuehold" if change else "requeue", job)]
    if change:
        update = [f"ExcNodeList={','.join(exclude)}"] if exclude else []
        if size is not None:
            update += [f"NumNodes={size.nodes}", f"NumTasks={size.tasks}"]
        steps += [("scontrol", "update", f"JobId={job}", *update), ("scontrol", "release", job)]
    return steps


class SlurmClient:
    """Slurm's commands as questions and actions. `runner(argv, timeout_s)` runs one command (the default:
    hpc_ddp.proc.run); tests pass a fake cluster."""

    def __init__(self, runner: Runner = _run, timeout_s: float = TIMEOUT_S) -> None:
        self.runner, self.timeout_s = runner, timeout_s

    def call(self, *argv: str) -> proc.Output:
        """Run one Slurm command: its output, or why there is none."""
        return self.runner(argv, self.timeout_s)

    def _text(self, *argv: str) -> str | None:
        out = self.call(*argv)
        return out.stdout if out.ok else None

    # ----- questions -------------------------------------------------------------------------------------

    def job(self, job_id: str) -> JobInfo | None:
        """The controller's view of the job; `JobInfo(gone=True)` when it no longer knows the job (ended
        longer ago than MinJobAge), None when it did not answer."""
        out = self.call("scontrol", "show", "job", "-o", job_id)
        if not out.ok:
            return JobInfo(gone=True) if "Invalid job id" in out.error + out.stdout else None
        return parse_job(out.stdout)

    def histories(self, job_ids: Sequence[str]) -> dict[str, JobHistory] | None:
        """Every run of each job, from one accounting query; None when sacct did not answer (no accounting
        on this cluster, slurmdbd down). A job accounting has not recorded yet is missing."""
        fields = ",".join(SACCT_FIELDS)
        text = self._text("sacct", "-X", "-D", "-n", "-P", "-o", fields, "-j", ",".join(job_ids))
        return parse_sacct(text) if text is not None else None

    def history(self, job_id: str) -> JobHistory | None:
        return (self.histories([job_id]) or {}).get(job_id)

    def queue(self, job_ids: Sequence[str]) -> dict[str, tuple[JobState, str]] | None:
        """The jobs still in the controller's queue (pending, running, completing): {id: (state, reason)}."""
        text = self._text("squeue", "-h", "-o", SQUEUE_FORMAT, "-j", ",".join(job_ids))
        return parse_squeue(text) if text is not None else None

    def nodes(self, partition: str = "") -> dict[str, str]:
        """{node: sinfo's short state}, of one partition or all; {} when sinfo did not answer."""
        argv = ["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])]
        return parse_sinfo(self._text(*argv) or "")

    # ----- actions -----------------------------------------------------------------------------------------

    def requeue(self, job: str) -> proc.Output:
        return self.call("scontrol", "requeue", job)

    def requeue_hold(self, job: str) -> proc.Output:
        return self.call("scontrol", "requeuehold", job)

    def hold(self, job: str) -> proc.Output:
        return self.call("scontrol", "hold", job)

    def release(self, job: str) -> proc.Output:
        return self.call("scontrol", "release", job)

    def exclude(self, job: str, nodes: Sequence[str]) -> proc.Output:
        """Set the nodes the job must not run on (replaces the list; "" clears it). Refused while it runs."""
        return self.call("scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}")

    def cancel(self, job: str, signal: str = "") -> proc.Output:
        """scancel the job, or only send it `signal` (e.g. "USR2": every step's tasks)."""
        return self.call("scancel", *([f"--signal={signal}"] if signal else []), job)

    def requeue_excluding(
        self,
        job: str,
        exclude: Sequence[str],
        excluded: Iterable[str] = (),
        already: bool = False,
        size: Size | None = None,
    ) -> Requeue:
        """Requeue the job (unless Slurm did) so that it will not run on `exclude`, on `size` if given
        (`requeue_steps`). A step that fails stops the sequence, and the job is released: never left held."""
        listed = ",".join(exclude)
        for argv in requeue_steps(job, exclude, excluded, already, size):
            out = self.call(*argv)
            if not out.ok:
                if argv[1] != "release":
                    self.release(job)
                return Requeue(False, f"{' '.join(argv)} failed: {out.error}")
        smaller = f" on {size.nodes} node(s), {size.tasks} task(s)" if size is not None else ""
        if exclude:
            return Requeue(
                True,
                f"requeued job {job}{smaller}; it will not run on {listed} (clear that with: scontrol update "
                f"JobId={job} ExcNodeList=)",
            )
        return Requeue(True, f"requeued job {job}" if not already else f"job {job} was requeued by Slurm")
