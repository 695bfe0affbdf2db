"""The batch shell's steps (hpc_ddp.launch.slurm.batch) over a fake cluster (tests/fake_slurm.py): what `end`
decides and which Slurm commands it runs, for the endings a review found on a real cluster (issue 23). The
same paths run for real on the local cluster in tests/test_launch_slurm_survive.py."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm
from plugin_scheduler import calls, client, through_the_plugin  # noqa: F401 (an autouse fixture)

from hpc_ddp import exitcodes
from hpc_ddp.launch.slurm import batch
from hpc_ddp.ledger import attempts, preemption
from hpc_ddp.run import folder as run_folder
from hpc_ddp.scheduler.slurm import parse
from hpc_ddp.scheduler.slurm.parse import JobInfo

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def keep_signal_mask() -> Iterator[None]:
    """`end` blocks SIGTERM before it requeues or cancels (that ends the real batch shell): undo it here."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def environ(restart: int = 0, **extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "27",
        "SLURM_RESTART_COUNT": str(restart),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        **extra,
    }


def run_end(folder: Path, fake: FakeSlurm, status: int, restart: int = 0, log: str = "", **extra: str) -> int:
    args = ["--folder", str(folder), "--max-restarts", "1", "--max-requeue", "1"]
    return batch.end(args, status, log, environ(restart, **extra), client(fake))


@pytest.mark.parametrize(
    "variables, num_nodes, expected",
    [
        ({"SLURM_JOB_NUM_NODES": "2"}, "1", 2),  # COMPLETING after Slurm's requeue: NumNodes=1, asked 2
        ({"SLURM_NNODES": "3"}, "1", 3),
        ({"SLURM_JOB_NUM_NODES": "", "SLURM_NNODES": "2"}, "1", 2),
        ({}, "2-2", 2),  # no batch environment: the controller's NumNodes
        ({}, "", 1),
    ],
)
def test_the_job_size_is_what_was_asked(variables: dict[str, str], num_nodes: str, expected: int) -> None:
    assert batch.job_size(variables, JobInfo({"NumNodes": num_nodes})) == expected


def test_a_lost_node_that_leaves_too_few_stops_and_cancels_the_job_slurm_requeued(tmp_path: Path) -> None:
    """node3 drained, node2 lost under a 2-node job: Slurm requeued the job itself and, COMPLETING, counts one
    node. The job no longer fits: it stops, and the stop ends the job (else it pends forever)."""
    fake = FakeSlurm({"node1": "idle", "node2": "down*", "node3": "drain"})
    fake.submit("27", state="COMPLETING", restarts=1, num_nodes="1", node_list="node1")
    code = run_end(tmp_path, fake, status=1)
    assert code == exitcodes.FAILED
    (lost,) = attempts.read(tmp_path)
    assert (lost.outcome, lost.node, lost.decision) == ("node_fail", "node2", "stop")
    assert lost.exclude == ("node2",)
    assert fake.count("scancel", "27") == 1
    assert not [c for c in fake.calls if c[:2] in (("scontrol", "requeue"), ("scontrol", "release"))]


def test_a_lost_node_with_room_left_is_requeued_excluding_it(tmp_path: Path) -> None:
    """Slurm requeued the job for node2's failure (a job without --no-kill): accounting says NODE_FAIL."""
    fake = FakeSlurm({"node1": "idle", "node2": "down*", "node3": "idle"})
    fake.submit("27", state="PENDING", restarts=1, num_nodes="1")
    fake.jobs["27"].records = [["NODE_FAIL", "0:0", "None"], ["PENDING", "0:0", "BeginTime"]]
    assert run_end(tmp_path, fake, status=1) == 1  # a requeued job's shell ends as its tasks did
    (lost,) = attempts.read(tmp_path)
    assert (lost.outcome, lost.decision, lost.exclude) == ("node_fail", "requeue", ("node2",))
    assert fake.count("scancel") == 0
    assert fake.jobs["27"].excluded == "node2"


def test_a_requeue_slurm_performs_with_every_node_healthy_is_a_preemption(tmp_path: Path) -> None:
    """`scontrol requeue` (what PreemptMode=REQUEUE does): a preemption, counted against --max-requeue (1);
    the second one spends it, and the stop really stops the job that Slurm requeued again."""
    fake = FakeSlurm()
    fake.submit("27", state="PENDING", restarts=1)
    assert run_end(tmp_path, fake, status=exitcodes.PREEMPTED) == exitcodes.PREEMPTED
    fake.jobs["27"].restarts = 2
    code = run_end(tmp_path, fake, status=143, restart=1)
    first, second = attempts.read(tmp_path)
    assert (first.outcome, first.decision, first.node, first.blamed) == ("preempted", "requeue", None, False)
    assert (second.outcome, second.decision) == ("preempted", "stop")
    assert code == exitcodes.PREEMPTED
    assert fake.count("scancel", "27") == 1  # once, after the second: the record's "stop" is what happens


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["srun: error: node1: task 0: Exited with exit code 2", "srun: error: node2: tasks 2-3: Killed"], 2),
        (["srun: error: node2: task 3: Killed", "srun: error: node1: task 0: Exited with exit code 2"], None),
        (["srun: error: node1: task 1: Exited with exit code 1"], 1),
        (["some other line"], None),
    ],
)
def test_the_first_task_exit_srun_reports(lines: list[str], expected: int | None) -> None:
    assert parse.first_exit(lines) == expected


def test_a_task_that_exits_2_is_a_usage_error_never_retried(tmp_path: Path) -> None:
    """srun says 1 when rank 0 exits 2 and --kill-on-bad-exit kills the others: its own line tells."""
    log = tmp_path / "srun.log"
    log.write_text(
        "srun: error: node1: task 0: Exited with exit code 2\nsrun: error: node2: tasks 2-3: Killed\n"
    )
    fake = FakeSlurm()
    fake.submit("27", state="RUNNING", node_list="node[1-2]")
    folder = tmp_path / "run"
    code = run_end(folder, fake, status=1, log=str(log))
    assert code == exitcodes.USAGE
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]
    assert [(a.outcome, a.decision) for a in attempts.read(folder)] in ([], [("usage", "stop")])


def test_a_job_refused_another_jobs_folder_stops_and_writes_nothing_there(tmp_path: Path) -> None:
    """Another job (99) holds the folder: this job's rank 0 was refused it. Its `end` neither records nor
    requeues (the requeued attempt would resume from the other job's checkpoint)."""
    folder = tmp_path / "run"
    folder.mkdir()
    lock = run_folder.hold_folder(folder, "rank0", "99", 0)
    try:
        before = sorted(p.name for p in folder.rglob("*"))
        fake = FakeSlurm()
        fake.submit("27", state="RUNNING", node_list="node[1-2]")
        assert run_end(folder, fake, status=1) == exitcodes.USAGE
        assert sorted(p.name for p in folder.rglob("*")) == before
        assert not [c for c in fake.calls if c[0] in ("scancel",) or c[1:2] in (("requeue",), ("hold",))]
    finally:
        lock.release()


@pytest.mark.parametrize(
    "record, expected",
    [
        # the ranks asked for a requeue (USR2) and rank 0, deciding alone, did not: the budget, not a signal
        ({"requeue": True, "requeued": False}, "rank 0 did not requeue the job (--max-requeue spent"),
        ({"requeue": False, "requeued": False}, "stopped by a signal after saving a checkpoint"),  # scancel
    ],
)
def test_a_preemption_rank_0_did_not_requeue_names_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: dict[str, bool], expected: str
) -> None:
    preemption.write(
        tmp_path,
        preemption.Preempted(
            requeue=record["requeue"], signal="SIGUSR2", mode="scontrol", step=4, requeued=record["requeued"]
        ),
    )
    fake = FakeSlurm()
    fake.submit("27", state="RUNNING", node_list="node[1-2]")
    assert run_end(tmp_path, fake, status=exitcodes.PREEMPTED) == exitcodes.PREEMPTED
    (stopped,) = attempts.read(tmp_path)
    assert (stopped.outcome, stopped.decision) == ("stopped", "stop")
    assert expected in stopped.reason and expected in capsys.readouterr().err


def test_an_attempt_a_time_limit_left_open_is_closed_by_the_next_job_in_the_folder(tmp_path: Path) -> None:
    """Job 11 hit its time limit before its first checkpoint: Slurm SIGKILLed its batch shell (KillWait after
    the SIGTERM) before `end`, and its attempt stayed open. The next job's `begin` closes it with Slurm's
    word; job 12, still running, is left alone."""
    import json

    lines = [
        {"event": "start", "job": job, "restart": 0, "nodes": ["node1"], "ranks": ["node1"], "time": 1.0}
        for job in ("11", "12")
    ]
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    fake = FakeSlurm()
    fake.submit("11", state="TIMEOUT", records=[["TIMEOUT", "0:0", "TimeLimit"]])
    fake.submit("12", state="RUNNING", records=[["RUNNING", "0:0", "None"]])
    args = ["--folder", str(tmp_path)]
    assert batch.begin(args, "", environ(), client(fake)) == exitcodes.OK
    by_job = {a.job: a for a in attempts.read(tmp_path)}
    assert (by_job["11"].outcome, by_job["11"].decision) == ("stopped", "stop")
    assert "time limit" in by_job["11"].reason
    assert by_job["12"].ended is None


@pytest.mark.parametrize(
    "options, mine, expected",
    [
        (
            ["--strategy", "fsdp"],
            None,
            "export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304:glibc.malloc.hugetlb=1\n",
        ),
        ([], None, ""),  # ddp: glibc's defaults (issue 41)
        (["--strategy", "fsdp"], "", ""),  # the user's, even empty, is kept
    ],
)
def test_begin_prints_the_strategys_malloc_settings_for_the_shell_to_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], mine: str | None, expected: str
) -> None:
    extra = {} if mine is None else {"GLIBC_TUNABLES": mine}
    fake = FakeSlurm()
    fake.submit("27", state="RUNNING", node_list="node[1-2]")
    args = ["--folder", str(tmp_path), *options]
    assert batch.begin(args, "", environ(**extra), client(fake)) == exitcodes.OK
    assert capsys.readouterr().out == expected
