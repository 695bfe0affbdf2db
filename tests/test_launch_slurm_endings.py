"""Issue 33: node failures, drains, early signals and srun's refusals as Slurm 22.05 reports them under the kit's
`--no-kill`, fed to the batch shell's `end`, to `begin` and to `submit --wait` from outputs recorded on the
local cluster (tests/data/slurm_nokill/README.md says how each was made). The decisions are pure; Slurm's
own part (what it prints, whether it keeps the job) is in the recordings, and the paths run for real in
tests/test_launch_slurm_survive.py."""

from __future__ import annotations

import io
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DATA
from fake_slurm import FakeClock, FakeSlurm
from plugin_scheduler import calls, client, through_the_plugin  # noqa: F401 (an autouse fixture)

from hpc_ddp import exitcodes
from hpc_ddp.launch import supervisor
from hpc_ddp.launch.slurm import batch, lost
from hpc_ddp.launch.slurm.follow import Clock, follow
from hpc_ddp.ledger import attempts, exits
from hpc_ddp.ledger.outcomes import REQUEUE
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.scheduler.slurm import parse

pytestmark = pytest.mark.unit

RECORDED = DATA / "slurm_nokill"
FIELDS = ("outcome", "node", "blamed", "decision", "exclude")


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


@pytest.fixture(autouse=True)
def keep_signal_mask() -> Iterator[None]:
    """`end` blocks SIGTERM before it requeues (that ends the real batch shell): undo it here."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def environ(job: str = "6031", restart: int = 0) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": job,
        "SLURM_RESTART_COUNT": str(restart),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NODELIST": "node[1-2]",
    }


def started(
    folder: Path,
    job: str = "6031",
    restart: int = 0,
    nodes: tuple[str, ...] = ("node1", "node2"),
    now: float = 100.0,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    attempts.record_start(folder, job, restart, nodes, nodes, None, now=now + restart)


def cluster(sinfo: str, job: str = "6031", **fields: object) -> FakeSlurm:
    """A fake cluster whose nodes are as `sinfo` (a recorded file) says, with job `job` in it."""
    states = dict(line.split() for line in recorded(sinfo).splitlines() if line.strip())
    fake = FakeSlurm(states)
    fake.submit(job, **{"state": "RUNNING", "node_list": "node[1-2]", "num_nodes": "2", **fields})
    return fake


def end(folder: Path, fake: FakeSlurm, status: int, srun: str = "", *args: str, restart: int = 0) -> int:
    log = folder.parent / "srun.log"
    log.write_text(recorded(srun) if srun else "")
    argv = ["--folder", str(folder), "--max-restarts", "3", "--max-requeue", "1", *args]
    return batch.end(argv, status, str(log), environ(fake_job(fake), restart), client(fake))


def fake_job(fake: FakeSlurm) -> str:
    return next(iter(fake.jobs))


def test_a_node_lost_under_no_kill_is_recorded_by_the_batch_shell_and_the_job_requeued_away_from_it(
    tmp_path: Path,
) -> None:
    """node2 DOWN then DRAIN: srun says "Node failure on node2", Slurm removes it from the job (NodeList=node1)
    and keeps the batch shell: `end` records the failure and requeues the job away from node2 itself."""
    folder = tmp_path / "run"
    started(folder)
    fake = cluster("node_failure.sinfo")
    fake.answers[("scontrol", "show", "job")] = recorded("node_failure.scontrol")
    assert end(folder, fake, 137, "node_failure.srun") == 137  # a requeued job's shell ends as its tasks did
    (lost_attempt,) = attempts.read(folder)
    assert tuple(getattr(lost_attempt, f) for f in FIELDS) == (
        "node_fail",
        "node2",
        True,
        REQUEUE,
        ("node2",),
    )
    assert [c[:2] for c in fake.calls if c[0] == "scontrol" and c[1] != "show"] == [
        ("scontrol", "requeuehold"),
        ("scontrol", "update"),
        ("scontrol", "release"),
    ]
    assert fake.jobs["6031"].excluded == "node2" and fake.count("scancel") == 0
    # Through the plugin's scheduler (tests/plugin_scheduler.py): srun's word, the lost nodes, the usable nodes
    # left and the requeue, each asked of the Scheduler interface.
    assert calls() == ["step_end", "lost", "usable", "requeue_excluding"]


def test_a_node_lost_that_leaves_too_few_stops_the_job_and_nothing_pends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same with node3 drained: one usable node left for a 2-node job. The batch shell stops the job
    (its exit ends it: Slurm did not requeue it, so there is nothing to cancel and nothing pends)."""
    folder = tmp_path / "run"
    started(folder)
    fake = cluster("node_failure.sinfo")
    fake.nodes["node3"] = "drain"
    fake.answers[("scontrol", "show", "job")] = recorded("node_failure.scontrol")
    assert end(folder, fake, 137, "node_failure.srun") == exitcodes.FAILED
    (stopped,) = attempts.read(folder)
    assert tuple(getattr(stopped, f) for f in FIELDS) == ("node_fail", "node2", True, "stop", ("node2",))
    assert (
        "cannot requeue: the job needs 2 node(s) and only 1 usable one(s) remain" in capsys.readouterr().err
    )
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]
    assert calls() == ["step_end", "lost", "usable"]  # the stop is the decision's: nothing else asked


def test_with_wait_for_nodes_the_job_too_big_for_the_nodes_left_is_requeued_to_wait(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    started(folder)
    fake = cluster("node_failure.sinfo")
    fake.nodes["node3"] = "drain"
    fake.answers[("scontrol", "show", "job")] = recorded("node_failure.scontrol")
    end(folder, fake, 137, "node_failure.srun", "--wait-for-nodes")
    (waiting,) = attempts.read(folder)
    assert (waiting.outcome, waiting.decision) == ("node_fail", REQUEUE)
    assert fake.jobs["6031"].excluded == "node2" and fake.count("scancel") == 0


@pytest.mark.parametrize("state", ["CANCELLED", "COMPLETING"])
def test_a_cancelled_job_releasing_its_nodes_lost_none(tmp_path: Path, state: str) -> None:
    """`scancel`: the job ends and releases its nodes one by one, so its NodeList may lack node2 while the
    batch shell records the attempt (found on the cluster: "node_fail on node2" for a plain scancel). Only a
    running job's NodeList (or a failed batch host's) says a node was removed for a failure."""
    from hpc_ddp.ledger import preemption

    folder = tmp_path / "run"
    started(folder)
    preemption.write(folder, preemption.Preempted(requeue=False, signal="SIGTERM", mode="exit", step=5))
    fake = FakeSlurm()
    fake.submit("6031", state=state, node_list="node1", num_nodes="1")
    assert end(folder, fake, exitcodes.PREEMPTED, "") == exitcodes.PREEMPTED
    (stopped,) = attempts.read(folder)
    assert (stopped.outcome, stopped.blamed, stopped.decision, stopped.exclude) == (
        "stopped",
        False,
        "stop",
        (),
    )


def test_a_node_down_that_returned_at_once_is_still_a_node_failure(tmp_path: Path) -> None:
    """Issue 33 item 4: DOWN, and back before anyone looks (a live slurmd, ReturnToService=2): every node is
    up, but srun said "Node failure on node2". A node failure, blamed and excluded; not a preemption, so
    --max-requeue 0 does not cancel it."""
    folder = tmp_path / "run"
    started(folder)
    fake = FakeSlurm()  # every node idle again
    fake.submit("6031", state="RUNNING", node_list="node[1-2]")
    assert end(folder, fake, 137, "node_failure.srun", "--max-requeue", "0") == 137
    (failed,) = attempts.read(folder)
    assert tuple(getattr(failed, f) for f in FIELDS) == ("node_fail", "node2", True, REQUEUE, ("node2",))


def test_a_node_failure_slurm_requeued_for_is_one_even_when_the_node_is_back(tmp_path: Path) -> None:
    """The same without --no-kill (a user's own script, an older ddp.sbatch): Slurm requeued the job itself;
    accounting's NODE_FAIL says why, though every node is up again: not "requeued with every node up"."""
    folder = tmp_path / "run"
    started(folder, job="27")
    fake = FakeSlurm()
    fake.submit(
        "27",
        state="PENDING",
        restarts=1,
        records=[["NODE_FAIL", "0:0", "None"], ["PENDING", "0:0", "BeginTime"]],
    )
    assert end(folder, fake, 143, "", "--max-requeue", "0") == 143
    (failed,) = attempts.read(folder)
    assert (failed.outcome, failed.decision) == ("node_fail", REQUEUE)


def test_a_drained_node_is_not_blamed_for_a_rank_that_raised(tmp_path: Path) -> None:
    """Issue 33 item 2: node2 drained by an administrator mid-run ("drng"), then rank 0 raises on node1: the
    exception is the first cause; draining is not failing (nothing excluded)."""
    folder = tmp_path / "run"
    started(folder)
    exits.note(folder, "6031", 0, 0, "node1", ValueError("bad batch 7"))
    fake = cluster("drained_while_running.sinfo")
    assert end(folder, fake, 1, "") == 1
    (failed,) = attempts.read(folder)
    assert (failed.outcome, failed.rank, failed.node, failed.blamed, failed.exclude) == (
        "failed",
        0,
        "node1",
        False,
        (),
    )
    assert failed.reason == "ValueError: bad batch 7"
    assert fake.jobs["6031"].excluded == ""


def test_a_preemption_signal_that_kills_starting_tasks_is_a_preemption(tmp_path: Path) -> None:
    """Issue 33 item 3: `scancel --signal=USR2` before the tasks' handler exists: srun says "task 1: User
    defined signal 2". A preemption, requeued within --max-requeue (1), no node blamed; the second spends it."""
    folder = tmp_path / "run"
    started(folder)
    fake = cluster("node_failure.sinfo")  # any states: no node is blamed
    fake.nodes = {"node1": "idle", "node2": "idle", "node3": "idle"}
    assert end(folder, fake, 12, "usr2_while_starting.srun") == 12
    fake.jobs["6031"].state, fake.jobs["6031"].restarts = "RUNNING", 1
    started(folder, restart=1)
    assert end(folder, fake, 12, "usr2_while_starting.srun", restart=1) == exitcodes.PREEMPTED
    first, second = attempts.read(folder)
    assert (first.outcome, first.blamed, first.decision, first.exclude) == ("preempted", False, REQUEUE, ())
    assert first.reason.startswith("rank 1 was killed by SIGUSR2, the preemption signal")
    assert (second.outcome, second.decision) == ("preempted", "stop")
    assert "crash loop" not in second.reason


def test_srun_without_pyxis_is_a_usage_error_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33 item 9: srun exits 255 on --container-image where pyxis is missing: stop at once, exit 2."""
    folder = tmp_path / "run"
    fake = FakeSlurm()
    fake.submit("6031", state="RUNNING", node_list="node[1-2]")
    assert end(folder, fake, 255, "no_pyxis.srun") == exitcodes.USAGE
    err = capsys.readouterr().err
    assert (
        "srun does not know --container-image: the pyxis plugin (srun --container-image) is not installed"
        in err
    )
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]


@pytest.mark.parametrize(
    "lines, found",
    [
        (recorded("no_pyxis.srun").splitlines(), "pyxis plugin"),
        (["srun: unrecognized option '--exclusve'"], "srun does not know the option --exclusve"),
        (["srun: invalid option -- 'Z'"], "srun does not know the option -Z"),
        (["srun: error: node1: task 0: Exited with exit code 1"], ""),
    ],
)
def test_srun_refusals(lines: list[str], found: str) -> None:
    said = parse.srun_refusal(lines)
    assert (found in said) if found else said == ""


@pytest.mark.parametrize(
    "lines, nodes",
    [
        (recorded("node_failure.srun").splitlines(), ("node2",)),
        (["srun: error: Node failure on node3", "srun: error: Node failure on node2"], ("node3", "node2")),
        (recorded("usr2_while_starting.srun").splitlines(), ()),
    ],
)
def test_the_nodes_srun_says_failed(lines: list[str], nodes: tuple[str, ...]) -> None:
    assert parse.srun_node_failures(lines) == nodes


def test_two_nodes_lost_together_are_both_recorded_and_excluded(tmp_path: Path) -> None:
    """Issue 33 item 10: a 3-node job loses node2 and node3 at once: both are blamed, both excluded."""
    folder = tmp_path / "run"
    started(folder, nodes=("node1", "node2", "node3"))
    fake = FakeSlurm({f"node{i}": "idle" for i in range(1, 6)})
    fake.submit("6031", state="RUNNING", node_list="node1", num_nodes="1")
    log = "srun: error: Node failure on node2\nsrun: error: Node failure on node3\n"
    (tmp_path / "srun.log").write_text(log)
    env = {**environ(), "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "node[1-3]"}
    batch.end(["--folder", str(folder)], 137, str(tmp_path / "srun.log"), env, client(fake))
    (failed,) = attempts.read(folder)
    assert (failed.outcome, failed.node, failed.lost, failed.exclude) == (
        "node_fail",
        "node2",
        ("node2", "node3"),
        ("node2", "node3"),
    )
    assert attempts.line(failed, "x").startswith(
        "attempt 1 node_fail on node2,node3 (points at the node): nodes"
    )
    assert fake.jobs["6031"].excluded == "node2,node3"


# ----- the batch shell's own node: nothing of the job is left, and `submit --wait` decides -----------------


def batch_host_lost(tmp_path: Path, node3: str = "idle") -> tuple[Path, FakeSlurm]:
    """Job 6032 on node1,node2 lost node1, its batch host: Slurm ended it FAILED (JobLaunchFailure), node1
    removed from it, never requeued. Its attempt is open: no batch shell was left to record it."""
    folder = tmp_path / "run"
    started(folder, job="6032")
    fake = cluster("batch_host_lost.sinfo", job="6032", state="FAILED", exit_code="0:9", node_list="node2")
    fake.nodes["node3"] = node3
    fake.jobs["6032"].records = [["FAILED", "0:9", "None"]]
    fake.answers[("scontrol", "show", "job")] = recorded("batch_host_lost.scontrol")
    fake.answers[("sacct",)] = recorded("batch_host_lost.sacct")
    return folder, fake


def follow_lost(
    folder: Path, fake: FakeSlurm, clock: FakeClock | None = None, **policy: object
) -> tuple[int, str]:
    rules = lost.Policy(supervisor.Budgets(3, 3, REQUEUE), 2, tasks_per_node=1, **policy)  # type: ignore[arg-type]
    out = io.StringIO()
    clock = clock or FakeClock()
    code = follow(
        "6032",
        CheckpointStore(folder, Local()),
        2,
        0.0,
        client(fake),
        out,
        Clock(clock.now, clock.sleep),
        rules,
        "RESUME",
    )
    return code, out.getvalue()


def test_wait_records_a_lost_batch_host_and_requeues_the_job_away_from_it(tmp_path: Path) -> None:
    """Issue 33 item 1: the batch shell's own node died. `--wait` finds the job over with its attempt open,
    records the node failure (node1: Slurm removed it from the job) and requeues the job without node1; the
    job runs again and completes."""
    folder, fake = batch_host_lost(tmp_path)
    clock = FakeClock()

    def runs_again(call: tuple[str, ...]) -> None:
        if call[:2] == ("scontrol", "release"):
            clock.at(clock.t - 1000.0 + 10, lambda: fake.start("6032", "node[2-3]"))
            clock.at(clock.t - 1000.0 + 20, lambda: fake.end("6032", "COMPLETED"))

    fake.on_call = runs_again
    code, out = follow_lost(folder, fake, clock)
    assert code == 0, out
    (closed,) = attempts.read(folder)
    assert tuple(getattr(closed, f) for f in FIELDS) == ("node_fail", "node1", True, REQUEUE, ("node1",))
    assert "[submit] attempt 1 node_fail on node1 (points at the node): node node1 failed" in out
    assert "requeued job 6032; it will not run on node1" in out
    assert out.rstrip().endswith("[submit] job 6032 completed; run folder " + str(folder))


def test_wait_stops_a_job_whose_batch_host_was_lost_when_too_few_nodes_are_left(tmp_path: Path) -> None:
    folder, fake = batch_host_lost(tmp_path, node3="drain")
    code, out = follow_lost(folder, fake)
    assert code == exitcodes.FAILED, out
    (closed,) = attempts.read(folder)
    assert (closed.outcome, closed.node, closed.decision) == ("node_fail", "node1", "stop")
    assert "cannot requeue: the job needs 2 node(s) and only 1 usable one(s) remain" in out
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]
    assert "[submit] job 6032 stops: cannot requeue" in out  # with every attempt, once
    lines = out.splitlines()
    assert lines[-2].startswith("[submit] job 6032 stopped after 1 attempt(s): a node failed (on node1): ")
    assert lines[-2].endswith("; its first error and every attempt are shown above")
    assert lines[-1] == (
        f"[submit] once the cause is fixed, run the same command to resume from the start (no checkpoint yet) "
        f"in {folder}: RESUME"
    )


def test_wait_never_brings_back_a_job_that_ended_without_a_node_failure(tmp_path: Path) -> None:
    """A job over with its attempt open and no node lost (its batch shell killed, or its record unwritable: a
    read-only folder). `--wait` records it as lost, and stops: requeued, it would fail again, and a decision
    it could not record would be taken again at every look (found on the cluster: 24 requeues)."""
    folder, fake = batch_host_lost(tmp_path)
    fake.answers.clear()  # no recorded words: node1 is still the job's, every node up
    fake.nodes["node1"] = "idle"
    fake.jobs["6032"].node_list = "node[1-2]"
    code, out = follow_lost(folder, fake)
    assert code == exitcodes.FAILED, out
    (closed,) = attempts.read(folder)
    assert (closed.outcome, closed.decision) == ("lost", "stop"), out
    assert "the job is over and no node of it failed: not requeued" in out
    assert not [c for c in fake.calls if c[1:2] in (("requeue",), ("requeuehold",))]


def test_wait_takes_the_batch_shells_word_when_it_said_it_stopped_the_job(tmp_path: Path) -> None:
    """Its record could not be written (a read-only folder), but the batch log `--wait` follows says it
    stopped the job: nothing is judged again, nothing requeued."""
    folder, fake = batch_host_lost(tmp_path)
    (folder / "submitit").mkdir()
    (folder / "submitit" / "6032_0_log.out").write_text("[hpc_ddp] job 6032 stops: not retried. Attempts:\n")
    code, out = follow_lost(folder, fake)
    assert code == exitcodes.FAILED, out
    assert [a.outcome for a in attempts.read(folder)] == ["running"]
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]


def test_without_a_follower_the_next_job_in_the_folder_records_the_lost_batch_host(tmp_path: Path) -> None:
    """... as it ended: its last step's time, not the moment the next job looked (issue 33 item 10: the
    report counted hours of a job's pending after its last step as allocated time, goodput 1.0 %)."""
    folder, fake = batch_host_lost(tmp_path)
    (folder / "metrics.jsonl").write_text(json.dumps({"event": "step", "step": 3, "time": 150.0}) + "\n")
    fake.submit("6040", state="RUNNING", node_list="node[2-3]")
    assert batch.begin(["--folder", str(folder)], "", environ("6040"), client(fake)) == exitcodes.OK
    closed = next(a for a in attempts.read(folder) if a.job == "6032")
    assert (closed.outcome, closed.node, closed.decision) == ("node_fail", "node1", "stop")
    assert (closed.ended, closed.step) == (150.0, 3)
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]


# ----- two jobs on one folder -------------------------------------------------------------------------------


def test_a_job_whose_folder_another_job_took_over_stops_at_begin_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33 item 7: job 27 waited for its requeue; the same command run again (job 75) resumed its
    checkpoint and trained on. When 27 starts again, its `begin` stops it (exit 2) before srun: the two
    never take turns on the folder."""
    folder = tmp_path / "run"
    started(folder, job="27")
    (folder / "attempts.jsonl").open("a").write(
        json.dumps(
            {
                "event": "end",
                "job": "27",
                "restart": 0,
                "outcome": "preempted",
                "decision": "requeue",
                "time": 150.0,
            }
        )
        + "\n"
    )
    started(folder, job="75", now=200.0)
    before = (folder / "attempts.jsonl").read_bytes()
    fake = FakeSlurm()
    fake.submit("27", state="RUNNING", restarts=1)
    code = batch.begin(["--folder", str(folder)], "", environ("27", 1), client(fake))
    assert code == exitcodes.USAGE
    assert (folder / "attempts.jsonl").read_bytes() == before
    assert not (folder / "exits" / "27-1").exists()
    assert "was taken over by job 75 since this job's last attempt" in capsys.readouterr().err


def test_a_job_starting_in_a_folder_another_used_before_goes_on_with_its_run(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    started(folder, job="27")
    assert batch.after_this_job(attempts.read(folder), "75") is None
    assert batch.after_this_job(attempts.read(folder), "27") is None


def test_the_attempt_numbers_of_begin_and_the_record_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33 item 10: `begin` said "attempt 1 of job 28" where the record (every job's attempts in the
    folder) says attempt 3."""
    folder = tmp_path / "run"
    for job in ("26", "27"):
        started(folder, job=job)
        attempts.append(
            folder, {"event": "end", "job": job, "restart": 0, "outcome": "completed", "time": 1.0}
        )
    fake = FakeSlurm()
    fake.submit("28", state="RUNNING")
    assert batch.begin(["--folder", str(folder)], "", environ("28"), client(fake)) == exitcodes.OK
    assert "attempt 3 of job 28 (restart 0)" in capsys.readouterr().err
    started(folder, job="28")
    assert attempts.find(attempts.read(folder), "28", 0).number == 3  # type: ignore[union-attr]


# ----- a run folder that turns read-only --------------------------------------------------------------------


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A run folder that turns read-only, as an ext4 remounted after an error does: a read-only bind mount of
    it over itself (EROFS on every write, root included), undone afterwards."""
    folder = tmp_path / "run"
    started(folder)
    attempts.append(
        folder, {"event": "end", "job": "6031", "restart": 0, "outcome": "preempted", "time": 101.0}
    )
    mount = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root): {mount.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)


def test_a_read_only_run_folder_stops_the_job_in_one_line_without_a_requeue(
    read_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33 item 8: rank 0 died on EROFS and `end` requeued anyway, to fail the same way; the next
    `begin` crashed with a traceback. Now `end` stops the job (exit 1, one line naming the cause), and a
    `begin` in such a folder stops before srun, in one line too."""
    fake = FakeSlurm()
    fake.submit("6031", state="RUNNING", node_list="node[1-2]", restarts=1)
    env = environ(restart=1)
    argv = ["--folder", str(read_only)]
    assert batch.end(argv, 1, "", env, client(fake)) == exitcodes.FAILED
    err = capsys.readouterr().err
    assert f"run folder {read_only} cannot be written (Read-only file system)" in err
    assert "Traceback" not in err
    assert not [c for c in fake.calls if c[0] == "scancel" or c[1:2] in (("requeue",), ("requeuehold",))]
    assert "could not be written to" in err  # the record it could not keep is said, once
    assert batch.begin(argv, "", env, client(fake)) == exitcodes.FAILED
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "cannot be written (Read-only file system)" in err and "Traceback" not in err
    )
