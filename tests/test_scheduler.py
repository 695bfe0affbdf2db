"""The scheduler seam (hpc_ddp.scheduler): its job ids, the one sacct parser's array tasks, and the interface as
Slurm's client and the local launcher's emulation answer it (pure: a fake runner, dict environments)."""

from __future__ import annotations

import inspect

import pytest

from hpc_ddp import proc, scheduler
from hpc_ddp.scheduler import base
from hpc_ddp.scheduler.base import Scheduler, Window, is_job_id
from hpc_ddp.scheduler.local import LocalScheduler, slurm_env
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.parse import RUN_FIELDS, parse_sacct

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text, ok",
    [
        ("123", True),
        ("123_4", True),  # an array task: its own job (report/sources dropped these: `job.isdigit()`)
        ("123+0", True),  # a heterogeneous job's component
        ("", False),
        ("123_", False),
        ("123_[4-7]", False),  # an array's pending tasks, as squeue prints them: no one job
        ("123.batch", False),  # a step, not a job
        ("abc", False),
        ("12 3", False),
    ],
)
def test_job_ids(text: str, ok: bool) -> None:
    assert is_job_id(text) is ok


ARRAY_SACCT = (
    "123_4|2026-12-02T10:00:00|2026-12-02T10:00:05|2026-12-02T10:01:00|REQUEUED\n"
    "123_4|2026-12-02T10:01:00|2026-12-02T10:02:00|Unknown|RUNNING\n"
    "123_5|2026-12-02T10:00:00|2026-12-02T10:00:05|2026-12-02T10:00:30|COMPLETED\n"
)


def test_an_array_task_is_a_job_of_its_own_in_the_one_sacct_parser() -> None:
    jobs = parse_sacct(ARRAY_SACCT, RUN_FIELDS)
    assert set(jobs) == {"123_4", "123_5"}
    assert [w.end is None for w in jobs["123_4"].windows] == [False, True]
    assert jobs["123_4"].restarts == 1 and jobs["123_5"].current.done


def test_runs_asks_sacct_once_for_an_array_task_and_reads_its_windows() -> None:
    asked: list[tuple[str, ...]] = []

    def runner(argv: object, _timeout: float) -> proc.Output:
        asked.append(tuple(argv))  # type: ignore[arg-type]
        return proc.Output(ARRAY_SACCT)

    runs = SlurmClient(runner).runs("123_4")
    assert asked == [("sacct", "-X", "-D", "-n", "-P", "-o", ",".join(RUN_FIELDS), "-j", "123_4")]
    assert runs is not None and len(runs) == 2 and runs[1].start - runs[0].end == 60  # type: ignore[operator]
    assert SlurmClient(runner).runs("999") == []  # accounting answered: no run of that job
    assert SlurmClient(lambda argv, t: proc.Output("", "sacct: error")).runs("123_4") is None


def test_the_report_reads_an_array_tasks_runs() -> None:
    from hpc_ddp.report.sources import sacct_windows

    client = SlurmClient(lambda argv, t: proc.Output(ARRAY_SACCT))
    assert sorted(sacct_windows("123_4", client)) == [("123_4", 0), ("123_4", 1)]


def test_the_local_emulation_answers_who_am_i_from_its_own_variables() -> None:
    class Job:
        job_id, nodes, tasks_per_node, world_size = "4242", 2, 2, 4

    environ = slurm_env(Job(), rank=3, restarts=2)
    me = LocalScheduler(nodes=2).identity(environ)
    assert me == base.Identity("4242", 2, ("127.0.0.1", "127.0.0.2"), "127.0.0.2")
    assert SlurmClient().identity(environ) == me  # the emulated step is srun's: Slurm reads it the same
    assert SlurmClient().identity({}) == base.Identity("", 0, (), "")


def test_the_local_emulation_has_no_commands_and_every_node_is_usable() -> None:
    local = LocalScheduler(nodes=3)
    assert local.usable(exclude=["127.0.0.2"]) == ["127.0.0.1", "127.0.0.3"]
    assert (local.version(), local.can_requeue(), local.runs("1"), local.queued(["1"])) == (
        None,
        False,
        None,
        {},
    )
    for done in (local.requeue("1"), local.cancel("1"), local.requeue_excluding("1", ["127.0.0.1"])):
        assert not done.ok and "launcher" in done.message
    with pytest.raises(NotImplementedError, match="submit --local"):
        local.submit(None, None)


def test_slurm_usable_reads_sinfo_through_the_one_state_table() -> None:
    out = proc.Output("node1 idle\nnode2 drain\nnode3 down*\nnode4 mix\n")
    assert SlurmClient(lambda argv, t: out).usable(exclude=["node4"]) == ["node1"]


@pytest.mark.parametrize("cls", [SlurmClient, LocalScheduler])
def test_each_scheduler_answers_the_whole_interface(cls: type) -> None:
    wanted = {n for n, v in vars(Scheduler).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert wanted >= {"identity", "requeue", "runs", "usable", "submit", "cancel", "requeue_excluding"}
    assert wanted >= {"step_end", "lost"}  # what srun said of a step, the nodes a run lost (issue 43 item 6)
    assert inspect.ismethod(cls.detect)  # a class method: the registry asks it before building one
    for name in wanted:
        theirs, ours = inspect.signature(getattr(cls, name)), inspect.signature(getattr(Scheduler, name))
        assert list(theirs.parameters) == list(ours.parameters), name


def test_schedulers_by_name() -> None:
    assert scheduler.of("slurm").name == "slurm" and scheduler.of("local", nodes=2).name == "local"
    assert scheduler.for_task("launcher").name == "local" and scheduler.for_task("auto").name == "slurm"
    with pytest.raises(ValueError, match="no scheduler named 'pbs'"):
        scheduler.of("pbs")


@pytest.mark.parametrize(
    "launcher, requeue_by, name",
    [
        ("slurm", "launcher", "local"),  # the local launcher's ranks: an emulated srun step, a fake job id
        ("slurm", "auto", "slurm"),
        ("slurm", "scontrol", "slurm"),
        ("torchrun", "auto", "slurm"),  # asks Slurm nothing, or gets no answer: as before
        ("single", "exit", "slurm"),
    ],
)
def test_the_registry_chooses_a_processs_scheduler_from_what_detect_found(
    launcher: str, requeue_by: str, name: str
) -> None:
    assert scheduler.detect(launcher, requeue_by).name == name
    assert scheduler.for_task(requeue_by, launcher).name == name
    assert (
        scheduler.default().name == "slurm"
    )  # the registry's first: the cluster's, for run.json and reports


def test_the_step_launchers_word_and_the_lost_nodes_behind_the_interface() -> None:
    lines = [
        "srun: error: Node failure on node2",
        "srun: error: node1: task 0: Killed",
        "srun: error: node1: task 1: Exited with exit code 2",
    ]
    said = SlurmClient(lambda argv, t: proc.Output("node1 idle\nnode2 down*\nnode3 idle\n")).step_end(lines)
    assert said.failed_nodes == ("node2",) and said.killed == ((0, "SIGKILL"),)
    client = SlurmClient(lambda argv, t: proc.Output("node1 idle\nnode2 idle\nnode3 down*\n"))
    assert client.lost("5", ("node1", "node2", "node3"), said.failed_nodes, 0) == ("node2", "node3")
    assert LocalScheduler(2).step_end(lines) == base.StepEnd()  # its launcher saw every rank end itself
    assert LocalScheduler(2).lost("5", ("127.0.0.1",), ("127.0.0.2",), 0) == ("127.0.0.2",)


def test_a_window_is_the_reports_and_the_schedulers() -> None:
    from hpc_ddp.report import timeline

    assert timeline.Window is Window  # one word for "when a run held its nodes"
