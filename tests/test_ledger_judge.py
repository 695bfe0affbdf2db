"""The one judge and its rules as tables (hpc_ddp.ledger.judge, hpc_ddp.ledger.rules, hpc_ddp.ledger.outcomes):
how a job `submit --wait` followed ended, an attempt whose batch shell died, a requeue Slurm made itself, the
requeue budget, the counts each budget reads, and the one outcome-to-exit-code mapping (pure).

The judge's first-cause rules and `decide` have their tables in tests/test_run_retry_rules.py."""

from __future__ import annotations

import pytest

from hpc_ddp import exitcodes
from hpc_ddp.ledger import judge, outcomes, rules
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.run.loop import preemption
from hpc_ddp.scheduler.base import End
from hpc_ddp.scheduler.slurm.states import TABLE, JobState

pytestmark = pytest.mark.unit

PRE, NAN, USE = exitcodes.PREEMPTED, exitcodes.NONFINITE, exitcodes.USAGE


@pytest.mark.parametrize(
    "end, code, hang, saved, unwritable, outcome, signature, exit_code",
    [
        (End.EXITED, 1, True, False, "", "hang", "hang", exitcodes.HANG),  # the verdict wins over srun's code
        (End.TIME_LIMIT, 0, True, False, "", "hang", "hang", exitcodes.HANG),
        (End.CANCELLED, 0, True, False, "", "stopped", "cancelled", 1),  # a cancel is no hang
        (End.EXITED, NAN, False, False, "", "nonfinite", "nonfinite", NAN),
        (End.EXITED, PRE, False, False, "", "stopped", judge.SIGNALLED, PRE),  # saved, not started again
        (End.CANCELLED, 0, False, True, "", "stopped", judge.SAVED, PRE),  # the ranks saved first
        (End.PREEMPTED, 0, False, True, "", "stopped", judge.SAVED, PRE),
        (End.TIME_LIMIT, 0, False, False, "", "stopped", judge.TIMED_OUT, 1),  # killed before any save
        (End.EXITED, 1, False, False, "Read-only file system", "failed", judge.UNWRITABLE, 1),
        (End.EXITED, USE, False, False, "", "usage", "usage", USE),
        (End.NODE_FAILURE, USE, False, False, "", "usage", "usage", USE),
        (End.NODE_FAILURE, 1, False, False, "", "node_fail", "node failure", 1),
        (End.EXITED, 1, False, False, "", "failed", "exit 1", 1),
        (End.OUT_OF_MEMORY, 0, False, False, "", "failed", "exit 0", 1),
        (End.CANCELLED, 0, False, False, "", "stopped", "cancelled", 1),
        (End.DEADLINE, 0, False, False, "", "stopped", "deadline", 1),
        (End.BOOT_FAILURE, 0, False, False, "", "stopped", "boot failure", 1),
    ],
)
def test_how_a_followed_job_ended(
    end: End,
    code: int,
    hang: bool,
    saved: bool,
    unwritable: str,
    outcome: str,
    signature: str,
    exit_code: int,
) -> None:
    ending = judge.job_end(end, code, hang, saved, unwritable)
    assert (ending.outcome, ending.signature, ending.exit_code) == (outcome, signature, exit_code)


@pytest.mark.parametrize(
    "end, lost, outcome, signature, exit_code",
    [
        (None, ("node2",), "node_fail", "node failure node2", 1),
        (End.NODE_FAILURE, (), "node_fail", "node failure", 1),
        (End.TIME_LIMIT, (), "stopped", "timeout", 1),  # nothing saved: a failure's exit code
        (End.CANCELLED, (), "stopped", "cancelled", 1),
        (End.DEADLINE, (), "stopped", "deadline", 1),
        (End.EXITED, (), "lost", "lost", 1),
        (None, (), "lost", "lost", 1),
    ],
)
def test_an_attempt_whose_batch_shell_died(
    end: End | None, lost: tuple[str, ...], outcome: str, signature: str, exit_code: int
) -> None:
    ending = judge.unrecorded(("node1", "node2"), end, "FAILED" if end else "", lost)
    assert (ending.outcome, ending.signature, ending.exit_code) == (outcome, signature, exit_code)
    assert ending.blamed == bool(lost)


@pytest.mark.parametrize(
    "status, requeued, node_fail, preempted",
    [
        (PRE, True, False, True),  # scontrol requeue / PreemptMode=REQUEUE with every node up
        (1, True, False, True),
        (PRE, True, True, False),  # a node failure: judged from the evidence
        (PRE, False, False, False),
        (0, True, False, False),  # the tasks finished: nothing to judge here
    ],
)
def test_a_requeue_the_scheduler_made(status: int, requeued: bool, node_fail: bool, preempted: bool) -> None:
    ending = judge.requeued_by_scheduler(status, requeued, node_fail)
    assert (ending is not None and ending.outcome == outcomes.PREEMPTED) is preempted


@pytest.mark.parametrize(
    "done, budget, ok, words",
    [
        (0, 0, False, "requeue budget spent (0 of --max-requeue 0), not requeued"),
        (0, 1, True, "requeue 1 of --max-requeue 1"),
        (2, 3, True, "requeue 3 of --max-requeue 3"),
        (3, 3, False, "requeue budget spent (3 of --max-requeue 3), not requeued"),
    ],
)
def test_the_requeue_budget_is_one_rule_for_every_decider(
    done: int, budget: int, ok: bool, words: str
) -> None:
    rule = rules.requeue_budget(done, budget)
    assert rule.ok is ok and rule.message.startswith(words)
    alone = preemption.decide(1, 0, done, budget)  # rank 0 deciding alone (--requeue-by scontrol)
    assert alone.requeue is ok and words in alone.message
    history = [Attempt("7", r, number=r + 1, outcome=outcomes.PREEMPTED) for r in range(done)]
    this = Attempt("7", done, number=done + 1, outcome=outcomes.PREEMPTED)
    decision = rules.decide(history, this, 0, max_requeue=budget)  # a supervisor
    assert (decision.action == outcomes.REQUEUE) is ok and words in decision.message


def test_each_budget_counts_its_own_outcomes() -> None:
    history = [
        Attempt("7", r, number=r + 1, outcome=o)
        for r, o in enumerate(["preempted", "failed", "hang", "node_fail", "lost", "stopped", "usage"])
    ]
    assert rules.preemptions(history) == 1
    assert rules.failures(history) == 4 == len(outcomes.FAILURES)


@pytest.mark.parametrize(
    "outcome, saved, code",
    [
        ("preempted", True, PRE),
        ("stopped", True, PRE),
        ("preempted", False, 1),  # the scheduler ended it before the ranks could save
        ("stopped", False, 1),
        ("failed", False, 1),
        ("usage", True, USE),
    ],
)
def test_one_exit_code_mapping_with_the_save(outcome: str, saved: bool, code: int) -> None:
    assert outcomes.exit_code(outcome, saved=saved) == code


@pytest.mark.parametrize("word", sorted(TABLE))
def test_each_terminal_state_says_how_its_run_ended(word: str) -> None:
    """The state table gives the judge neutral words (End) for every state that ends a run, and only those."""
    state = JobState(word)
    assert (state.end is not None) == state.done
    assert state.said  # `submit --wait`'s words for it
