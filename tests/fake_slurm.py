"""A fake Slurm 22.05 cluster for `SlurmClient(runner=FakeSlurm())`: it answers sacct, scontrol, squeue,
sinfo and scancel with the text the real commands print (measured on the local cluster, env/slurm), keeps
the jobs' state as the controller and accounting would, and records every command it was asked.

What it imitates, as measured:
- accounting lags the controller: a fresh job is missing from sacct, then PENDING while the controller has
  it RUNNING (`FakeJob.accounted`, `FakeJob.records` are set apart from the controller's `state`);
- a requeue closes the run's record (REQUEUED) and adds a PENDING one; the controller says PENDING, Reason
  BeginTime, Restarts + 1; `requeuehold` says Reason=job_requeued_in_held_state;
- `scontrol update ... ExcNodeList=` is refused while the job runs ("Job is no longer pending execution");
- a job the controller forgot: "slurm_load_jobs error: Invalid job id specified", exit 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hpc_ddp import proc

ACTIONS = ("requeue", "requeuehold", "hold", "release", "update")
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")


@dataclass
class FakeJob:
    id: str
    state: str = "PENDING"  # the controller's JobState
    exit_code: str = "0:0"
    reason: str = "None"
    restarts: int = 0
    num_nodes: str = "2-2"
    num_tasks: int = 4
    partition: str = "debug"
    excluded: str = ""
    node_list: str = ""
    # accounting: one [state, exit code, reason] per run; `accounted` False: sacct has not recorded the job
    records: list[list[str]] = field(default_factory=lambda: [["PENDING", "0:0", "None"]])
    accounted: bool = True
    known: bool = True  # False: the controller forgot it (MinJobAge)

    def scontrol_line(self) -> str:
        return (
            f"JobId={self.id} JobName=hpc_ddp UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 "
            f"Account=(null) QOS=normal JobState={self.state} Reason={self.reason} Dependency=(null) "
            f"Requeue=1 Restarts={self.restarts} BatchFlag=1 Reboot=0 ExitCode={self.exit_code} "
            f"RunTime=00:00:05 TimeLimit=00:10:00 Partition={self.partition} "
            f"NodeList={self.node_list or '(null)'} NumNodes={self.num_nodes} NumCPUs=4 NumTasks={self.num_tasks} "
            f"ReqNodeList=(null) ExcNodeList={self.excluded or '(null)'} Command=(null) WorkDir=/tmp\n"
        )


class FakeSlurm:
    """The runner: `fake(argv, timeout_s)` -> proc.Output. `calls` lists every command asked, in order."""

    def __init__(self, nodes: dict[str, str] | None = None, accounting: bool = True) -> None:
        self.jobs: dict[str, FakeJob] = {}
        self.nodes = dict(nodes or {"node1": "idle", "node2": "idle", "node3": "idle"})
        self.accounting = accounting
        self.calls: list[tuple[str, ...]] = []
        self.refuse: dict[tuple[str, ...], str] = {}  # a command's first words -> the error it fails with
        self.on_call: Callable[[tuple[str, ...]], None] | None = None  # runs before each answer
        # A command's first words -> the text it prints, as recorded on the real cluster (tests/data): answered
        # instead of the fake's own; a job's (scontrol show, sacct) until an action changes the job.
        self.answers: dict[tuple[str, ...], str] = {}

    # ----- the cluster's life, as tests drive it ----------------------------------------------------------

    def submit(self, job_id: str, **fields: object) -> FakeJob:
        self.jobs[job_id] = job = FakeJob(job_id, **fields)  # type: ignore[arg-type]
        return job

    def start(self, job_id: str, nodes: str = "node[1-2]") -> None:
        job = self.jobs[job_id]
        job.state, job.reason, job.node_list = "RUNNING", "None", nodes
        job.records[-1][:] = ["RUNNING", "0:0", job.records[-1][2]]

    def end(self, job_id: str, state: str, exit_code: str = "0:0") -> None:
        job = self.jobs[job_id]
        job.state, job.exit_code = state, exit_code
        job.records[-1][:] = [state, exit_code, job.records[-1][2]]

    def requeue(self, job_id: str, held: bool = False) -> None:
        job = self.jobs[job_id]
        job.records[-1][0] = "REQUEUED"
        if not held:  # accounting adds the held run's record only once it is released
            job.records.append(["PENDING", "0:0", "BeginTime"])
        job.state, job.restarts = "PENDING", job.restarts + 1
        job.reason = "job_requeued_in_held_state" if held else "BeginTime"

    # ----- the commands ------------------------------------------------------------------------------------

    def count(self, *words: str) -> int:
        return sum(1 for call in self.calls if call[: len(words)] == words)

    def __call__(self, argv: Sequence[str], timeout_s: float = 30.0) -> proc.Output:
        call = tuple(argv)
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call)
        for words, error in self.refuse.items():
            if call[: len(words)] == words:
                return proc.Output("", error)
        if call[0] == "scancel" or call[:2] in (("scontrol", v) for v in ACTIONS):
            # the job changed: its recorded words are stale (the nodes' are not)
            self.answers = {k: v for k, v in self.answers.items() if k[0] == "sinfo"}
        for words, text in self.answers.items():
            if call[: len(words)] == words:
                return proc.Output(text)
        handler = {
            "sacct": self._sacct,
            "squeue": self._squeue,
            "sinfo": self._sinfo,
            "scancel": self._scancel,
        }
        if call[0] == "scontrol":
            return self._scontrol(call[1:])
        return handler[call[0]](call[1:])

    def _ids(self, args: Sequence[str]) -> list[str]:
        return args[list(args).index("-j") + 1].split(",")

    def _sacct(self, args: Sequence[str]) -> proc.Output:
        if not self.accounting:
            return proc.Output("", "sacct: error: Problem talking to the database: Connection refused")
        assert args[:4] == ("-X", "-D", "-n", "-P"), args  # the history of every run, machine-readable
        rows = []
        for job_id in self._ids(args):
            job = self.jobs.get(job_id)
            if job is not None and job.accounted:
                state = lambda s: "CANCELLED by 0" if s == "CANCELLED" else s  # noqa: E731
                rows += [f"{job_id}|{state(s)}|{code}|{reason}\n" for s, code, reason in job.records]
        return proc.Output("".join(rows))

    def _squeue(self, args: Sequence[str]) -> proc.Output:
        rows = []
        for job_id in self._ids(args):
            job = self.jobs.get(job_id)
            if job is not None and job.known and job.state in WAITING:
                rows.append(f"{job_id}|{job.state}|{job.reason.replace('_', ' ')}\n")
        return proc.Output("".join(rows))

    def _sinfo(self, args: Sequence[str]) -> proc.Output:
        return proc.Output("".join(f"{node} {state}\n" for node, state in self.nodes.items()))

    def _scancel(self, args: Sequence[str]) -> proc.Output:
        job = self.jobs[args[-1]]
        if not any(a.startswith("--signal") for a in args):
            running = job.state == "RUNNING"
            self.end(job.id, "CANCELLED")  # measured: sacct says 0:0, the controller 0:15 if it ran
            job.exit_code = "0:15" if running else "0:0"
        return proc.Output("")

    def _scontrol(self, args: Sequence[str]) -> proc.Output:
        verb = args[0]
        if verb == "show":
            job = self.jobs.get(args[-1])
            if job is None or not job.known:
                return proc.Output("", "slurm_load_jobs error: Invalid job id specified")
            return proc.Output(job.scontrol_line())
        if verb == "update":
            fields = dict(a.split("=", 1) for a in args[1:])
            job = self.jobs[fields["JobId"]]
            if job.state not in ("PENDING",):
                return proc.Output("", f"Job is no longer pending execution for job {job.id}")
            job.excluded = fields.get("ExcNodeList", job.excluded)
            job.num_nodes = fields.get("NumNodes", job.num_nodes)
            job.num_tasks = int(fields.get("NumTasks", job.num_tasks))
            return proc.Output("")
        job = self.jobs[args[1]]
        if verb in ("requeue", "requeuehold"):
            self.requeue(job.id, held=verb == "requeuehold")
        elif verb == "hold":
            job.reason = "JobHeldUser"
        elif verb == "release":
            if job.reason == "job_requeued_in_held_state":
                job.records.append(["PENDING", "0:0", "BeginTime"])
            job.reason = "None"
        return proc.Output("")


class FakeClock:
    """A clock for `follow(..., clock=FakeClock())`: `sleep` moves time on at once and runs what `at`
    scheduled for the moments it passes (the cluster's events, the run's files)."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []

    def now(self) -> float:
        return self.t

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action` once the clock reaches `t` seconds after its start."""
        self.events.append((1000.0 + t, len(self.events), action))
        self.events.sort()

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        while self.events and self.events[0][0] <= self.t:
            self.events.pop(0)[2]()
