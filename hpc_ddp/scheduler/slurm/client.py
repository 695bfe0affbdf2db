"""The one Slurm client: every Slurm command the kit runs goes through `SlurmClient.call`, and every answer
through one parser (hpc_ddp.scheduler.slurm.parse) and one state table (hpc_ddp.scheduler.slurm.states).
It is the Slurm implementation of the scheduler interface (hpc_ddp.scheduler.base.Scheduler), plus the
questions only Slurm's own supervisors ask (the controller's and accounting's whole view of a job, a
partition's nodes, the held requeue that excludes nodes). sbatch runs through submitit
(hpc_ddp.scheduler.slurm.submit), which this client hands a submission to.

The client is an argument: `submit --wait` (hpc_ddp.launch.slurm.follow) and the batch shell's steps take
one, and tests give them one over a fake cluster (tests/fake_slurm.py) that answers as Slurm 22.05 does and
counts what it was asked. A command that fails, times out or is missing is no answer (None), never an
exception: the callers ask again at their next look, or go without.

Load. The controller (scontrol, squeue) answers from memory; accounting (sacct) asks slurmdbd's database,
which every user's `--wait` shares. One `sacct -D` answers for every run of any number of jobs at once
(`histories`), so a follower asks it once per look, whatever the attempts.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hpc_ddp import proc
from hpc_ddp.scheduler.base import Done, Identity, Size, StepEnd, Window
from hpc_ddp.scheduler.slurm import env, states
from hpc_ddp.scheduler.slurm.lost import lost_nodes
from hpc_ddp.scheduler.slurm.parse import (
    RUN_FIELDS,
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    JobHistory,
    JobInfo,
    first_exit,
    parse_job,
    parse_sacct,
    parse_sinfo,
    parse_squeue,
    srun_deaths,
    srun_node_failures,
    srun_refusal,
    srun_task_ends,
)
from hpc_ddp.scheduler.slurm.states import JobState

if TYPE_CHECKING:
    from hpc_ddp.scheduler.slurm.submit import Submission

__all__ = ["Done", "Identity", "Size", "SlurmClient", "requeue_steps"]

TIMEOUT_S = 30.0  # a controller that does not answer within this is busy: ask again later
VERSION_TIMEOUT_S = 5.0  # `scontrol --version` answers without the controller: a slow one is no answer
Runner = Callable[[Sequence[str], float], proc.Output]


def _run(argv: Sequence[str], timeout_s: float) -> proc.Output:
    return proc.run(argv, timeout_s=timeout_s)


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

    name = "slurm"

    def __init__(self, runner: Runner = _run, timeout_s: float = TIMEOUT_S) -> None:
        self.runner, self.timeout_s = runner, timeout_s

    def call(self, *argv: str, timeout_s: float | None = None) -> proc.Output:
        """Run one Slurm command: its output, or why there is none."""
        return self.runner(argv, self.timeout_s if timeout_s is None else timeout_s)

    def _text(self, *argv: str) -> str | None:
        out = self.call(*argv)
        return out.stdout if out.ok else None

    # ----- the scheduler interface (hpc_ddp.scheduler.base) ----------------------------------------------

    @classmethod
    def detect(cls, launcher: str, requeue_by: str) -> bool:
        # Every task but the local launcher's: a task outside Slurm asks it nothing, or gets no answer.
        return requeue_by != "launcher"

    def identity(self, environ: Mapping[str, str]) -> Identity:
        return env.identity(environ)

    def step_end(self, lines: Sequence[str]) -> StepEnd:
        """srun's own lines of a step: who was killed, every task end, the nodes it said failed, an option it
        refused, the first exit (hpc_ddp.scheduler.slurm.parse)."""
        return StepEnd(
            killed=srun_deaths(lines),
            ends=srun_task_ends(lines),
            failed_nodes=srun_node_failures(lines),
            refused=srun_refusal(lines),
            first_exit=first_exit(lines),
        )

    def lost(
        self, job: str, nodes: Sequence[str], said: Sequence[str], restart: int, view: Any = None
    ) -> tuple[str, ...]:
        """srun's word, the nodes Slurm removed from the job (its NodeList, in `view`: `job(job)`'s answer as
        the caller asked it), and the nodes sinfo says failed (hpc_ddp.scheduler.slurm.lost)."""
        return lost_nodes(nodes, said, view, self.nodes(), restart)

    def version(self) -> str | None:
        """Slurm's version ("22.05.8"), or None when scontrol does not say."""
        out = self.call("scontrol", "--version", timeout_s=VERSION_TIMEOUT_S)  # "slurm 22.05.8"
        words = out.stdout.split() if out.ok else []
        return words[-1] if words else None

    def can_requeue(self) -> bool:
        return shutil.which("scontrol") is not None

    def requeue(self, job: str) -> Done:
        out = self.call("scontrol", "requeue", job)
        return Done(True, f"requeued job {job}") if out.ok else Done(False, out.error)

    def runs(self, job: str) -> list[Window] | None:
        """When each run of `job` held its nodes (its n-th window is restart n's); None when sacct did not
        answer. An array task ("123_4") is a job of its own."""
        text = self._text("sacct", "-X", "-D", "-n", "-P", "-o", ",".join(RUN_FIELDS), "-j", job)
        if text is None:
            return None
        history = parse_sacct(text, RUN_FIELDS).get(job)
        return history.windows if history is not None else []

    def queued(self, jobs: Sequence[str]) -> dict[str, tuple[JobState, str]] | None:
        return self.queue(jobs)

    def usable(self, exclude: Sequence[str] = (), partition: str = "") -> list[str]:
        return states.usable(self.nodes(partition), exclude)

    def submit_array(
        self, submission: Submission, calls: list[object], parallel: int, after: str | None = None
    ) -> list[str]:
        """sbatch one job array, element i running `calls[i]`, once the job `after` has ended if given: each
        element's id (Submission.submit_array)."""
        return submission.submit_array(calls, parallel, after)

    def submit(self, submission: Submission, call: object) -> str:
        """sbatch the job whose every task runs `call` (through submitit, which runs sbatch itself); its id.
        Raises UsageError when sbatch refuses it (its reason in one line)."""
        return submission.submit(call)

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

    def max_array_size(self) -> int | None:
        """The site's MaxArraySize (`scontrol show config`): a job array's indexes stay below it; None when
        scontrol did not answer or does not say."""
        text = self._text("scontrol", "show", "config") or ""
        found = re.search(r"^MaxArraySize\s*=\s*(\d+)", text, re.MULTILINE)
        return int(found.group(1)) if found else None

    def queue_elements(self, job_ids: Sequence[str]) -> dict[str, tuple[JobState, str]] | None:
        """As `queue`, every element of a job array on its own line (`squeue -r`: ARRAY_INDEX; a pending
        array's elements too)."""
        text = self._text("squeue", "-h", "-r", "-o", SQUEUE_FORMAT, "-j", ",".join(job_ids))
        return parse_squeue(text) if text is not None else None

    def nodes(self, partition: str = "") -> dict[str, str]:
        """{node: sinfo's short state}, of one partition or all; {} when sinfo did not answer."""
        argv = ["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])]
        return parse_sinfo(self._text(*argv) or "")

    # ----- actions -----------------------------------------------------------------------------------------

    def requeue_hold(self, job: str) -> proc.Output:
        return self.call("scontrol", "requeuehold", job)

    def hold(self, job: str) -> proc.Output:
        return self.call("scontrol", "hold", job)

    def release(self, job: str) -> proc.Output:
        return self.call("scontrol", "release", job)

    def exclude(self, job: str, nodes: Sequence[str]) -> proc.Output:
        """Set the nodes the job must not run on (replaces the list; "" clears it). Refused while it runs."""
        return self.call("scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}")

    def set_node(self, node: str, state: str, reason: str = "hpc_ddp") -> proc.Output:
        """Set a node's state (DOWN, DRAIN, RESUME): an administrator's action, which the recovery bench
        (hpc_ddp.bench.recovery) takes on the local test cluster to fail a node under a running job."""
        why = [f"Reason={reason}"] if state.upper() != "RESUME" else []
        return self.call("scontrol", "update", f"NodeName={node}", f"State={state}", *why)

    def cancel(self, job: str, signal: str = "") -> Done:
        """scancel the job, or only send it `signal` (e.g. "USR2": every step's tasks)."""
        out = self.call("scancel", *([f"--signal={signal}"] if signal else []), job)
        return Done(True, f"cancelled job {job}") if out.ok else Done(False, out.error)

    def requeue_excluding(
        self,
        job: str,
        exclude: Sequence[str],
        excluded: Iterable[str] = (),
        already: bool = False,
        size: Size | None = None,
    ) -> Done:
        """Requeue the job (unless Slurm did) so that it will not run on `exclude`, on `size` if given
        (`requeue_steps`). A step that fails stops the sequence, and the job is released: never left held."""
        listed = ",".join(exclude)
        for argv in requeue_steps(job, exclude, excluded, already, size):
            out = self.call(*argv)
            if not out.ok:
                if argv[1] != "release":
                    self.release(job)
                return Done(False, f"{' '.join(argv)} failed: {out.error}")
        smaller = f" on {size.nodes} node(s), {size.tasks} task(s)" if size is not None else ""
        if exclude:
            return Done(
                True,
                f"requeued job {job}{smaller}; it will not run on {listed} (clear that with: scontrol update "
                f"JobId={job} ExcNodeList=)",
            )
        return Done(True, f"requeued job {job}" if not already else f"job {job} was requeued by Slurm")
