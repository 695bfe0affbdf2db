"""The Slurm client without a cluster: the job-state table, one parser per command (fed what the local
cluster printed), and the client's questions and requeue sequences against a fake cluster
(tests/fake_slurm.py)."""

from __future__ import annotations

import pytest
from fake_slurm import FakeSlurm

from hpc_ddp.scheduler.slurm import client as slurm_client
from hpc_ddp.scheduler.slurm.client import SlurmClient, requeue_steps
from hpc_ddp.scheduler.slurm.parse import JobHistory, parse_job, parse_sacct, parse_sinfo, parse_squeue
from hpc_ddp.scheduler.slurm.states import TABLE, JobState, Kind, meaning, state_word

# ----- the state table ---------------------------------------------------------------------------------------

# Every word Slurm 22.05's job_state_string prints (src/common/slurm_protocol_defs.c), with its kind.
SLURM_22_05 = {
    "PENDING": Kind.PENDING,
    "RUNNING": Kind.RUNNING,
    "SUSPENDED": Kind.RUNNING,
    "COMPLETED": Kind.SUCCESS,
    "CANCELLED": Kind.FAILURE,
    "FAILED": Kind.FAILURE,
    "TIMEOUT": Kind.FAILURE,
    "NODE_FAIL": Kind.FAILURE,
    "PREEMPTED": Kind.FAILURE,
    "BOOT_FAIL": Kind.FAILURE,
    "DEADLINE": Kind.FAILURE,
    "OUT_OF_MEMORY": Kind.FAILURE,
    "COMPLETING": Kind.COMPLETING,
    "STAGE_OUT": Kind.COMPLETING,
    "CONFIGURING": Kind.RUNNING,
    "RESIZING": Kind.RUNNING,
    "REQUEUED": Kind.REQUEUED,
    "REQUEUE_FED": Kind.REQUEUED,
    "REQUEUE_HOLD": Kind.HELD,
    "SPECIAL_EXIT": Kind.HELD,
    "STOPPED": Kind.RUNNING,
    "REVOKED": Kind.FAILURE,
    "RESV_DEL_HOLD": Kind.HELD,
    "SIGNALING": Kind.RUNNING,
}


def test_the_table_has_every_state_of_slurm_22_05_and_only_those() -> None:
    assert {word: m.kind for word, m in TABLE.items()} == SLURM_22_05
    assert all(m.text for m in TABLE.values())


@pytest.mark.parametrize("word", sorted(SLURM_22_05))
def test_each_state_is_over_waiting_or_running_exactly_once(word: str) -> None:
    kind = meaning(word).kind
    assert [kind.terminal, kind.waiting, kind in (Kind.RUNNING, Kind.COMPLETING)].count(True) == 1


def test_preempted_is_the_end_of_a_run_that_slurm_may_requeue() -> None:
    """Issue 18: PREEMPTED was "active" for `--wait`, terminal for `_over`, absent from batch's list."""
    state = JobState("PREEMPTED")
    assert state.done and state.by_slurm and meaning("PREEMPTED").requeues
    assert meaning("NODE_FAIL").requeues and not meaning("TIMEOUT").requeues


@pytest.mark.parametrize(
    "word, by_slurm",
    [
        ("CANCELLED", True),
        ("TIMEOUT", True),
        ("NODE_FAIL", True),
        ("FAILED", False),
        ("OUT_OF_MEMORY", False),
    ],
)
def test_who_ended_a_job(word: str, by_slurm: bool) -> None:
    assert JobState(word).by_slurm is by_slurm


@pytest.mark.parametrize(
    "text, word",
    [("CANCELLED by 0", "CANCELLED"), ("RUNNING+", "RUNNING"), ("completed", "COMPLETED"), ("", "")],
)
def test_state_word(text: str, word: str) -> None:
    assert state_word(text) == word


def test_an_unknown_word_is_never_over() -> None:
    assert JobState("?").kind is Kind.UNKNOWN and not JobState("?").done
    assert not JobState("SOMETHING_NEW").done


# ----- parsers, fed what the local cluster printed ------------------------------------------------------------

SCONTROL = (
    "JobId=21 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901735 Nice=0 "
    "Account=root QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
    "Reboot=0 ExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-03T10:09:36 "
    "Partition=debug AllocNode:Sid=localhost:16827 ReqNodeList=(null) ExcNodeList=node3 NodeList=node[1-2] "
    "BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 Command=(null) WorkDir=/tmp/slx Power= \n"
)


def test_parse_job() -> None:
    info = parse_job(SCONTROL)
    assert info is not None
    assert info.state == JobState("RUNNING") and info.restarts == 0 and info.num_nodes == 2
    assert info.nodes == ("node1", "node2") and info.excluded == ("node3",) and info.partition == "debug"
    held = parse_job("JobId=7 JobState=PENDING Reason=BeginTime Restarts=1 NumNodes=2-2 ExcNodeList=(null)")
    assert held is not None and (held.num_nodes, held.restarts, held.excluded) == (2, 1, ())
    assert held.state.kind is Kind.PENDING and held.reason == "BeginTime"
    assert parse_job("slurm_load_jobs error: Invalid job id specified") is None


def test_parse_sacct_gives_every_run_of_every_job() -> None:
    text = (
        "16|REQUEUED|0:0|None\n16|COMPLETED|0:0|BeginTime\n"
        "17|REQUEUED|0:0|None\n17|CANCELLED by 0|0:0|None\n"
        "21|PENDING|0:0|Resources\n"
        "garbage\n"
    )
    jobs = parse_sacct(text)
    assert set(jobs) == {"16", "17", "21"}
    assert jobs["16"].runs == (JobState("REQUEUED"), JobState("COMPLETED")) and jobs["16"].restarts == 1
    assert jobs["17"].current == JobState("CANCELLED") and jobs["17"].current.done
    assert (jobs["21"].restarts, jobs["21"].reason) == (0, "Resources")


@pytest.mark.parametrize(
    "states, restarts",
    [
        (["PENDING"], 0),
        (["REQUEUED"], 1),  # the requeue is recorded; the next run's record is not yet (measured: ~3 s)
        (["REQUEUED", "PENDING"], 1),
        (["REQUEUED", "REQUEUED", "RUNNING"], 2),
        (["NODE_FAIL"], 0),  # requeued or not: only the controller knows yet
        (["PREEMPTED", "PENDING"], 1),
    ],
)
def test_restarts_from_the_history(states: list[str], restarts: int) -> None:
    assert JobHistory(tuple(JobState(s) for s in states)).restarts == restarts


def test_parse_squeue_and_sinfo() -> None:
    assert parse_squeue("19|PENDING|job requeued in held state\n21|RUNNING|None\n") == {
        "19": (JobState("PENDING"), "job requeued in held state"),
        "21": (JobState("RUNNING"), "None"),
    }
    assert parse_squeue("") == {}
    assert parse_sinfo("node1 idle\nnode2 drain\nnode3 down*\n") == {
        "node1": "idle",
        "node2": "drain",
        "node3": "down*",
    }


# ----- the client against a fake cluster -------------------------------------------------------------------


def test_one_accounting_query_answers_for_every_job_and_every_run() -> None:
    fake = FakeSlurm()
    for job in ("1", "2", "3"):
        fake.submit(job)
    fake.start("2")
    fake.requeue("2")
    histories = SlurmClient(fake).histories(["1", "2", "3"])
    assert fake.calls == [
        ("sacct", "-X", "-D", "-n", "-P", "-o", "JobID,State,ExitCode,Reason", "-j", "1,2,3")
    ]
    assert (
        histories is not None and histories["2"].restarts == 1 and histories["1"].current.kind is Kind.PENDING
    )


def test_no_answer_is_none_and_a_forgotten_job_is_gone() -> None:
    fake = FakeSlurm(accounting=False)
    fake.submit("5")
    client = SlurmClient(fake)
    assert client.history("5") is None  # no accounting on this cluster
    assert client.job("6") is not None and client.job("6").gone  # type: ignore[union-attr]
    fake.refuse[("scontrol", "show")] = "slurm_load_jobs error: Unable to contact slurm controller"
    assert client.job("5") is None
    assert SlurmClient(FakeSlurm()).history("5") is None  # not recorded yet


def test_the_one_way_to_run_a_command_is_hpc_ddp_proc_with_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(
        slurm_client.proc, "run", lambda argv, timeout_s: seen.append((tuple(argv), timeout_s)) or None
    )
    SlurmClient().call("sinfo", "-h")
    assert seen == [(("sinfo", "-h"), slurm_client.TIMEOUT_S)]


def test_nodes_of_a_partition() -> None:
    fake = FakeSlurm({"node1": "idle", "node2": "drain"})
    assert SlurmClient(fake).nodes("debug") == {"node1": "idle", "node2": "drain"}
    assert fake.calls == [("sinfo", "-h", "-N", "-o", "%N %t", "-p", "debug")]


# ----- the requeue/exclude sequence (what the batch shell's `end` step runs) ---------------------------------


@pytest.mark.parametrize(
    "exclude, excluded, already, steps",
    [
        ((), (), False, [("scontrol", "requeue", "9")]),
        (
            ("node2",),
            (),
            False,
            [
                ("scontrol", "requeuehold", "9"),
                ("scontrol", "update", "JobId=9", "ExcNodeList=node2"),
                ("scontrol", "release", "9"),
            ],
        ),
        (
            ("node3", "node2"),
            ("node3",),
            True,  # Slurm requeued it: hold it first, since a pending job may start before the update
            [
                ("scontrol", "hold", "9"),
                ("scontrol", "update", "JobId=9", "ExcNodeList=node3,node2"),
                ("scontrol", "release", "9"),
            ],
        ),
        (("node2",), ("node2",), True, []),  # requeued by Slurm, already excluded: nothing to do
        ((), (), True, []),
    ],
)
def test_requeue_steps(
    exclude: tuple[str, ...], excluded: tuple[str, ...], already: bool, steps: list[tuple[str, ...]]
) -> None:
    assert requeue_steps("9", exclude, excluded, already) == steps


def test_a_requeue_that_excludes_a_node_runs_on_the_fake_cluster() -> None:
    fake = FakeSlurm()
    fake.submit("9")
    fake.start("9")
    done = SlurmClient(fake).requeue_excluding("9", ["node2"])
    assert done.ok and done.message == (
        "requeued job 9; it will not run on node2 (clear that with: scontrol update JobId=9 ExcNodeList=)"
    )
    job = fake.jobs["9"]
    assert (job.excluded, job.restarts, job.reason) == ("node2", 1, "None")
    assert [r[0] for r in job.records] == ["REQUEUED", "PENDING"]


@pytest.mark.parametrize(
    "already, message", [(False, "requeued job 9"), (True, "job 9 was requeued by Slurm")]
)
def test_a_requeue_without_nodes_to_exclude(already: bool, message: str) -> None:
    fake = FakeSlurm()
    fake.submit("9")
    fake.start("9")
    done = SlurmClient(fake).requeue_excluding("9", [], already=already)
    assert (done.ok, done.message) == (True, message)
    assert fake.count("scontrol", "requeue") == (0 if already else 1)


def test_a_failed_step_releases_the_job_never_leaving_it_held() -> None:
    fake = FakeSlurm()
    fake.submit("9")
    fake.start("9")
    fake.refuse[("scontrol", "update")] = "Invalid node name specified"
    done = SlurmClient(fake).requeue_excluding("9", ["nodeX"])
    assert not done.ok
    assert done.message == "scontrol update JobId=9 ExcNodeList=nodeX failed: Invalid node name specified"
    assert fake.calls[-2:] == [
        ("scontrol", "update", "JobId=9", "ExcNodeList=nodeX"),
        ("scontrol", "release", "9"),
    ]


def test_a_failed_release_is_not_released_again() -> None:
    fake = FakeSlurm()
    fake.submit("9")
    fake.start("9")
    fake.refuse[("scontrol", "release")] = "Access/permission denied"
    done = SlurmClient(fake).requeue_excluding("9", ["node2"])
    assert not done.ok and done.message == "scontrol release 9 failed: Access/permission denied"
    assert fake.count("scontrol", "release") == 1


def test_an_update_is_refused_while_the_job_runs() -> None:
    """What makes the held requeue necessary (measured on Slurm 22.05)."""
    fake = FakeSlurm()
    fake.submit("9")
    fake.start("9")
    out = SlurmClient(fake).exclude("9", ["node2"])
    assert not out.ok and "no longer pending" in out.error


def test_cancel_and_signal() -> None:
    fake = FakeSlurm()
    fake.submit("9")
    fake.start("9")
    client = SlurmClient(fake)
    client.cancel("9", signal="USR2")
    assert fake.jobs["9"].state == "RUNNING"
    client.cancel("9")
    assert fake.calls == [("scancel", "--signal=USR2", "9"), ("scancel", "9")]
    assert fake.jobs["9"].state == "CANCELLED"
