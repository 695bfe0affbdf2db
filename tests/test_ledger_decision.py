"""The one decision (hpc_ddp.ledger.decision.decide) as a table over its inputs: how the attempt ended, the budgets
left, and the allocation's facts (the job over, a stop asked for, a restart in place, the usable nodes left,
--min-nodes, --wait-for-nodes, a run that ended without a lost node). Every actor calls this function and acts on
what it returns (issue 43 item 5); the supervisors' own tables (tests/test_supervisor.py, test_launch_slurm_*.py,
test_launch_spares.py) check the same decisions end to end."""

from __future__ import annotations

import pytest

from hpc_ddp.ledger import decision, outcomes
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.decision import Budgets, Facts, InPlace, Placement, Smaller
from hpc_ddp.run.config import accum_for
from hpc_ddp.run.loop.preemption import decide as rank0_decide

SLURM = Budgets(max_restarts=2, max_requeue=1, again=outcomes.REQUEUE)
LOCAL = Budgets(max_restarts=2, max_requeue=1, again=outcomes.RESTART)
MIN1 = Smaller(least=1, per_node=2, batch=8, grad_accum=2)
SPARE = InPlace(Placement(("n1", "n3"), left=("n2",), spares_in=("n3",)), ran=2, leave=("n2",))
SHRUNK = InPlace(Placement(("n1",), left=("n2",)), ran=2, leave=("n2",), rule=MIN1)
KEPT = InPlace(Placement(("n1", "n2"), spares=("n3",)), ran=2, leave=(), kept="n2")


def attempt(
    number: int, outcome: str, node: str | None = None, signature: str = "", checkpoint: int = 0
) -> Attempt:
    return Attempt(
        "7",
        number - 1,
        number=number,
        outcome=outcome,
        node=node,
        blamed=node is not None,
        signature=signature or f"error {number}",
        checkpoint=checkpoint,
    )


FAILED_ONCE = [attempt(1, outcomes.FAILED, checkpoint=0)]
PREEMPTED_ONCE = [attempt(1, outcomes.PREEMPTED)]


@pytest.mark.parametrize(
    ("history", "outcome", "node", "budgets", "facts", "action", "nodes", "on", "words"),
    [
        # the budgets alone (a supervisor that knows nothing of nodes)
        ([], outcomes.COMPLETED, None, SLURM, Facts(), outcomes.DONE, None, (), "finished"),
        (
            [],
            outcomes.FAILED,
            None,
            SLURM,
            Facts(),
            outcomes.REQUEUE,
            None,
            (),
            "failure 1 of --max-restarts 2",
        ),
        (
            [],
            outcomes.FAILED,
            None,
            LOCAL,
            Facts(),
            outcomes.RESTART,
            None,
            (),
            "failure 1 of --max-restarts 2",
        ),
        (FAILED_ONCE * 2, outcomes.FAILED, None, SLURM, Facts(), outcomes.STOP, None, (), "crash loop"),
        (
            [],
            outcomes.PREEMPTED,
            None,
            SLURM,
            Facts(),
            outcomes.REQUEUE,
            None,
            (),
            "requeue 1 of --max-requeue 1",
        ),
        (PREEMPTED_ONCE, outcomes.PREEMPTED, None, SLURM, Facts(), outcomes.STOP, None, (), "budget spent"),
        ([], outcomes.STOPPED, None, SLURM, Facts(), outcomes.STOP, None, (), "not requeued"),
        ([], outcomes.USAGE, None, SLURM, Facts(), outcomes.STOP, None, (), "fails the same way"),
        ([], outcomes.NONFINITE, None, SLURM, Facts(), outcomes.STOP, None, (), "fails the same way"),
        # the job is over: whatever ended it, it stops
        ([], outcomes.FAILED, "n2", SLURM, Facts(over=True), outcomes.STOP, None, (), "the job is over"),
        ([], outcomes.COMPLETED, None, SLURM, Facts(over=True), outcomes.STOP, None, (), "the job is over"),
        # a stop the launcher was asked for wins over a restart, never over a stop
        (
            [],
            outcomes.FAILED,
            None,
            LOCAL,
            Facts(stop="interrupted (Ctrl-C)"),
            outcomes.STOP,
            None,
            (),
            "not restarted",
        ),
        ([], outcomes.USAGE, None, LOCAL, Facts(stop="x"), outcomes.STOP, None, (), "fails the same way"),
        # a restart in place: only for a failure the budgets start again
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(in_place=SPARE),
            outcomes.RESTART,
            None,
            ("n1", "n3"),
            "spare n3 in",
        ),
        (
            [],
            outcomes.FAILED,
            "n2",
            LOCAL,
            Facts(in_place=SPARE),
            outcomes.RESTART,
            None,
            ("n1", "n3"),
            "n2 left",
        ),
        (
            [],
            outcomes.FAILED,
            "n2",
            SLURM,
            Facts(in_place=SHRUNK),
            outcomes.RESTART,
            None,
            ("n1",),
            "--min-nodes 1",
        ),
        (
            [],
            outcomes.FAILED,
            "n2",
            SLURM,
            Facts(in_place=KEPT),
            outcomes.RESTART,
            None,
            ("n1", "n2"),
            "n2 kept",
        ),
        ([], outcomes.PREEMPTED, None, SLURM, Facts(in_place=SPARE), outcomes.REQUEUE, None, (), "requeue 1"),
        (
            FAILED_ONCE * 2,
            outcomes.FAILED,
            None,
            SLURM,
            Facts(in_place=SPARE),
            outcomes.STOP,
            None,
            (),
            "crash",
        ),
        # a requeue against the usable nodes left (blamed n2; the job ran on 2)
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=2, usable=2),
            outcomes.REQUEUE,
            None,
            (),
            "restarting",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=2, usable=None),
            outcomes.REQUEUE,
            None,
            (),
            "restarting",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=2, usable=1),
            outcomes.STOP,
            None,
            (),
            "cannot requeue",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=2, usable=1, rule=MIN1),
            outcomes.REQUEUE,
            1,
            (),
            "the global batch stays 64 (--grad-accum 4)",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=2, usable=0, rule=MIN1),
            outcomes.STOP,
            None,
            (),
            "at least 1",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=3, usable=2, spares=1),
            outcomes.REQUEUE,
            2,
            (),
            "0 of its",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ran=2, usable=1, wait=True),
            outcomes.REQUEUE,
            None,
            (),
            "waits",
        ),
        # no node blamed: nothing to fit, whatever sinfo says
        ([], outcomes.FAILED, None, SLURM, Facts(ran=2, usable=0), outcomes.REQUEUE, None, (), "restarting"),
        # a run that ended (not pending): only a lost node brings it back
        (
            [],
            outcomes.FAILED,
            None,
            SLURM,
            Facts(ended=True),
            outcomes.STOP,
            None,
            (),
            "no node of it failed",
        ),
        (
            [],
            outcomes.NODE_FAIL,
            "n2",
            SLURM,
            Facts(ended=True, ran=2, usable=2),
            outcomes.REQUEUE,
            None,
            (),
            "restart",
        ),
    ],
)
def test_the_decision_over_its_inputs(
    history: list[Attempt],
    outcome: str,
    node: str | None,
    budgets: Budgets,
    facts: Facts,
    action: str,
    nodes: int | None,
    on: tuple[str, ...],
    words: str,
) -> None:
    this = attempt(len(history) + 1, outcome, node, signature="error 1" if history else "")
    got = decision.decide(history, this, budgets, facts)
    assert (got.action, got.nodes, got.on) == (action, nodes, on), got
    assert words in got.message, got.message
    if on:  # a restart in place carries the step's moves, as the record keeps them
        assert (got.left, got.spares_in) == (
            facts.in_place.placement.left,
            facts.in_place.placement.spares_in,
        )  # type: ignore[union-attr]


def test_the_exclusion_is_every_node_blamed_and_a_requeue_keeps_what_the_job_avoids_already() -> None:
    this = attempt(2, outcomes.NODE_FAIL, "n3")
    got = decision.decide([attempt(1, outcomes.FAILED, "n2")], this, SLURM)
    assert got.exclude == ("n2", "n3")
    assert decision.avoided(got, ("n9",)) == ("n9", "n2", "n3")
    short = decision.decide([], this, SLURM, Facts(ran=2, usable=0, excluded=("n9",)))
    assert short.action == outcomes.STOP and short.exclude == ("n9", "n3")  # as the stop says it


def test_the_advice_is_data_apart_from_the_message() -> None:
    """A spent budget says why (the message) and what to do (the advice) apart: nobody cuts a message."""
    got = decision.decide(PREEMPTED_ONCE, attempt(2, outcomes.PREEMPTED), SLURM)
    assert got.message == "requeue budget spent (1 of --max-requeue 1), not requeued"
    assert got.advice == "Resume with the same command and --folder"
    assert got.said == f"{got.message}. {got.advice}"


@pytest.mark.parametrize(("preempted", "max_requeue"), [(0, 0), (0, 1), (1, 1), (2, 3)])
def test_rank_0_deciding_alone_takes_the_same_decision(preempted: int, max_requeue: int) -> None:
    history = [attempt(n + 1, outcomes.PREEMPTED) for n in range(preempted)]
    budgets = Budgets(0, max_requeue, outcomes.REQUEUE)
    supervisor = decision.decide(history, attempt(preempted + 1, outcomes.PREEMPTED), budgets)
    alone = rank0_decide(1, 0, preempted, max_requeue)
    assert alone.requeue is (supervisor.action == outcomes.REQUEUE)
    assert supervisor.said in alone.message


@pytest.mark.parametrize(("accum", "saved", "now"), [(1, 4, 2), (2, 4, 3), (3, 6, 4), (1, 2, 2), (4, 8, 16)])
def test_the_ledgers_batch_arithmetic_is_the_resizes(accum: int, saved: int, now: int) -> None:
    assert decision.kept_accum(accum, saved, now) == accum_for(accum, saved, now)
