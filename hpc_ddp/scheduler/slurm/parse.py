"""One parser for each Slurm command's output the kit reads (pure: text in, typed answer out).

| command (hpc_ddp.scheduler.slurm.client)     | parser          | answer                          |
|----------------------------------------------|-----------------|---------------------------------|
| `scontrol show job -o ID`                    | `parse_job`     | `JobInfo` (the controller's)    |
| `sacct -X -D -n -P -o <fields> -j IDs`       | `parse_sacct`   | {job id: `JobHistory`}          |
| `squeue -h -o <SQUEUE_FORMAT> -j IDs`        | `parse_squeue`  | {job id: (`JobState`, reason)}  |
| `sinfo -h -N -o "%N %t"`                     | `parse_sinfo`   | {node: state}                   |
| srun's own lines in the batch log            | `srun_task_ends`, `srun_deaths`, `srun_refusal`, `first_exit`, `srun_node_failures` |                |

A parser never raises on what a command printed: text it cannot read is no answer (None or an empty
mapping), and the caller asks again later. Job ids are kept as Slurm prints them: an array task's "123_4"
is its own key.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpc_ddp.cluster.hostlist import expand
from hpc_ddp.scheduler.base import Kind, Window
from hpc_ddp.scheduler.slurm.states import JobState, exit_pair, state_word

# What the supervisors ask accounting for each run; the report asks when each run held its nodes
# (RUN_FIELDS). One parser reads either, by the fields' names.
SACCT_FIELDS = ("JobID", "State", "ExitCode", "Reason")
RUN_FIELDS = ("JobID", "Submit", "Start", "End", "State")
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
    times: tuple[tuple[float | None, float | None], ...] = ()  # each run's (Start, End), when sacct said

    @property
    def windows(self) -> list[Window]:
        """When each run that started held its nodes, oldest start first: the n-th is restart n's."""
        started = [Window(start, end) for start, end in self.times if start is not None]
        return sorted(started, key=lambda w: w.start)

    @property
    def current(self) -> JobState:
        return self.runs[-1]

    @property
    def restarts(self) -> int:
        """Requeues so far: every run before the current one ended in a requeue, and a current run that says
        REQUEUED is one more (its next record is not written yet). A last run that ended NODE_FAIL or
        PREEMPTED may be requeued too: only the controller knows yet."""
        return len(self.runs) - 1 + (self.current.kind is Kind.REQUEUED)


def parse_sacct(text: str, fields: Sequence[str] = SACCT_FIELDS) -> dict[str, JobHistory]:
    """`sacct -X -D -n -P -o <fields> -j IDs` (SACCT_FIELDS, RUN_FIELDS: JobID and State at least) -> {job id:
    its history}. A field not asked for reads as Slurm's default (exit code 0:0, no reason, no time).

    A RESIZING record is no run: Slurm writes one when a job changes size (under --no-kill, a failed node
    removed from it) and the run goes on in the next record. (Slurm 22.05 then writes no REQUEUED record for
    a requeue of that run: the controller's Restarts counts requeues, accounting may count fewer.)"""
    runs: dict[str, list[JobState]] = {}
    times: dict[str, list[tuple[float | None, float | None]]] = {}
    reasons: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        row = dict(zip(fields, parts, strict=False))  # a short row: the rest is not said
        job, word = row.get("JobID", ""), state_word(row.get("State", ""))
        if len(parts) < 3 or not job or not word or word == "RESIZING":
            continue
        runs.setdefault(job, []).append(JobState(word, *exit_pair(row.get("ExitCode", ""))))
        times.setdefault(job, []).append((_time(row.get("Start", "")), _time(row.get("End", ""))))
        reasons[job] = row.get("Reason", "")
    return {job: JobHistory(tuple(states), reasons[job], tuple(times[job])) for job, states in runs.items()}


def _time(text: str) -> float | None:
    """Slurm's local time "2026-12-02T10:01:00" in seconds since the epoch; None for Unknown/None (pure but for
    the time zone)."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


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


# ----- srun's own lines (the batch log) ------------------------------------------------------------------------

_SRUN_LINE = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.+)$")
_SIGNAL_TEXT = {signal.strsignal(s) or "": s.name for s in signal.Signals}
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
# srun refusing its own options: it starts no task and exits 255 (measured: "srun: unrecognized option
# '--container-image=x'" where the pyxis plugin is missing). No retry can help: a usage error.
_SRUN_REFUSAL = re.compile(r"^srun: (?:unrecognized option '([^']+)'|invalid option -- '(.)')")
_PYXIS = ("--container-image", "--container-mounts", "--container-workdir", "--container-name")


def srun_task_ends(lines: Sequence[str]) -> tuple[tuple[int, str], ...]:
    """Every task end srun reported ("task N: <signal text>", "task N: Exited with exit code C"), in the order
    it reported them -> ((rank, signal name or "exit C"), ...) (pure). srun's order is the order its nodes'
    reports reached it, not always the order the tasks ended in."""
    ends: list[tuple[int, str]] = []
    for line in lines:
        match = _SRUN_LINE.search(line)
        if not match:
            continue
        what = match.group(3).strip()
        how = f"exit {what.rsplit(' ', 1)[-1]}" if what.startswith("Exited with exit code") else None
        name = how or _SIGNAL_TEXT.get(what, what)
        for part in match.group(2).split(","):
            low, _, high = part.partition("-")
            ends.extend((rank, name) for rank in range(int(low), int(high or low) + 1))
    return tuple(ends)


def srun_deaths(lines: Sequence[str]) -> tuple[tuple[int, str], ...]:
    """srun's "task N: <signal text>" lines -> ((rank, signal name), ...), but only when a death by a signal
    came first: after a task exits with an error, srun's --kill-on-bad-exit kills the others and reports them
    the same way (pure)."""
    deaths: list[tuple[int, str]] = []
    for rank, how in srun_task_ends(lines):
        if how.startswith("exit "):
            if not deaths:
                return ()  # a task failed on its own first: its exit note tells the cause
            continue
        deaths.append((rank, how))
    return tuple(deaths)


def srun_refusal(lines: Sequence[str]) -> str:
    """'' unless srun refused one of its options before starting any task; then the one line that says which
    and what to do (pure)."""
    for line in lines:
        match = _SRUN_REFUSAL.search(line.strip())
        if not match:
            continue
        option = (match.group(1) or f"-{match.group(2)}").split("=", 1)[0]
        if option in _PYXIS:
            return (
                f"srun does not know {option}: the pyxis plugin (srun --container-image) is not installed on "
                "this cluster. Fix: run without --container-image (Apptainer: --apptainer IMAGE), or ask the "
                "cluster's administrators for pyxis"
            )
        return (
            f"srun does not know the option {option} (from --srun-arg, or HPC_DDP_SRUN_ARGS for "
            "slurm/ddp.sbatch): check `srun --help` on this cluster and drop or fix it"
        )
    return ""


def first_exit(lines: Sequence[str]) -> int | None:
    """The exit code of the first task that exited on its own ("task 0: Exited with exit code 2"), unless a
    task died by a signal first; None when srun said neither (pure). A task that exits 2 made a usage error
    (a bad option, a run folder another job holds): srun's own status is then 1 or a signal's, not 2."""
    ends = srun_task_ends(lines)
    how = ends[0][1] if ends else ""
    code = how.removeprefix("exit ")
    return int(code) if how.startswith("exit ") and code.isdigit() else None


def srun_node_failures(lines: Sequence[str]) -> tuple[str, ...]:
    """The nodes srun said failed under its step ("srun: error: Node failure on node2"), first first (pure)."""
    found: list[str] = []
    for line in lines:
        match = _NODE_FAILURE.search(line)
        for node in hosts(match.group(1)) if match else ():
            if node not in found:
                found.append(node)
    return tuple(found)
