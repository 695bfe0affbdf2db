"""The retry rules without a run: judging an attempt's end, deciding what comes next, the attempts record, and
the batch step's readings of Slurm's output (hpc_ddp.ledger.judge and rules, hpc_ddp.ledger.attempts,
hpc_ddp.launch.slurm.batch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.ledger import attempts, judge, rules
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.scheduler.slurm import parse
from hpc_ddp.scheduler.slurm import states as slurm_states


def note(rank: int, kind: str, message: str, t: float, node: str = "n1", again: bool = True) -> dict:
    return {
        "rank": rank,
        "node": node,
        "time": t,
        "type": kind,
        "message": message,
        "traceback": "tb",
        "signature": judge.signature(kind, message),
        "retry": again,
    }


NODES = ("n1", "n1", "n2", "n2")
USAGE_0 = {**note(0, "UsageError", "the tracker refuses a file store", 1.0, again=False), "usage": True}
CLOSED_1 = note(1, "RuntimeError", "[pair.cc:553] Connection closed by peer [127.0.0.1]:41091", 1.1)


@pytest.mark.parametrize(
    "evidence, expected",
    [
        (judge.Evidence(code=0), ("completed", None, None, False)),
        (judge.Evidence(code=75, requeue=True), ("preempted", None, None, False)),
        (judge.Evidence(code=75, requeue=False), ("stopped", None, None, False)),
        (judge.Evidence(code=2), ("usage", None, None, False)),
        (judge.Evidence(code=65), ("nonfinite", None, None, False)),
        # The first cause is the first error that is not a consequence of another rank's end.
        (
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(
                    note(0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1234", 1.0),
                    note(3, "RuntimeError", "CUDA error: uncorrectable ECC error encountered", 2.0, "n2"),
                ),
            ),
            ("failed", 3, "n2", True),
        ),
        (
            judge.Evidence(code=1, rank_nodes=NODES, notes=(note(1, "ValueError", "bad batch 7", 1.0),)),
            ("failed", 1, "n1", False),
        ),
        # Only consequences: the earliest, not blamed.
        (
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(note(2, "RuntimeError", "Connection reset by peer", 1.0, "n2"),),
            ),
            ("failed", 2, "n2", False),
        ),
        # A rank killed by a signal before anyone raised: its node.
        (
            judge.Evidence(code=137, rank_nodes=NODES, killed=((2, "SIGKILL"), (0, "SIGKILL"))),
            ("failed", 2, "n2", True),
        ),
        (judge.Evidence(code=-9, rank_nodes=NODES, first_rank=3), ("failed", 3, "n2", True)),
        # Locally, the survivor of a SIGKILLed peer seen first (its gloo "Connection closed by peer" note): the
        # launcher passes the rank it saw die by a signal, and that rank is the cause, on its node.
        (
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                first_rank=0,
                notes=(
                    {
                        "rank": 0,
                        "type": "RuntimeError",
                        "message": "Connection closed by peer [127.0.0.1]:8110",
                    },
                ),
                killed=((3, "SIGKILL"),),
            ),
            ("failed", 3, "n2", True),
        ),
        # On Slurm, srun reported the survivor's exit first and the SIGKILL that caused it after, as it reports
        # its own kills after a bad exit (seen in CI: srun's "task 0: Exited with exit code 1" before
        # "task 1: Killed"); the note says a peer went, so the rank that left none and died by a signal is it.
        (
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(
                    note(
                        0,
                        "RuntimeError",
                        "[pair.cc:553] Connection closed by peer [127.0.0.1]:65220",
                        1.0,
                        "n1",
                    ),
                ),
                ends=((0, "exit 1"), (1, "SIGKILL")),
            ),
            ("failed", 1, "n1", True),
        ),
        (  # the same with NCCL's words, and a rank with a note of its own skipped
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(
                    note(
                        0,
                        "DistBackendError",
                        "NCCL error: remote process exited or there was a network error",
                        1.0,
                        "n1",
                    ),
                    note(2, "DistBackendError", "ncclRemoteError: remote process exited", 1.1, "n2"),
                ),
                ends=((0, "exit 1"), (2, "SIGKILL"), (3, "SIGKILL")),
            ),
            ("failed", 3, "n2", True),
        ),
        (  # the first rank without a note exited on its own: it had its own end, no kill is named
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(note(0, "RuntimeError", "Connection closed by peer [127.0.0.1]:8110", 1.0, "n1"),),
                ends=((0, "exit 1"), (1, "exit 1"), (2, "SIGKILL")),
            ),
            ("failed", 0, "n1", False),
        ),
        (  # a note that says no peer went (a refused connection): srun's kills after it are its own
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(note(1, "RuntimeError", "Connection refused", 1.0, "n1"),),
                ends=((1, "exit 1"), (0, "SIGKILL")),
            ),
            ("failed", 1, "n1", False),
        ),
        (  # Python's own ConnectionResetError (a dataset's download) is no peer of the group
            judge.Evidence(
                code=1,
                rank_nodes=NODES,
                notes=(note(0, "ConnectionResetError", "[Errno 104] Connection reset by peer", 1.0, "n1"),),
                ends=((0, "exit 1"), (1, "SIGKILL")),
            ),
            ("failed", 0, "n1", False),
        ),
        (
            judge.Evidence(
                code=76,
                rank_nodes=NODES,
                verdict={
                    "culprits": [2],
                    "reason": "stuck",
                    "phase": "forward",
                    "line": "hang at step 3: rank 2",
                },
            ),
            ("hang", 2, "n2", True),
        ),
        (
            judge.Evidence(code=1, rank_nodes=NODES, lost=("n2",), node_fail=True),
            ("node_fail", None, "n2", True),
        ),
        # Issue 33 item 3: a task killed by the preemption signal while it started (before its handler
        # existed) is a preemption, never a crash, and blames no node.
        (
            judge.Evidence(code=140, rank_nodes=NODES, killed=((0, "SIGUSR2"), (2, "SIGKILL"))),
            ("preempted", 0, "n1", False),
        ),
        (judge.Evidence(code=-10, rank_nodes=NODES, first_rank=3), ("preempted", 3, "n2", False)),  # locally
        # Issue 33 item 10: two nodes lost together: both recorded (the first is the attempt's node).
        (
            judge.Evidence(code=137, rank_nodes=NODES, lost=("n2", "n1"), killed=((2, "SIGKILL"),)),
            ("node_fail", None, "n2", True),
        ),
        # Issue 33 item 9: srun refused an option (no pyxis): a usage error, whatever srun's code.
        (
            judge.Evidence(code=255, refused="srun does not know --container-image"),
            ("usage", None, None, False),
        ),
        (judge.Evidence(code=1), ("failed", None, None, False)),
        # Issue 42: a usage error on rank 0 alone (a tracker's refusal) while rank 1 waited in a collective and
        # failed on it, whichever exit the launcher saw first and whichever note was written first.
        *(
            (
                judge.Evidence(code=code, rank_nodes=NODES, first_rank=first, notes=notes),
                ("usage", 0, "n1", False),
            )
            for code, first in ((2, 0), (1, 1))
            for notes in ((USAGE_0, CLOSED_1), (dict(CLOSED_1, time=0.5), USAGE_0))
        ),
        # A usage error with only a peer's consequence noted (rank 0 left none): the rank seen first, not rank 1.
        (
            judge.Evidence(code=2, rank_nodes=NODES, first_rank=0, notes=(CLOSED_1,)),
            ("usage", 0, "n1", False),
        ),
    ],
)
def test_judge_names_the_first_cause(evidence: judge.Evidence, expected: tuple) -> None:
    ending = judge.judge(evidence)
    assert (ending.outcome, ending.rank, ending.node, ending.blamed) == expected


def test_a_usage_error_is_recorded_as_its_rank_s_line() -> None:
    ending = judge.judge(judge.Evidence(code=1, rank_nodes=NODES, first_rank=1, notes=(CLOSED_1, USAGE_0)))
    assert ending.reason == "UsageError: the tracker refuses a file store" and ending.exit_code == 2
    assert not ending.retryable


CAUSE_1 = judge.Ending("failed", "RuntimeError: boom", rank=1)


@pytest.mark.parametrize(
    ("seen", "ending", "codes", "named"),
    [
        # rank 1 raised, rank 0 failed only because of it; one poll saw both ended, rank 0 first (in rank order)
        (0, CAUSE_1, [1, 1, -15, -15], 1),
        (1, CAUSE_1, [1, 1, -15, -15], 1),  # seen in the right order: the same
        (0, CAUSE_1, [1, None, None, None], 0),  # the cause has not ended: the rank seen is named
        (0, CAUSE_1, [1, 0, 0, 0], 0),  # a cause that ended well is no cause here
        (2, judge.Ending("failed", "killed", rank=None), [-15, -15, -9, -15], 2),  # no note: the rank seen
        (0, judge.Ending("failed", "x", rank=7), [1, 1], 0),  # a rank out of range: the rank seen
    ],
)
def test_the_failure_line_names_the_first_cause_when_it_ended(
    seen: int, ending: judge.Ending, codes: list[int | None], named: int
) -> None:
    assert judge.named_first(seen, ending, codes) == named


def test_signatures_mask_numbers_addresses_and_paths() -> None:
    assert judge.signature("ValueError", "bad batch at step 17 (0x7f3a) in '/data/x.bin'") == judge.signature(
        "ValueError", "bad batch at step 40 (0x1) in '/other/y.bin'"
    )
    assert judge.signature("ValueError", "a") != judge.signature("KeyError", "a")


def ended(
    number: int,
    outcome: str,
    checkpoint: int | None,
    signature: str = "E: x",
    node: str | None = None,
    blamed: bool = False,
) -> Attempt:
    return Attempt(
        "7",
        number - 1,
        number=number,
        started=1.0,
        ended=2.0,
        outcome=outcome,
        step=10,
        checkpoint=checkpoint,
        node=node,
        blamed=blamed,
        signature=signature,
    )


@pytest.mark.parametrize(
    "history, this, max_restarts, action, loop",
    [
        ([], ended(1, "completed", 8), 3, "done", False),
        ([], ended(1, "preempted", 8), 3, "requeue", False),
        ([], ended(1, "stopped", 8), 3, "stop", False),
        ([], ended(1, "usage", None), 3, "stop", False),
        ([], ended(1, "failed", None), 3, "requeue", False),
        ([], ended(1, "failed", None), 0, "stop", False),  # --max-restarts 0: no retry
        # The same error again without a newer checkpoint: a crash loop.
        ([ended(1, "failed", 4)], ended(2, "failed", 4), 9, "stop", True),
        ([ended(1, "failed", None)], ended(2, "failed", None), 9, "stop", True),
        # ... but progress in between, or another error, is not.
        ([ended(1, "failed", 4)], ended(2, "failed", 8), 9, "requeue", False),
        ([ended(1, "failed", 4)], ended(2, "failed", 4, "E: y"), 9, "requeue", False),
        # The same hardware error on another node is that node's fault too, not a crash loop; on the same node it is.
        (
            [ended(1, "failed", None, node="n2", blamed=True)],
            ended(2, "failed", None, node="n3", blamed=True),
            9,
            "requeue",
            False,
        ),
        (
            [ended(1, "failed", None, node="n2", blamed=True)],
            ended(2, "failed", None, node="n2", blamed=True),
            9,
            "stop",
            True,
        ),
        # Preemptions do not spend the failure budget.
        ([ended(1, "preempted", 4), ended(2, "preempted", 8)], ended(3, "failed", 12), 1, "requeue", False),
        ([ended(1, "failed", 4, "E: a"), ended(2, "preempted", 8)], ended(3, "failed", 12), 1, "stop", False),
    ],
)
def test_decide(history: list[Attempt], this: Attempt, max_restarts: int, action: str, loop: bool) -> None:
    decision = rules.decide(history, this, max_restarts)
    assert (decision.action, decision.crash_loop) == (action, loop)


def test_every_node_blamed_so_far_is_excluded_and_the_fit_is_checked() -> None:
    history = [ended(1, "failed", 4, node="n2", blamed=True), ended(2, "failed", 8, "E: y", node="n1")]
    decision = rules.decide(history, ended(3, "node_fail", 12, "node failure n3", node="n3", blamed=True), 9)
    assert decision.exclude == ("n2", "n3")  # n1's error was not the node's fault
    states = {"n1": "idle", "n2": "idle", "n3": "down*", "n4": "drain", "n5": "mix"}
    assert slurm_states.usable(states, decision.exclude) == ["n1", "n5"]


HANG_IN_CODE = judge.signature("Hang", "stuck in user code")


@pytest.mark.parametrize(
    "before, node, blamed",
    [
        ([], "n2", True),  # the first time: the node (a frozen node hangs its rank too)
        ([ended(1, "hang", 4, HANG_IN_CODE, node="n2", blamed=True)], "n3", False),  # followed the job
        ([ended(1, "hang", 4, HANG_IN_CODE, node="n2", blamed=True)], "n2", True),  # the same node again
        ([ended(1, "hang", 4, "Hang: other", node="n2", blamed=True)], "n3", True),  # another hang
        ([ended(1, "failed", 4, HANG_IN_CODE, node="n2", blamed=True)], "n3", True),
    ],
)
def test_a_hang_that_follows_the_job_to_another_node_is_the_codes(
    before: list[Attempt], node: str, blamed: bool
) -> None:
    """Issue 33 item 5: a hang in the user's code on every attempt blamed (and excluded) a new healthy node
    each time, until the job stopped for a node shortage that was not the cause."""
    ending = judge.Ending("hang", "hang at step 3: rank 1 ...", HANG_IN_CODE, 1, node, blamed=True)
    assert judge.follow(before, ending).blamed is blamed


def test_a_hang_on_every_attempt_stops_as_a_crash_loop_without_a_node_shortage(tmp_path: Path) -> None:
    """The whole path through the supervisor core: node2, then node3, the same hang with no newer checkpoint:
    node3 is not blamed, only node2 is excluded, and the job stops as a crash loop."""
    from hpc_ddp.launch import supervisor

    journal = supervisor.Journal(CheckpointStore(tmp_path, Local()))
    budgets = supervisor.Budgets(5, 3, "requeue")
    verdict = {"culprits": [1], "reason": "stuck", "phase": "user code", "line": "hang at step 3: rank 1"}
    closed = []
    for restart, node in enumerate(("n2", "n3")):
        evidence = judge.Evidence(code=76, rank_nodes=("n1", node), verdict=verdict)
        closed.append(supervisor.end_attempt(journal, "7", restart, evidence, budgets, 0.0, None, now=1.0))
    assert [(c.attempt.node, c.attempt.blamed, c.decision.action) for c in closed] == [
        ("n2", True, "requeue"),
        ("n3", False, "stop"),
    ]
    assert closed[1].decision.crash_loop and closed[1].attempt.exclude == ("n2",)


def test_not_retried_when_the_run_stopped_itself() -> None:
    ending = judge.judge(
        judge.Evidence(code=1, notes=(note(0, "SavingFailed", "disk full", 1.0, again=False),))
    )
    assert rules.decide([], ended(1, "failed", None), 3, retryable=ending.retryable).action == "stop"


def test_the_record_merges_starts_and_ends_and_survives_a_cut_line(tmp_path: Path) -> None:
    attempts.record_start(tmp_path, "7", 0, ["n1", "n2"], ["n1", "n2"], None, now=10.0)
    attempts.record_end(
        tmp_path,
        Attempt(
            "7",
            0,
            outcome="failed",
            step=12,
            checkpoint=8,
            rank=1,
            node="n2",
            blamed=True,
            decision="requeue",
            exclude=("n2",),
        ),
        now=20.0,
    )
    with open(tmp_path / attempts.ATTEMPTS, "ab") as f:
        f.write(b'{"event": "start", "job": "7", "rest')  # a kill mid-line
    attempts.record_start(tmp_path, "7", 1, ["n1", "n3"], ["n1", "n3"], 8, now=30.0)
    first, second = attempts.read(tmp_path)
    assert (first.number, first.started, first.ended, first.lost_steps, first.exclude) == (
        1,
        10.0,
        20.0,
        4,
        ("n2",),
    )
    assert (second.number, second.resumed_from, second.outcome, second.ended) == (2, 8, "running", None)


@pytest.mark.parametrize(
    "lines, deaths",
    [
        (
            ["srun: error: node2: task 3: Killed", "srun: error: node1: tasks 0-1: Killed"],
            ((3, "SIGKILL"), (0, "SIGKILL"), (1, "SIGKILL")),
        ),
        (["srun: error: node2: task 2: Segmentation fault"], ((2, "SIGSEGV"),)),
        # A task exited with an error first: the kills after it are srun's --kill-on-bad-exit, not a cause.
        (
            ["srun: error: node1: task 1: Exited with exit code 1", "srun: error: node2: tasks 2-3: Killed"],
            (),
        ),
        (["Epoch 0, Loss: 1.0", "srun: Job step aborted"], ()),
    ],
)
def test_srun_deaths(lines: list[str], deaths: tuple) -> None:
    assert parse.srun_deaths(lines) == deaths


def test_srun_task_ends_keeps_srun_order_exits_and_signals() -> None:
    lines = [
        "srun: error: node2: task 0: Exited with exit code 1",
        "srun: launch/slurm: _step_signal: Terminating StepId=12020.0",
        "srun: error: node3: tasks 1,3-4: Killed",
        "srun: error: node1: task 2: Segmentation fault",
    ]
    assert parse.srun_task_ends(lines) == (
        (0, "exit 1"),
        (1, "SIGKILL"),
        (3, "SIGKILL"),
        (4, "SIGKILL"),
        (2, "SIGSEGV"),
    )
    assert parse.srun_deaths(lines) == ()  # an exit first: srun_deaths names none of them


def test_scontrol_and_sinfo_readings() -> None:
    info = parse.parse_job(
        "JobId=7 JobName=x JobState=PENDING Reason=BeginTime Restarts=1 NumNodes=2-2 "
        "Partition=debug ExcNodeList=node2"
    )
    assert info is not None  # the one parser of `scontrol show job` (hpc_ddp.scheduler.slurm.parse)
    fields = info.fields
    assert (fields["JobState"], fields["NumNodes"], fields["ExcNodeList"]) == ("PENDING", "2-2", "node2")
    assert parse.parse_sinfo("node1 idle\nnode2 drain\nnode3 down*\n") == {
        "node1": "idle",
        "node2": "drain",
        "node3": "down*",
    }


def test_an_end_that_trained_nothing_is_no_attempt() -> None:
    assert not attempts.worth_recording(Attempt("7", 0, outcome="completed"))  # a rerun of a finished run
    assert not attempts.worth_recording(Attempt("7", 0, outcome="usage"))
    assert attempts.worth_recording(Attempt("7", 0, outcome="failed"))  # counts against --max-restarts
    assert attempts.worth_recording(Attempt("7", 0, started=1.0, outcome="completed"))
