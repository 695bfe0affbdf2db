"""What the kit asks of a scheduler, as one interface (`Scheduler`), and the words every scheduler answers in.

| the kit asks                   | method                            | Slurm (`scheduler/slurm`)            | the local emulation (`scheduler/local`) |
|--------------------------------|-----------------------------------|--------------------------------------|-----------------------------------------|
| who am I                       | `identity(environ)`               | SLURM_JOB_ID, SLURM_RESTART_COUNT... | the same variables, emulated            |
| requeue me                     | `requeue(job)`                    | `scontrol requeue`                   | none: its launcher starts the ranks again |
| what happened to job J         | `runs(job)`, `queued(jobs)`       | `sacct -D`, `squeue`                 | nothing: no queue, no accounting        |
| which nodes are usable         | `usable(exclude, partition)`      | `sinfo`                              | every emulated node                     |
| submit                         | `submit(submission)`              | `sbatch`, through submitit           | none: `submit --local` runs the job here |
| cancel                         | `cancel(job, signal)`             | `scancel`                            | none                                    |
| exclude                        | `requeue_excluding(job, nodes)`   | `scontrol requeuehold/update/release` | recorded only (attempts.jsonl)          |
| its version                    | `version()`                       | `scontrol --version`                 | none                                    |
| is it mine                     | `detect(launcher, requeue_by)`    | every task but the local launcher's  | the local launcher's ranks              |
| what its step launcher said    | `step_end(lines)`                 | srun's own lines ("task 1: Killed")  | nothing: the launcher saw its ranks     |
| which nodes a run lost         | `lost(job, nodes, said, restart)` | srun's word, NodeList, sinfo's state | what was said only                      |

An action never raises for what the scheduler did not do: it answers `Done(ok, message)`; a question it cannot
answer is None (or empty), and the caller asks again or goes without.

The scheduler of a process is chosen by the registry (hpc_ddp.scheduler.detect: each registered class's
`detect`, in the registry's order, from what hpc_ddp.cluster.env.detect found); `run/`, `report/`, `doctor/`
and `launch/rerun` ask this interface only and never name a scheduler (tests/test_architecture.py). The Slurm
supervisors (hpc_ddp.launch.slurm: the batch shell's steps, `submit --wait`) read srun's lines, the lost nodes
and the usable nodes left (sinfo's fit) through it too, and the controller's and accounting's whole view of a
job from the Slurm client itself (hpc_ddp.scheduler.slurm.parse).

A restart inside the allocation (`--spare-nodes`: a new step on the allocation's nodes after a failure) is the
batch shell's, on Slurm's own terms: the step started on given nodes is hpc_ddp.scheduler.slurm.steps (srun's
variables and host file), the nodes hpc_ddp.launch.spares chooses among the job's (`identity(environ).nodes`),
and the decision to start again stays the ledger's (hpc_ddp.ledger.decision).

Job ids are text: "123", an array task "123_4", a heterogeneous job's component "123+0" (`is_job_id`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+|\+[0-9]+)?")


def is_job_id(text: str) -> bool:
    """A scheduler's job id: "123", an array task "123_4", a het job's component "123+0" (pure). A local run's
    fake id is one too (a number): whether a job id is the scheduler's is for its answers to say."""
    return _JOB_ID.fullmatch(text) is not None


class Kind(enum.Enum):
    """What a job's state means for someone following the job, whatever the scheduler's word for it."""

    PENDING = "pending"  # waiting for resources or its begin time; starts by itself
    HELD = "held"  # pending, but starts only once released (scontrol release, a new reservation)
    REQUEUED = "requeued"  # this run is over and the job goes back to pending
    RUNNING = "running"  # has an allocation (running, suspended, being set up or resized)
    COMPLETING = "completing"  # over, but processes may still run on some nodes (KillWait, epilog, stage-out)
    SUCCESS = "success"  # over: every process exited 0
    FAILURE = "failure"  # over: otherwise (an error, a signal, the scheduler ended it)
    UNKNOWN = "unknown"  # a word the scheduler's table lacks ("?" or a newer version's): treated as not over

    @property
    def terminal(self) -> bool:
        return self in (Kind.SUCCESS, Kind.FAILURE)

    @property
    def waiting(self) -> bool:
        """Pending, held or on its way back to pending: no allocation now, one to come (maybe)."""
        return self in (Kind.PENDING, Kind.HELD, Kind.REQUEUED)


class End(enum.Enum):
    """How a run ended, in neutral words: by its own processes, or by the scheduler (and why)."""

    EXITED = "exited"  # its processes exited: 0 everywhere is a success, anything else the job's own failure
    OUT_OF_MEMORY = "out of memory"  # a process hit the memory limit (the kernel's kill: the job's own)
    TIME_LIMIT = "time limit"
    CANCELLED = "cancelled"  # by the user or an administrator
    DEADLINE = "deadline"
    NODE_FAILURE = "node failure"
    PREEMPTED = "preempted"  # by the scheduler, for another job
    BOOT_FAILURE = "boot failure"
    REVOKED = "revoked"  # a sibling started on another cluster (a federation)


@dataclass(frozen=True)
class Window:
    """When one run of a job started and ended, as the scheduler's accounting says (seconds since the epoch;
    `end` None while it runs)."""

    start: float
    end: float | None


@dataclass(frozen=True)
class Identity:
    """Who a process of a job is, as its scheduler's variables say (`Scheduler.identity`)."""

    job: str  # the job id ("" outside a job)
    restart: int  # which start of the job this is, 0 the first
    nodes: tuple[str, ...]  # its step's nodes (the job's allocation outside a step), in the scheduler's order
    node: str = ""  # this process's node, as the scheduler names it ("" when not said)


@dataclass(frozen=True)
class Done:
    """What an action did: whether every step of it worked, and the line that says so."""

    ok: bool
    message: str


@dataclass(frozen=True)
class StepEnd:
    """What the step launcher said of a step as it ended (`Scheduler.step_end`), in neutral words."""

    killed: tuple[
        tuple[int, str], ...
    ] = ()  # (rank, signal name) of tasks killed by a signal, when that came first
    ends: tuple[
        tuple[int, str], ...
    ] = ()  # every task end it reported, in its order: (rank, signal or "exit C")
    failed_nodes: tuple[str, ...] = ()  # nodes it said failed under the step, first first
    refused: str = ""  # the one line saying which of its options it refused before any task ran ('' none)
    first_exit: int | None = None  # the exit code of the first task that exited on its own (None: not said)


@dataclass(frozen=True)
class Size:
    """A job's size: `nodes` nodes, `tasks` tasks in all (a requeued job that goes on with fewer nodes)."""

    nodes: int
    tasks: int


class Scheduler(Protocol):
    """The interface (see the module docstring). Implementations: hpc_ddp.scheduler.slurm.client.SlurmClient
    and hpc_ddp.scheduler.local.LocalScheduler; `hpc_ddp.scheduler.of(name)` gives one."""

    name: str

    @classmethod
    def detect(cls, launcher: str, requeue_by: str) -> bool:
        """Whether this scheduler runs a process that hpc_ddp.cluster.env.detect found under `launcher`
        ("slurm", "torchrun", "single") and was told --requeue-by `requeue_by` (the registry asks each in turn)."""
        ...

    def identity(self, environ: Mapping[str, str]) -> Identity:
        """Who am I: the job, its restart count, its nodes and this process's node, from `environ`."""
        ...

    def version(self) -> str | None:
        """The scheduler's version ("22.05.8"), or None when there is none to ask."""
        ...

    def requeue(self, job: str) -> Done:
        """Requeue `job` (rank 0 alone, after the agreed save, where no supervisor of the kit decides)."""
        ...

    def can_requeue(self) -> bool:
        """Whether `requeue` can work from here at all (the command exists)."""
        ...

    def runs(self, job: str) -> list[Window] | None:
        """What happened to `job`: when each of its runs started and ended, oldest first (None: no answer)."""
        ...

    def queued(self, jobs: Sequence[str]) -> dict[str, tuple[Any, str]] | None:
        """The jobs still queued or running: {id: (state, why it pends)}; None when the scheduler did not answer."""
        ...

    def usable(self, exclude: Sequence[str] = (), partition: str = "") -> list[str]:
        """The nodes a job could run on now: not excluded, not down, drained or failed."""
        ...

    def submit(self, submission: Any, call: Any) -> str:
        """Submit a job built for this scheduler (its own submission: hpc_ddp.scheduler.slurm.submit) whose
        every task runs `call`; the job id."""
        ...

    def cancel(self, job: str, signal: str = "") -> Done:
        """Cancel `job`, or only send its tasks `signal`."""
        ...

    def requeue_excluding(
        self,
        job: str,
        exclude: Sequence[str],
        excluded: Sequence[str] = (),
        already: bool = False,
        size: Size | None = None,
    ) -> Done:
        """Requeue `job` (unless the scheduler did: `already`) so that it avoids `exclude`, on `size` if given."""
        ...

    def step_end(self, lines: Sequence[str]) -> StepEnd:
        """What the step launcher's own `lines` (a batch log's, from the step's start) say of the step."""
        ...

    def lost(
        self, job: str, nodes: Sequence[str], said: Sequence[str], restart: int, view: Any = None
    ) -> tuple[str, ...]:
        """The nodes of `job`'s run `restart` on `nodes` that were lost: those `said` failed (`step_end`), those
        the scheduler removed from the job, those whose state says failed. `view`: the scheduler's own view of
        the job, as the caller asked for it (None: no answer)."""
        ...
