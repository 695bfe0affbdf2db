"""--min-nodes (issue 20 item 3): the pure parts as tables, and the batch shell's `end` over a fake cluster
(tests/fake_slurm.py). The same path runs for real on the local cluster in
tests/test_launch_slurm_fsdp.py."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from fake_slurm import FakeSlurm
from plugin_scheduler import calls, client, through_the_plugin  # noqa: F401 (an autouse fixture)

from hpc_ddp import exitcodes
from hpc_ddp.errors import CheckpointError, UsageError
from hpc_ddp.launch.slurm import batch, min_nodes
from hpc_ddp.ledger import attempts, decision, outcomes, rules
from hpc_ddp.run.checkpoint import resume, sharded
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.config import TrainConfig, accum_for, check_min_nodes
from hpc_ddp.scheduler.slurm.client import Size, requeue_steps
from hpc_ddp.scheduler.slurm.parse import JobInfo
from hpc_ddp.scheduler.slurm.request import TASK_COUNT

FSDP = {"strategy": "fsdp", "allow_resize": True}


@pytest.fixture(autouse=True)
def keep_signal_mask() -> Iterator[None]:
    """`end` blocks SIGTERM before it requeues or cancels (that ends the real batch shell): undo it here."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# ----- the option against the job ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, nodes, per_node, error",
    [
        ({}, 2, 2, None),  # off
        ({"min_nodes": 2}, 2, 2, None),  # every node: nothing changes, any strategy
        ({"min_nodes": 1, **FSDP}, 2, 2, None),
        ({"min_nodes": 1, **FSDP}, 1, None, None),  # the job already runs on its least
        ({"min_nodes": 3, **FSDP}, 2, 2, "--min-nodes 3 is more than the job's 2 node(s) (--nodes). Fix"),
        ({"min_nodes": 1}, 2, 2, "ddp's full checkpoint resumes only on the world size that wrote it"),
        (
            {"min_nodes": 1, "strategy": "fsdp", "checkpoint_format": "full", "allow_resize": True},
            2,
            2,
            "--checkpoint-format full's full checkpoint resumes only on the world size that wrote it",
        ),
        ({"min_nodes": 1, "strategy": "fsdp"}, 2, 2, "which changes the world size: add --allow-resize"),
        ({"min_nodes": 1, **FSDP}, 2, None, "the job has no --ntasks-per-node"),
    ],
)
def test_min_nodes_against_the_job(
    options: dict, nodes: int, per_node: int | None, error: str | None
) -> None:
    cfg = TrainConfig(**options)
    if error is None:
        check_min_nodes(cfg, nodes, per_node)
    else:
        with pytest.raises(UsageError, match=error.replace("(", r"\(").replace(")", r"\)")):
            check_min_nodes(cfg, nodes, per_node)


def test_a_negative_min_nodes_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--min-nodes -1: must be 0 or more"):
        TrainConfig(min_nodes=-1)


@pytest.mark.parametrize(
    "accum, saved, now, expected",
    [(1, 4, 2, 2), (3, 2, 3, 2), (1, 3, 2, None), (2, 2, 4, 1), (1, 2, 4, None)],
)
def test_the_grad_accum_that_keeps_the_global_batch(
    accum: int, saved: int, now: int, expected: int | None
) -> None:
    assert accum_for(accum, saved, now) == expected


# ----- the decision ------------------------------------------------------------------------------------------

REQUEUE = rules.Decision(outcomes.REQUEUE, "restarting from the checkpoint at step 8", ("node2",))
RULE = min_nodes.Smaller(least=1, per_node=2, batch=32, grad_accum=1)


@pytest.mark.parametrize(
    "states, excluded, rule, action, nodes",
    [
        # node3 free: the job fits on node1,node3 as it is
        ({"node1": "idle", "node2": "idle", "node3": "idle"}, "", RULE, outcomes.REQUEUE, None),
        # node3 kept out from the start (--exclude): one usable node left; --min-nodes 1 goes on with it
        ({"node1": "idle", "node2": "idle", "node3": "idle"}, "node3", RULE, outcomes.REQUEUE, 1),
        (
            {"node1": "alloc", "node2": "idle", "node3": "drain"},
            "",
            RULE,
            outcomes.REQUEUE,
            1,
        ),  # busy is usable
        # without --min-nodes (or without tasks per node) it stops, as before
        (
            {"node1": "idle", "node2": "idle", "node3": "idle"},
            "node3",
            min_nodes.EVERY_NODE,
            outcomes.STOP,
            None,
        ),
        (
            {"node1": "idle", "node2": "idle", "node3": "idle"},
            "node3",
            min_nodes.Smaller(1, 0, 32, 1),
            outcomes.STOP,
            None,
        ),
        # fewer than --min-nodes left: stop
        ({"node1": "down", "node2": "idle", "node3": "drain"}, "", RULE, outcomes.STOP, None),
    ],
)
def test_fits_with_min_nodes(
    states: dict[str, str], excluded: str, rule: min_nodes.Smaller, action: str, nodes: int | None
) -> None:
    scheduler = client(FakeSlurm(states))  # the test plugin's (tests/plugin_scheduler.py)
    info = JobInfo({"Partition": "debug", "ExcNodeList": excluded or "(null)", "JobState": "RUNNING"})
    this = attempts.Attempt("7", 0, number=1, outcome=outcomes.FAILED)
    facts = min_nodes.facts(scheduler, this.outcome, REQUEUE.exclude, info.excluded, info.partition, 2, rule)
    decided = decision.on_allocation(REQUEUE, this, facts)
    assert calls() == ["usable"]  # the usable nodes left: the Scheduler interface's question
    assert (decided.action, decided.nodes) == (action, nodes)
    if action == outcomes.STOP:
        assert decided.message.startswith("cannot requeue: the job needs 2 node(s)")
        assert ("(at least 1, --min-nodes)" in decided.message) == (rule == RULE)


@pytest.mark.parametrize(
    "ran, left, rule, expected",
    [
        (
            2,
            1,
            RULE,
            "2 rank(s) instead of 4, its sharded checkpoint resharded (--allow-resize); the global batch "
            "stays 128 (--grad-accum 2)",
        ),
        (
            3,
            2,
            min_nodes.Smaller(2, 1, 8, 1),
            "2 rank(s) instead of 3, its sharded checkpoint resharded "
            "(--allow-resize); the global batch goes from 24 to 16 (no --grad-accum keeps it)",
        ),
    ],
)
def test_the_line_says_what_going_on_with_fewer_nodes_changes(
    ran: int, left: int, rule: min_nodes.Smaller, expected: str
) -> None:
    said = min_nodes.went_on(ran, left, ("node2",), rule)
    assert said.startswith(
        f"--min-nodes {rule.least}: it goes on with the {left} usable node(s) left of the {ran} it ran on "
        "(node2 excluded), "
    )
    assert said.endswith(expected)


# ----- what the requeue asks Slurm -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "already, excluded, steps",
    [
        (
            False,
            (),
            [
                ("scontrol", "requeuehold", "9"),
                ("scontrol", "update", "JobId=9", "ExcNodeList=node3,node2", "NumNodes=1", "NumTasks=2"),
                ("scontrol", "release", "9"),
            ],
        ),
        (  # Slurm requeued it (a node failure) and the nodes are excluded already: the size still changes
            True,
            ("node3", "node2"),
            [
                ("scontrol", "hold", "9"),
                ("scontrol", "update", "JobId=9", "ExcNodeList=node3,node2", "NumNodes=1", "NumTasks=2"),
                ("scontrol", "release", "9"),
            ],
        ),
    ],
)
def test_requeue_steps_on_fewer_nodes(already: bool, excluded: tuple[str, ...], steps: list) -> None:
    assert requeue_steps("9", ("node3", "node2"), excluded, already, Size(1, 2)) == steps


def test_the_size_comes_from_the_decision_and_the_tasks_per_node() -> None:
    decided = rules.Decision(outcomes.REQUEUE, "", ("node2",), nodes=1)
    assert min_nodes.size_for(decided, 4) == Size(1, 4)
    assert min_nodes.size_for(decided, None) is None  # no --ntasks-per-node
    assert min_nodes.size_for(REQUEUE, 4) is None


# ----- the batch shell's steps over a fake cluster --------------------------------------------------------


def environ(**extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "27",
        "SLURM_RESTART_COUNT": "0",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        **extra,
    }


def test_a_lost_node_with_min_nodes_goes_on_with_the_node_left(tmp_path: Path) -> None:
    """node3 drained, node2 lost under a 2-node job (Slurm requeued it): with --min-nodes 1 the job is requeued
    on node1 alone, its node and task counts lowered, instead of stopping
    (test_launch_slurm_batch.py: without it, the same job stops)."""
    fake = FakeSlurm({"node1": "idle", "node2": "down*", "node3": "drain"})
    fake.submit("27", state="PENDING", restarts=1, num_nodes="1")
    args = ["--folder", str(tmp_path), "--min-nodes", "1", "--strategy", "fsdp", "--allow-resize"]
    assert batch.end(args, 1, "", environ(), client(fake)) == 1  # as its tasks ended
    (lost,) = attempts.read(tmp_path)
    assert (lost.outcome, lost.decision, lost.exclude) == ("node_fail", "requeue", ("node2",))
    assert ("scontrol", "update", "JobId=27", "ExcNodeList=node2", "NumNodes=1", "NumTasks=2") in fake.calls
    job = fake.jobs["27"]
    assert (job.excluded, job.num_nodes, job.num_tasks, job.reason) == ("node2", "1", 2, "None")
    assert fake.count("scancel") == 0


def test_begin_refuses_min_nodes_that_cannot_work(tmp_path: Path) -> None:
    """slurm/ddp.sbatch takes the options as they come: `begin` checks them against the job (exit 2)."""
    args = ["--folder", str(tmp_path), "--min-nodes", "1"]
    with pytest.raises(UsageError, match="ddp's full checkpoint resumes only"):
        batch.begin(args, "", environ(), client(FakeSlurm()))
    ok = [*args, "--strategy", "fsdp", "--allow-resize"]
    assert batch.begin(ok, "", environ(), client(FakeSlurm())) == exitcodes.OK


# ----- the batch scripts' task count ----------------------------------------------------------------------


def ddp_sbatch_task_count() -> str:
    text = (ROOT / "slurm" / "ddp.sbatch").read_text()
    block = text[text.index("# A job that went on with fewer nodes") :]
    return block[: block.index("\n\n")]


@pytest.mark.parametrize("script", [TASK_COUNT, ddp_sbatch_task_count()], ids=["submit", "ddp.sbatch"])
@pytest.mark.parametrize(
    "variables, expected",
    [
        # requeued onto 1 node: sbatch's count from the submission (4) is more than the allocation holds
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "4"}, "2 2"),
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4"}, "4 -"),  # as it was
        (
            {"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "6"},
            "6 -",
        ),  # the user's
        ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "5"}, "5 -"),  # no --ntasks-per-node
    ],
)
def test_the_batch_scripts_take_the_task_count_from_the_allocation(
    script: str, variables: dict[str, str], expected: str
) -> None:
    out = subprocess.run(
        ["bash", "-c", f'set -euo pipefail\n{script}\necho "$SLURM_NTASKS ${{SLURM_NPROCS:--}}"'],
        env={"PATH": "/usr/bin:/bin", **variables},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, expected, "")


# ----- the tasks' resume after going on with fewer nodes --------------------------------------------------


def fake_sharded(path: Path, world_size: int, grad_accum: int, asked: int | None = None) -> Path:
    """A sharded checkpoint's manifest alone: all that `resume.resize` reads (verify=False). `asked`: the
    command line's --grad-accum when a resize chose `grad_accum` (the checkpointer writes both)."""
    path.mkdir(parents=True)
    meta = {"world_size": world_size, "config": {"grad_accum": grad_accum, "batch_size": 32}}
    meta["asked_grad_accum"] = asked or grad_accum
    (path / sharded.MANIFEST).write_text(json.dumps({"files": {}, "meta": meta}))
    return path


def test_a_resized_run_requeued_again_keeps_the_grad_accum_the_resize_chose(tmp_path: Path) -> None:
    """4 ranks went on as 2 (--grad-accum 1 -> 2 keeps the batch); preempted there, the next attempt at 2
    ranks resumes with 2 too, though the command line still says 1. Before, it took 1 from the command line
    and the resume was refused ("written with --grad-accum 2 (now 1)")."""
    cfg = TrainConfig(strategy="fsdp", allow_resize=True, min_nodes=1)
    first, resized = resume.resize(cfg, fake_sharded(tmp_path / "a", 4, 1), 2, storage=Local())
    assert (
        first.grad_accum == 2 and resized is not None and resized.batch_after == resized.batch_before == 128
    )
    again, resized = resume.resize(cfg, fake_sharded(tmp_path / "b", 2, 2, asked=1), 2, storage=Local())
    assert again.grad_accum == 2 and resized is not None and (resized.saved, resized.now) == (2, 2)
    assert "goes on with the checkpoint's --grad-accum 2, which an earlier resize chose" in resized.describe()
    resume.check_compatible(
        {"world_size": 2, "config": again.as_dict()}, tmp_path / "b", again, 2, sharded.Sharded
    )


def test_a_second_shrink_keeps_the_global_batch_the_first_kept(tmp_path: Path) -> None:
    """4 ranks -> 2 (--grad-accum 1 -> 2) -> 1: the command line still says 1, which is what the checkpoint's
    run was asked, so the kit goes on keeping the batch (4)."""
    cfg = TrainConfig(strategy="fsdp", allow_resize=True, min_nodes=1)
    third, resized = resume.resize(cfg, fake_sharded(tmp_path / "c", 2, 2, asked=1), 1, storage=Local())
    assert third.grad_accum == 4 and resized is not None
    assert resized.batch_before == resized.batch_after == 32 * 4


def test_a_grad_accum_the_user_changed_at_the_same_size_is_refused_not_replaced(tmp_path: Path) -> None:
    """--allow-resize at the checkpoint's own size with a new --grad-accum: the user's change, refused as any
    must-match change (never silently replaced by the checkpoint's)."""
    cfg = TrainConfig(strategy="fsdp", allow_resize=True, grad_accum=3)
    same, resized = resume.resize(cfg, fake_sharded(tmp_path / "d", 2, 2), 2, storage=Local())
    assert (same.grad_accum, resized) == (3, None)
    with pytest.raises(CheckpointError, match=r"--grad-accum 2 \(now 3\)"):
        resume.check_compatible(
            {"world_size": 2, "config": {"grad_accum": 2}}, tmp_path / "d", same, 2, sharded.Sharded
        )


def test_the_batch_step_takes_the_grad_accum_of_a_resized_checkpoint(tmp_path: Path) -> None:
    """Second shrink, as `end` tells it (one task a node): 4 nodes went on as 2, whose latest checkpoint has
    --grad-accum 2 (a resize chose it; the command line says 1). That is what the tasks go on from, so going
    on with 1 node keeps the batch at 128 with --grad-accum 4."""
    from hpc_ddp.run.checkpoint import store

    assert store.MANIFEST == sharded.MANIFEST
    cfg = TrainConfig(strategy="fsdp", allow_resize=True, min_nodes=1)
    per_node = 1  # SLURM_NTASKS_PER_NODE
    checkpoints = CheckpointStore(tmp_path, Local())
    assert min_nodes.rule(cfg, per_node, checkpoints).grad_accum == 1  # no checkpoint yet: the command line
    ckpt = fake_sharded(tmp_path / "checkpoints" / "ckpt-00000010", 2, 2, asked=1)
    store.point_latest(tmp_path, ckpt, storage=Local())
    rule = min_nodes.rule(cfg, per_node, checkpoints)
    assert rule.grad_accum == 2
    assert "the global batch stays 128 (--grad-accum 4)" in min_nodes.went_on(2, 1, ["node2"], rule)
    changed = TrainConfig(strategy="fsdp", allow_resize=True, min_nodes=1, grad_accum=3)
    assert min_nodes.rule(changed, per_node, checkpoints).grad_accum == 3  # the user's own value
