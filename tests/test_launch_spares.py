"""Restarting inside the allocation (--spare-nodes), its pure rules: which nodes a step runs on
(hpc_ddp.launch.spares), when a requeue becomes a restart in place (the placement hpc_ddp.launch.slurm.inplace finds,
a fact of the ledger's one decision, hpc_ddp.ledger.decision), how a
step in place is numbered (hpc_ddp.cluster.env), and the shell text `begin` hands the batch script
(hpc_ddp.scheduler.slurm.steps). The real
thing, on the local Slurm cluster: tests/test_launch_slurm_inplace.py."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import replace

import pytest

from hpc_ddp.cluster.env import in_place, order, requeues, restart_count
from hpc_ddp.launch import spares
from hpc_ddp.launch.slurm import inplace, min_nodes
from hpc_ddp.ledger import attempts, decision, outcomes, rules
from hpc_ddp.scheduler.slurm import steps

N3 = ("node1", "node2", "node3")
N4 = ("node1", "node2", "node3", "node4")


@pytest.mark.parametrize(
    ("allocation", "spare", "batch", "nodes", "left_spare"),
    [
        (N3, 1, "node1", ("node2", "node3"), ("node1",)),  # the batch shell's node is the spare
        (N3, 1, "", ("node1", "node2"), ("node3",)),  # unknown batch host: the last node waits
        (N4, 2, "node1", ("node2", "node3"), ("node1", "node4")),
        (N3, 0, "node1", N3, ()),  # no spares: every node
        (("node1",), 1, "node1", ("node1",), ()),  # no more nodes than spares: all of them, none held back
        (("node2", "node3"), 1, "node2", ("node3",), ("node2",)),  # a requeued job on other nodes
    ],
)
def test_the_first_step_leaves_the_spares_out_the_batch_hosts_node_first(
    allocation: tuple[str, ...], spare: int, batch: str, nodes: tuple[str, ...], left_spare: tuple[str, ...]
) -> None:
    placed = spares.first(allocation, spare, batch)
    assert (placed.nodes, placed.spares) == (nodes, left_spare)


@pytest.mark.parametrize(
    ("allocation", "ran_on", "blamed", "least", "batch", "want"),
    [
        # a node lost (Slurm removed it): the spare (the batch shell's node) takes its place; rank 0's too
        (
            ("node1", "node2"),
            ("node2", "node3"),
            ("node3",),
            2,
            "node1",
            (("node1", "node2"), ("node3",), ("node1",), ()),
        ),
        (
            ("node1", "node3"),
            ("node2", "node3"),
            ("node2",),
            2,
            "node1",
            (("node1", "node3"), ("node2",), ("node1",), ()),
        ),
        # a GPU error blamed on node2: still in the allocation, left out all the same
        (N3, ("node2", "node3"), ("node2",), 2, "node1", (("node1", "node3"), ("node2",), ("node1",), ())),
        # a code error blames nothing: the same nodes, no spare spent
        (N3, ("node2", "node3"), (), 2, "node1", (("node2", "node3"), (), (), ("node1",))),
        # two spares: the one that is not the batch shell's first
        (
            N4,
            ("node2", "node3"),
            ("node3",),
            2,
            "node1",
            (("node2", "node4"), ("node3",), ("node4",), ("node1",)),
        ),
        # no spare left, --min-nodes 1: one node goes on
        (
            ("node1", "node3"),
            ("node1", "node3"),
            ("node2", "node3"),
            1,
            "node1",
            (("node1",), ("node3",), (), ()),
        ),
        # a node blamed before (excluded) is never taken back as a spare
        (N3, ("node1", "node3"), ("node2", "node3"), 1, "node1", (("node1",), ("node3",), (), ())),
    ],
)
def test_the_next_step_keeps_the_healthy_nodes_and_takes_spares_for_the_rest(
    allocation: tuple[str, ...],
    ran_on: tuple[str, ...],
    blamed: tuple[str, ...],
    least: int,
    batch: str,
    want: tuple[tuple[str, ...], ...],
) -> None:
    placed = spares.after(allocation, ran_on, blamed, least, batch)
    assert placed is not None
    assert (placed.nodes, placed.left, placed.spares_in, placed.spares) == want
    assert placed.shrunk == (len(placed.nodes) < len(ran_on))


@pytest.mark.parametrize(
    ("allocation", "ran_on", "blamed", "least"),
    [
        (("node1", "node3"), ("node1", "node3"), ("node3",), 2),  # no spare, no --min-nodes: requeue
        (("node1",), ("node1", "node3"), ("node3", "node1"), 1),  # nothing usable left
        ((), ("node1", "node2"), (), 1),
    ],
)
def test_no_placement_when_too_few_nodes_are_left(
    allocation: tuple[str, ...], ran_on: tuple[str, ...], blamed: tuple[str, ...], least: int
) -> None:
    assert spares.after(allocation, ran_on, blamed, least, "node1") is None


@pytest.mark.parametrize(
    ("signature", "node", "leave"),
    [
        ("signal SIGKILL", "node3", ("node2",)),  # the OOM killer, a user: the node stays in the step
        ("signal SIGSEGV", "node3", ("node2", "node3")),  # bad memory, maybe: a spare takes its place
        ("node failure node3", "node3", ("node2", "node3")),
        ("signal SIGKILL", "node2", ("node3",)),  # the killed rank's node stays; the other blamed one goes
    ],
)
def test_a_sigkill_spends_no_spare(signature: str, node: str, leave: tuple[str, ...]) -> None:
    assert spares.to_leave(("node2", "node3"), signature, node) == leave


def test_a_step_is_placed_by_its_environment_ranks_in_node_order() -> None:
    assert steps.step_environ(("node1", "node3"), 2, "/tmp/h") == {
        "SLURM_HOSTFILE": "/tmp/h",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "4",
        "SLURM_NPROCS": "4",
    }
    assert steps.hostfile_text(("node1", "node3"), 2) == "node1\nnode1\nnode3\nnode3\n"


REQUEUE = rules.Decision(
    outcomes.REQUEUE, "restarting from the checkpoint at step 4 (failure 1 of --max-restarts 3)"
)
ELASTIC = min_nodes.Smaller(least=1, per_node=2, batch=8, grad_accum=1)


def plan(
    base: rules.Decision,
    outcome: str,
    spare: int,
    allocation: tuple[str, ...],
    ran_on: tuple[str, ...],
    batch_host: str,
    rule: min_nodes.Smaller,
    signature: str = "",
    node: str | None = None,
) -> tuple[rules.Decision, spares.Placement | None]:
    """The budgets' decision `base` made whole by the allocation's facts (the batch shell's way): the decision,
    and the placement it restarts on (None: no restart in place)."""
    here = inplace.placement(
        outcome, spare, allocation, ran_on, batch_host, rule, base.exclude, signature, node
    )
    this = attempts.Attempt("7", 0, number=1, outcome=outcome, signature=signature, node=node)
    got = decision.on_allocation(base, this, decision.Facts(in_place=here))
    return got, here.placement if here is not None and got.on else None


@pytest.mark.parametrize(
    ("decision", "outcome", "spare", "allocation", "rule", "action", "message"),
    [
        (
            rules.Decision(outcomes.REQUEUE, REQUEUE.message, ("node3",)),
            outcomes.NODE_FAIL,
            1,
            ("node1", "node2"),
            min_nodes.EVERY_NODE,
            outcomes.RESTART,
            f"{REQUEUE.message}, in place on node1,node2 (node3 left, spare node1 in, 0 spare(s) left)",
        ),
        (  # a code error: the same nodes, no spare spent
            REQUEUE,
            outcomes.FAILED,
            1,
            N3,
            min_nodes.EVERY_NODE,
            outcomes.RESTART,
            f"{REQUEUE.message}, in place on node2,node3 (1 spare(s) left)",
        ),
        (  # no spare left, --min-nodes 1: fewer nodes, said as a --min-nodes requeue says it
            rules.Decision(outcomes.REQUEUE, REQUEUE.message, ("node1", "node3")),
            outcomes.FAILED,
            1,
            ("node2", "node3"),
            ELASTIC,
            outcomes.RESTART,
            f"{REQUEUE.message}, in place on node2 (node3 left, 0 spare(s) left); --min-nodes 1: it goes on with "
            "the 1 usable node(s) left of the 2 it ran on (node1,node3 excluded), 2 rank(s) instead of 4",
        ),
        (  # no spare left, no --min-nodes: today's requeue
            rules.Decision(outcomes.REQUEUE, REQUEUE.message, ("node1", "node3")),
            outcomes.FAILED,
            1,
            ("node2", "node3"),
            min_nodes.EVERY_NODE,
            outcomes.REQUEUE,
            REQUEUE.message,
        ),
        (  # a hang verdict blames the stuck rank's node: the spare
            rules.Decision(outcomes.REQUEUE, REQUEUE.message, ("node3",)),
            outcomes.HANG,
            1,
            N3,
            min_nodes.EVERY_NODE,
            outcomes.RESTART,
            f"{REQUEUE.message}, in place on node1,node2 (node3 left, spare node1 in, 0 spare(s) left)",
        ),
        (REQUEUE, outcomes.PREEMPTED, 1, N3, min_nodes.EVERY_NODE, outcomes.REQUEUE, REQUEUE.message),
        (REQUEUE, outcomes.FAILED, 0, N3, min_nodes.EVERY_NODE, outcomes.REQUEUE, REQUEUE.message),
        (
            rules.Decision(outcomes.STOP, "crash loop: ..."),
            outcomes.FAILED,
            1,
            N3,
            min_nodes.EVERY_NODE,
            outcomes.STOP,
            "crash loop: ...",
        ),
    ],
)
def test_only_a_failure_of_a_job_with_spares_restarts_in_place(
    decision: rules.Decision,
    outcome: str,
    spare: int,
    allocation: tuple[str, ...],
    rule: min_nodes.Smaller,
    action: str,
    message: str,
) -> None:
    got, placement = plan(decision, outcome, spare, allocation, ("node2", "node3"), "node1", rule)
    assert got.action == action
    assert got.message.startswith(message), got.message
    assert (placement is not None) == (action == outcomes.RESTART)
    if placement is not None:
        assert (got.left, got.spares_in) == (placement.left, placement.spares_in)


def test_a_rank_sigkilled_restarts_on_the_same_nodes_blamed_but_kept() -> None:
    decision = rules.Decision(outcomes.REQUEUE, REQUEUE.message, ("node3",))
    got, placement = plan(
        decision,
        outcomes.FAILED,
        1,
        N3,
        ("node2", "node3"),
        "node1",
        min_nodes.EVERY_NODE,
        "signal SIGKILL",
        "node3",
    )
    assert placement is not None and placement.nodes == ("node2", "node3") and placement.left == ()
    assert got.action == outcomes.RESTART and got.exclude == ("node3",)  # blamed as ever: a requeue avoids it
    assert got.message.endswith("(1 spare(s) left) (node3 kept: a SIGKILL is no sign of bad hardware)")


@pytest.mark.parametrize(
    ("environ", "restart"),
    [
        ({}, 0),
        ({"SLURM_RESTART_COUNT": "2"}, 2),
        ({"HPC_DDP_IN_PLACE": "1"}, 1000),
        ({"SLURM_RESTART_COUNT": "2", "HPC_DDP_IN_PLACE": "3"}, 3002),
    ],
)
def test_a_step_in_place_has_a_restart_count_of_its_own_and_keeps_slurms(
    environ: dict[str, str], restart: int
) -> None:
    got = restart_count(environ)
    assert got == restart
    assert requeues(got) == int(environ.get("SLURM_RESTART_COUNT", "0"))
    assert in_place(got) == int(environ.get("HPC_DDP_IN_PLACE", "0"))


def test_attempts_sort_by_requeue_then_step() -> None:
    assert sorted([1, 2000, 1000, 0, 1001], key=order) == [0, 1000, 2000, 1, 1001]


def test_the_ledger_keeps_which_nodes_left_and_which_spares_came_in() -> None:
    attempt = attempts.Attempt("7", 0, outcome=outcomes.NODE_FAIL, left=("node3",), spares_in=("node1",))
    record = attempts.end_record(attempt, now=1.0)
    assert (record["left"], record["spares_in"]) == (["node3"], ["node1"])
    (merged,) = attempts.merge([record])
    assert (merged.left, merged.spares_in) == (("node3",), ("node1",))
    assert "left" not in attempts.end_record(attempts.Attempt("7", 0), now=1.0)


def test_the_batch_scripts_srun_function_records_its_arguments_and_places_the_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The text `begin` prints, run by bash with a stand-in srun on PATH: the script's own srun line starts
    the step through the environment, and its arguments are kept for the steps in place."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/sh\necho "$SLURM_HOSTFILE $SLURM_NNODES $SLURM_NTASKS $*"; cat "$SLURM_HOSTFILE"\n'
    )
    (bin_dir / "srun").chmod(0o755)
    placed = spares.first(N3, 1, "node1")
    args_file = tmp_path / "args"
    text = steps.shell_function(placed.nodes, 2, str(tmp_path / "hosts"), str(args_file))
    (tmp_path / "hosts").write_text(steps.hostfile_text(placed.nodes, 2))
    out = subprocess.run(
        ["bash", "-c", f'{text}\nsrun --kill-on-bad-exit=1 python -c "print(1)" "a b"'],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == [
        f"{tmp_path / 'hosts'} 2 4 --kill-on-bad-exit=1 python -c print(1) a b",
        "node2",
        "node2",
        "node3",
        "node3",
    ]
    assert steps.step_args({"HPC_DDP_STEP_ARGS": str(args_file)}) == [
        "--kill-on-bad-exit=1",
        "python",
        "-c",
        "print(1)",
        "a b",
    ]


def test_the_record_says_a_restart_in_place_and_what_it_cost() -> None:
    failed = attempts.Attempt(
        "7",
        0,
        number=1,
        ended=100.0,
        outcome=outcomes.NODE_FAIL,
        decision=outcomes.RESTART,
        left=("node2",),
        spares_in=("node1",),
    )
    again = attempts.Attempt("7", 1000, number=2, started=108.0, nodes=("node1", "node3"), resumed_from=4)
    assert attempts.start_line(again) == "attempt 2 on node1,node3 (restart in place 1): resumed from step 4"
    assert attempts.restarted_in_place([failed, again], again) == failed
    assert attempts.restarted_in_place([failed], failed) is None  # a first step
    requeued = attempts.Attempt("7", 1, number=2)
    assert attempts.restarted_in_place([failed, requeued], requeued) is None  # a requeue: Slurm's count
    assert attempts.recovery_line(failed, again, 111.25) == (
        "restart in place 1 of job 7 (node2 left, spare node1 in): 11.2 s from the failure of attempt 1 to "
        "the first step of attempt 2, without leaving the allocation"
    )


def test_goodput_counts_the_time_a_restart_in_place_held_the_allocation() -> None:
    """Between a failure and the step started in place the job held its nodes: allocated time (it lowers
    goodput), not a queue wait; a requeue's gap stays outside the allocation."""
    from hpc_ddp.report import page, timeline

    def run(second: int, decision: str) -> timeline.Summary:
        records = [
            {"event": "start", "job": "7", "restart": 0, "time": 10.0, "step": 0, "startup_s": 0.0},
            {"event": "step", "step": 1, "time": 20.0, "loss": 1.0},
            {"event": "start", "job": "7", "restart": second, "time": 60.0, "step": 0, "startup_s": 0.0},
            {"event": "step", "step": 1, "time": 70.0, "loss": 1.0},
        ]
        lines = [
            attempts.Attempt(
                "7", 0, started=10.0, ended=50.0, outcome="node_fail", step=1, decision=decision
            ),
            attempts.Attempt(
                "7", second, started=60.0, ended=80.0, outcome="completed", step=1, decision="done"
            ),
        ]
        return timeline.summarize(records, lines, running=False)

    held = run(1000, "restart")
    assert (held.held_s, held.queue_s, held.restarts_in_place, held.allocated_s) == (10.0, 0.0, 1, 70.0)
    assert held.attempts[0].recovery_s == 10.0  # its end (50) to the next one's first step (60)
    assert page._decision(held.attempts[0]) == "restart in place (same nodes; next step 10.0 s later)"
    (line,) = attempts.merge(
        [{"event": "end", "job": "7", "restart": 0, "time": 5.0, "left": ["node2"], "spares_in": ["node1"]}]
    )
    assert (line.left, line.spares_in) == (("node2",), ("node1",))
    moved = replace(held.attempts[0], left=("node2",), spares_in=("node1",))
    assert page._decision(moved) == "restart in place (node2 left, node1 in; next step 10.0 s later)"
    assert dict(page.headline(held))["restarts in place (allocation held)"] == "1: 10.0 s"
    queued = run(1, "requeue")
    assert (queued.held_s, queued.queue_s, queued.restarts_in_place, queued.allocated_s) == (
        0.0,
        10.0,
        0,
        60.0,
    )
    assert "restarts in place (allocation held)" not in dict(page.headline(queued))


def test_the_recovery_bench_reports_both_paths_and_its_two_targets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`python -m hpc_ddp.bench recovery` (hpc_ddp/bench/recovery.py; a minute a trial on the Slurm cluster,
    so not run here): its figures become rows and targets; without a cluster it says why it skipped."""
    from hpc_ddp.bench import report
    from hpc_ddp.bench.runs import Settings

    s = Settings(trials=2, steps=4, world_size=2, batch_size=32, work=tmp_path)
    results = {
        "recovery": {
            "requeue_s": 40.0,
            "in_place_s": 11.0,
            "in_place_vs_requeue": 0.275,
            "trials": {"requeue": [38.0, 42.0], "in_place": [10.0, 12.0]},
        }
    }
    found = {t.name: (t.value, t.op, t.threshold, t.met) for t in report.targets(results)}
    assert found == {
        "recovery in place, s": (11.0, "<=", 15.0, True),
        "recovery in place / requeue": (0.275, "<=", 0.3, True),
    }
    assert [r[1:] for r in report.rows(results, s)] == [
        ("node lost -> next step, requeue (2 nodes)", "40.0 s"),
        ("node lost -> next step, in place (2 + 1 spare)", "11.0 s"),
        ("in place / requeue", "0.28x"),
    ]
    skipped = {"recovery": {"skipped": "no Slurm cluster answers (sinfo)"}}
    assert report.targets(skipped) == []
    assert report.rows(skipped, s) == [("recovery", "skipped", "no Slurm cluster answers (sinfo)")]


@pytest.mark.slow
@pytest.mark.deadline(120)
def test_an_emulated_node_takes_over_in_place_of_a_blamed_one_locally(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`submit --local --spare-nodes 1`: the launcher emulates 3 nodes and runs 2; the ranks on 127.0.0.2
    raise a GPU ECC error (blamed), and the next start runs on 127.0.0.1,127.0.0.3: the Slurm story, on one
    machine, with the same placement rule."""
    from conftest import clean_environ, run_module

    folder = tmp_path / "run"
    proc = run_module(
        "hpc_ddp.submit",
        *("--local", "--nodes", "2", "--tasks-per-node", "1", "--folder", str(folder), "--spare-nodes", "1"),
        *("--task", "retry_tasks:node_fault", "--epochs", "2", "--save-every-steps", "2"),
        env=clean_environ(RETRY_BAD_NODE="127.0.0.2"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 nodes x 1 process + 1 spare node" in proc.stdout, proc.stdout
    failed, finished = attempts.read(folder)
    assert failed.nodes == ("127.0.0.1", "127.0.0.2")
    assert (failed.node, failed.blamed, failed.left, failed.spares_in) == (
        "127.0.0.2",
        True,
        ("127.0.0.2",),
        ("127.0.0.3",),
    )
    assert (finished.nodes, finished.outcome) == (("127.0.0.1", "127.0.0.3"), "completed")
    assert "(127.0.0.2 left, spare 127.0.0.3 in, 0 spare(s) left)" in proc.stdout, proc.stdout


def fit(base: rules.Decision, states: dict[str, str], needed: int, spares: int) -> rules.Decision:
    """The decision on a requeue once the usable nodes left are known (sinfo's `states`, through the scheduler)."""
    from fake_slurm import FakeSlurm

    from hpc_ddp.scheduler.slurm.client import SlurmClient

    client = SlurmClient(FakeSlurm(states))
    this = attempts.Attempt("7", 0, number=1, outcome=outcomes.NODE_FAIL)
    facts = min_nodes.facts(client, this.outcome, base.exclude, (), "debug", needed, spares=spares)
    return decision.on_allocation(base, this, facts)


def test_a_requeued_job_with_spares_goes_on_with_fewer_spares_first() -> None:
    """The batch shell's node (the spare) lost: the job is requeued away from it. Of its 3 nodes (2 + 1 spare)
    2 usable are left: it goes on without the spare, on the same 2 training nodes, instead of stopping."""
    decision = rules.Decision(outcomes.REQUEUE, "restarting from ...", ("node1",))
    states = {"node1": "down*", "node2": "idle", "node3": "idle"}
    got = fit(decision, states, 3, spares=1)
    assert (got.action, got.nodes) == (outcomes.REQUEUE, 2)
    assert got.message.endswith(
        "it goes on with 0 of its --spare-nodes 1 (the usable nodes left once node1 are excluded)"
    )
    stop = fit(decision, {**states, "node3": "down"}, 3, spares=1)
    assert stop.action == outcomes.STOP  # fewer than its training nodes: as without spares


def test_the_batch_hosts_node_is_lost_even_when_no_step_ran_there() -> None:
    from hpc_ddp.launch.slurm import lost
    from hpc_ddp.scheduler.slurm.parse import parse_job

    info = parse_job(
        "JobId=5 JobState=FAILED Reason=JobLaunchFailure Restarts=0 NodeList=node[2-3] BatchHost=node1"
    )
    assert lost.removed(("node2", "node3"), info, 0) == ("node1",)


def test_a_requeued_job_with_spares_keeps_the_size_it_trained_at(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hpc_ddp.launch.slurm import batch_begin
    from hpc_ddp.launch.slurm.job import Job
    from hpc_ddp.run.config import TrainConfig

    environ = {
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "node[2-3]",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURMD_NODENAME": "node2",
    }
    job = Job.read(["--spare-nodes", "1"], environ)  # the batch shell reads its environment once
    cfg = TrainConfig(spare_nodes=1)
    first = functools.partial(
        batch_begin.first_step, cfg.spare_nodes, job.tasks_per_node, job.allocation, job.batch_host
    )
    assert first().nodes == ("node3",)  # a new job: all but the spare
    assert first(2).nodes == ("node2", "node3")  # it trained on 2: no spare now
    attempts.record_start(tmp_path, "5", 0, ["node2", "node3"], ["node2", "node3"], None)
    assert batch_begin.trained_on(tmp_path, "5") == 2 and batch_begin.trained_on(tmp_path, "6") is None


def test_the_start_line_of_a_step_in_place_keeps_slurms_count_apart() -> None:
    from hpc_ddp.run.records.progress import event_line

    record = {"event": "start", "job": "5", "resumed": True, "epoch": 0, "step": 4, "world_size": 2}
    assert event_line({**record, "restart": 2001, "startup_s": 3.0}) == (
        "[run] start 1 (restart in place 2) of job 5: resumed at epoch 0, step 4; 2 ranks, 3.0 s from process "
        "start to the first step"
    )
    assert (event_line({**record, "restart": 1, "startup_s": 3.0}) or "").startswith(
        "[run] start 1 of job 5:"
    )
