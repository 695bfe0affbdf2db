"""One parser for each Slurm command's output the kit reads (pure: text in, typed answer out).

| command (hpc_ddp.launch.slurm.client)        | parser          | answer                          |
|----------------------------------------------|-----------------|---------------------------------|
| `scontrol show job -o ID`                    | `parse_job`     | `JobInfo` (the controller's)    |
| `sacct -X -D -n -P -o <SACCT_FIELDS> -j IDs` | `parse_sacct`   | {job id: `JobHistory`}          |
| `squeue -h -o <SQUEUE_FORMAT> -j IDs`        | `parse_squeue`  | {job id: (`JobState`, reason)}  |
| `sinfo -h -N -o "%N %t"`                     | `parse_sinfo`   | {node: state}                   |

A parser never raises on what a command printed: text it cannot read is no answer (None or an empty
mapping), and the caller asks again later.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpc_ddp.cluster.hostlist import expand
from hpc_ddp.launch.slurm.states import JobState, Kind, exit_pair, state_word

SACCT_FIELDS = ("JobID", "State", "ExitCode", "Reason")
SQUEUE_FORMAT = "%i|%T|%r"
_FIELD = re.compile(r"(\w+)=(\S*)")


def hosts(text: str) -> tuple[str, ...]:
    """A node list as Slurm prints it ("node[1-3]", "(null)", "") -> host names (pure)."""
    if not text or text in ("(null)", "None"):
        return ()
    try:
        return tuple(expand(text))
    except ValueError:
        return tuple(h for h in text.split(",") if h)


@dataclass(frozen=True)
class JobInfo:
    """The controller's view of a job (`scontrol show job -o`): its key=value fields, and the ones the kit
    reads, typed. `gone`: the controller no longer knows the job (it ended longer ago than MinJobAge)."""

    fields: Mapping[str, str] = field(default_factory=dict)
    gone: bool = False

    @property
    def state(self) -> JobState:
        return JobState(
            state_word(self.fields.get("JobState", "")), *exit_pair(self.fields.get("ExitCode", ""))
        )

    @property
    def restarts(self) -> int:
        """How many times the job was requeued (Slurm's SLURM_RESTART_COUNT of its next run)."""
        text = self.fields.get("Restarts", "0")
        return int(text) if text.isdigit() else 0

    @property
    def num_nodes(self) -> int:
        """The nodes it has, or asks for ("2-2": at least 2). While Slurm requeues a job it is COMPLETING, and
        NumNodes counts only the nodes still completing: the size asked for comes from the submission."""
        text = self.fields.get("NumNodes", "").split("-")[0]
        return int(text) if text.isdigit() else 0

    @property
    def excluded(self) -> tuple[str, ...]:
        return hosts(self.fields.get("ExcNodeList", ""))

    @property
    def nodes(self) -> tuple[str, ...]:
        return hosts(self.fields.get("NodeList", ""))

    @property
    def batch_host(self) -> str:
        """The node the batch script runs on (the job's first)."""
        return self.fields.get("BatchHost", "")

    @property
    def partition(self) -> str:
        return self.fields.get("Partition", "")

    @property
    def reason(self) -> str:
        return self.fields.get("Reason", "")


def parse_job(text: str) -> JobInfo | None:
    """`scontrol show job -o ID` -> its fields; None without a JobState (an error, no such job)."""
    fields = dict(_FIELD.findall(text))
    return JobInfo(fields) if "JobState" in fields else None


@dataclass(frozen=True)
class JobHistory:
    """Every run of one job as accounting recorded it (`sacct -D`: one record per start), oldest first."""

    runs: tuple[JobState, ...]
    reason: str = ""  # the current run's Reason (why it is pending)

    @property
    def current(self) -> JobState:
        return self.runs[-1]

    @property
    def restarts(self) -> int:
        """Requeues so far: every run before the current one ended in a requeue, and a current run that says
        REQUEUED is one more (its next record is not written yet). A last run that ended NODE_FAIL or
        PREEMPTED may be requeued too: only the controller knows yet."""
        return len(self.runs) - 1 + (self.current.kind is Kind.REQUEUED)


def parse_sacct(text: str) -> dict[str, JobHistory]:
    """`sacct -X -D -n -P -o JobID,State,ExitCode,Reason -j IDs` -> {job id: its history}.

    A RESIZING record is no run: Slurm writes one when a job changes size (under --no-kill, a failed node
    removed from it) and the run goes on in the next record. (Slurm 22.05 then writes no REQUEUED record for
    a requeue of that run: the controller's Restarts counts requeues, accounting may count fewer.)"""
    runs: dict[str, list[JobState]] = {}
    reasons: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 3 or not parts[0] or not state_word(parts[1]) or state_word(parts[1]) == "RESIZING":
            continue
        runs.setdefault(parts[0], []).append(JobState(state_word(parts[1]), *exit_pair(parts[2])))
        reasons[parts[0]] = parts[3] if len(parts) > 3 else ""
    return {job: JobHistory(tuple(states), reasons[job]) for job, states in runs.items()}


def parse_squeue(text: str) -> dict[str, tuple[JobState, str]]:
    """`squeue -h -o "%i|%T|%r" -j IDs` -> {job id: (state, reason)} for the jobs still in the queue."""
    jobs: dict[str, tuple[JobState, str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0] and state_word(parts[1]):
            jobs[parts[0]] = (JobState(state_word(parts[1])), parts[2] if len(parts) > 2 else "")
    return jobs


def parse_sinfo(text: str) -> dict[str, str]:
    """`sinfo -h -N -o "%N %t"` -> {node: state} (a node in two partitions is listed twice)."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0]] = parts[1]
    return states
