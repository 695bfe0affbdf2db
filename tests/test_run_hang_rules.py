"""Hang and straggler rules as tables: the auto threshold, the verdict's culprit, the straggler test (pure)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp import exitcodes
from hpc_ddp.run.watch import beacon, stragglers, verdict, watchdog


@pytest.mark.parametrize(
    "setting, phase, steps, expected",
    [
        (12.0, beacon.DATA, [0.01] * 10, 12.0),  # an explicit S is taken as it is
        (None, beacon.DATA, [0.01] * 2, 300.0),  # too few steps timed: half of --timeout-s
        (None, beacon.CHECKPOINT, [0.01] * 10, 300.0),  # saves may be long
        (None, beacon.STARTUP, [], 300.0),
        (None, beacon.DATA, [0.01] * 10, 60.0),  # 20 x 10 ms is below the 60 s floor
        (None, beacon.GRAD_ALLREDUCE, [5.0] * 10, 100.0),  # 20 median step times
        (None, beacon.COMPUTE, [50.0] * 10, 300.0),  # never above half of --timeout-s
        (
            None,
            beacon.COMPUTE,
            [0.01, 0.01, 9.0, 0.01, 0.01],
            60.0,
        ),  # one slow step moves the median not at all
    ],
)
def test_auto_threshold(setting: float | None, phase: str, steps: list[float], expected: float) -> None:
    assert watchdog.threshold_s(setting, 600.0, steps, phase) == expected


@pytest.mark.parametrize(
    "setting, phase, long, expected",
    [
        (5.0, beacon.CHECKPOINT, False, 300.0),  # a fixed S bounds the steady state: a save keeps its limit
        (5.0, beacon.STARTUP, False, 300.0),
        (5.0, beacon.DATA, True, 300.0),  # an epoch's first batch (workers start), the step after a resume
        (5.0, beacon.DATA, False, 5.0),
        (400.0, beacon.CHECKPOINT, False, 400.0),  # never below S
        (None, beacon.GRAD_ALLREDUCE, True, 300.0),  # waiting for a peer's save: the long limit too
    ],
)
def test_long_phases_keep_the_startup_limit(
    setting: float | None, phase: str, long: bool, expected: float
) -> None:
    assert watchdog.threshold_s(setting, 600.0, [0.01] * 10, phase, long) == expected


def test_the_threshold_floor_yields_to_the_cap_for_short_timeouts() -> None:
    assert watchdog.threshold_s(None, 8.0, [0.01] * 10, beacon.DATA) == 4.0


def report(
    rank: int,
    phase: str,
    step: int = 120,
    stalled: float = 41.0,
    host: str = "node1",
    frame: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "rank": rank,
        "host": host,
        "pid": 1000 + rank,
        "phase": phase,
        "step": step,
        "stalled_s": stalled,
        "collective": phase in beacon.COLLECTIVE,
        "user_frame": frame,
        "stack": "",
    }


PEERS = [(f"node{1 + r // 4}", 1000 + r) for r in range(8)]


def test_one_rank_stuck_in_data_is_named_with_its_line() -> None:
    frame = {"file": "mytask.py", "line": 31, "function": "__getitem__"}
    reports = [report(r, beacon.GRAD_ALLREDUCE, stalled=40.0) for r in range(8) if r != 5]
    reports.append(report(5, beacon.DATA, host="node2", frame=frame))
    v = verdict.decide(reports, 8, PEERS, 5.0)
    assert v["line"] == (
        "hang at step 120: rank 5 (node2, pid 1005) has been in data loading for 41 s; ranks "
        '0-4,6-7 wait for it in the gradient all-reduce. Rank 5\'s stack: ... File "mytask.py", '
        "line 31, in __getitem__"
    )
    assert (
        v["culprits"] == [5] and v["phase"] == beacon.DATA and v["host"] == "node2" and v["reason"] == "stuck"
    )


def test_a_rank_that_sends_nothing_is_unresponsive_with_its_host() -> None:
    reports = [report(r, beacon.GRAD_ALLREDUCE) for r in range(8) if r != 6]
    v = verdict.decide(reports, 8, PEERS, 5.0)
    assert "rank 6 (node2, pid 1006) is unresponsive: no report within 5 s" in v["line"]
    assert "ranks 0-5,7 wait for it in the gradient all-reduce" in v["line"]
    assert v["culprits"] == [6] and v["unresponsive"] == [6] and v["host"] == "node2"


def test_ranks_in_different_collectives_blame_nobody() -> None:
    reports = [report(r, beacon.GRAD_ALLREDUCE) for r in range(4)] + [
        report(r, beacon.STEP_ALLREDUCE, step=119) for r in range(4, 8)
    ]
    v = verdict.decide(reports, 8, PEERS, 5.0)
    assert "no single rank is to blame" in v["line"] and v["culprits"] == [] and v["reason"] == "mismatched"
    assert "ranks 0-3 in the gradient all-reduce at step 120" in v["line"]
    assert "ranks 4-7 in the step's all-reduce at step 119" in v["line"]


def test_every_rank_in_the_same_collective_blames_nobody() -> None:
    v = verdict.decide([report(r, beacon.GRAD_ALLREDUCE) for r in range(8)], 8, PEERS, 5.0)
    assert "no single rank is to blame: every rank waits in the gradient all-reduce" in v["line"]


def test_a_rank_busy_within_its_own_limit_is_no_hang_and_says_when_to_look_again() -> None:
    reports = [report(r, beacon.GRAD_ALLREDUCE, stalled=61.0) for r in range(1, 8)]
    reports.append({**report(0, beacon.CHECKPOINT, stalled=63.0), "busy": True, "limit_s": 300.0})
    v = verdict.decide(reports, 8, PEERS, 5.0)
    assert v["reason"] == "busy" and v["culprits"] == [] and v["busy"] == [0] and v["wait_s"] == 237.0
    assert v["line"] == (
        "no hang at step 120: rank 0 (node1, pid 1000) is in a checkpoint save for 63 s, within its limit of "
        "300 s; ranks 1-7 wait for it in the gradient all-reduce; judged again in 237 s"
    )


def test_a_busy_rank_does_not_excuse_a_silent_one() -> None:
    reports = [report(r, beacon.GRAD_ALLREDUCE) for r in range(1, 7)]
    reports.append({**report(0, beacon.CHECKPOINT), "busy": True, "limit_s": 300.0})
    v = verdict.decide(reports, 8, PEERS, 5.0)
    assert v["reason"] == "unresponsive" and v["culprits"] == [7]


def test_a_single_process_that_hangs_is_its_own_culprit() -> None:
    v = verdict.decide([report(0, beacon.COMPUTE, stalled=6.0)], 1, PEERS[:1], 5.0)
    assert v["line"].startswith("hang at step 120: rank 0 (node1, pid 1000) has been in forward and backward")


@pytest.mark.parametrize("ranks, text", [([0, 1, 2, 4, 6, 7], "0-2,4,6-7"), ([3], "3"), ([], "")])
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert verdict.ranks_text(ranks) == text


def rows(
    slow_rank: int | None, factor: float = 3.0, ranks: int = 4, step_s: float = 0.1
) -> list[list[float]]:
    """Five steps per window: `step_s` data, twice that compute each; one rank `factor` x slower in data."""
    out = []
    for r in range(ranks):
        data = step_s * 5 * (factor if r == slow_rank else 1.0)
        out.append([data, 2 * step_s * 5, step_s / 2 * 5, 5.0])
    return out


def test_a_rank_three_times_slower_in_data_is_named_after_two_windows() -> None:
    judge = stragglers.Judge()
    assert judge.add(rows(2)) == []  # one slow window is not yet "consistently"
    named = judge.add(rows(2))
    assert [(s.rank, s.phase) for s in named] == [(2, "data loading")]
    assert named[0].slower == pytest.approx(50 / 30)
    assert judge.add(rows(2)) == []  # named once
    line = stragglers.describe(named[0], "node1", 10)
    assert line.startswith("straggler at step 10: rank 2 (node1) is 1.7x slower than the median rank in data")


def test_a_healthy_run_names_nobody() -> None:
    judge = stragglers.Judge()
    noisy = [[0.51, 0.99, 0.2, 5.0], [0.49, 1.02, 0.2, 5.0], [0.50, 1.00, 0.3, 5.0]]
    assert all(judge.add(noisy) == [] for _ in range(10))


def test_a_slow_window_then_a_normal_one_resets_the_streak() -> None:
    judge = stragglers.Judge()
    assert judge.add(rows(1)) == [] and judge.add(rows(None)) == [] and judge.add(rows(1)) == []


def test_a_run_too_short_to_judge_names_nobody() -> None:
    """The quick start under load (issue 37 item 4): 70 steps of about 3 ms, rank 0 at 5.0 ms against 2.7 ms
    in every window: before, named at step 10. Windows that short are added up until they hold half a second of
    work; 70 such steps never make two."""
    quick = [[0.0, 0.005 * 5, 0.0, 5.0]] + [[0.0, 0.0027 * 5, 0.002, 5.0]] * 3
    judge = stragglers.Judge()
    assert all(judge.add(quick) == [] for _ in range(14))
    # The same rank, as slow, over a run long enough to judge: named once two windows of 0.5 s were seen.
    named = [judge.add(quick) for _ in range(80)]
    first = next(i for i, found in enumerate(named) if found)
    assert [s.rank for s in named[first]] == [0] and named[first][0].slower == pytest.approx(5.0 / 2.7)
    assert 14 + first + 1 >= 2 * 0.5 / (0.0027 * 5)  # not before two half-second windows
    # Windows long enough on their own are judged each time, as before.
    long = stragglers.Judge()
    assert long.add(rows(2, step_s=0.04)) == [] and long.add(rows(2, step_s=0.04)) != []


def test_every_fifth_step_carries_this_ranks_window_in_its_own_slot_and_starts_it_anew() -> None:
    """The straggler windows ride in the step's packet (issue 41): rank 1 of 3 writes its row in slot 1 of zeros
    (the all-reduce's sum is then every rank's row); other steps, one rank or an unwatched one carry none."""
    import dataclasses

    from hpc_ddp.cluster.env import detect
    from hpc_ddp.run.loop.clock import StepClock

    env = dataclasses.replace(detect({}), rank=1, world_size=3)
    clock = StepClock(beacon.Beacon())
    clock.window.data_s, clock.window.compute_s, clock.window.comm_s, clock.window.steps = 0.5, 2.0, 0.25, 5
    assert clock.rows(4, env) == [] and clock.window.steps == 5  # not a gathering step: the window goes on
    assert clock.rows(5, env) == [0.0] * 4 + [0.5, 2.0, 0.25, 5.0] + [0.0] * 4
    assert clock.window.row() == [0.0, 0.0, 0.0, 0.0]  # taken: the next window starts empty
    clock.window.steps = 5
    assert clock.rows(10, dataclasses.replace(env, rank=0, world_size=1)) == []  # one rank: nobody to compare
    assert StepClock(beacon.NullBeacon()).rows(10, env) == []  # an unwatched rank compares nothing


def test_nccl_defaults_leave_what_the_user_set() -> None:
    from hpc_ddp.cluster.group import nccl_defaults

    chosen = nccl_defaults({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, "/runs/x")
    assert chosen == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/x/nccl-trace/rank",
    }


class _NoBackstop:
    """faulthandler's one timer belongs to the test's deadline (tests/deadline.py): watchdogs run in this
    process without it."""

    def dump_traceback_later(self, *args: Any, **kwargs: Any) -> None:
        pass

    def cancel_dump_traceback_later(self) -> None:
        pass


def _two_ranks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[str], list[int]]:
    """Two ranks' watchdogs in one process (threads), with fast ticks: rank 0 in a checkpoint save (a long
    phase: half of --timeout-s 20 = 10 s), rank 1 waiting for it in the gradient all-reduce with a fixed
    --hang-timeout-s 1 (the steady limit)."""
    import threading

    monkeypatch.setattr(watchdog, "faulthandler", _NoBackstop())
    monkeypatch.setattr(watchdog, "_end_children", lambda: None)
    monkeypatch.setattr(watchdog, "TICK_S", 0.1)
    monkeypatch.setattr(watchdog, "WINDOW_S", 1.5)
    monkeypatch.setattr(watchdog, "ANSWER_EVERY_S", 0.2)
    said: list[str] = []
    left: list[int] = []
    peers = (("node1", 100), ("node2", 101))
    dogs = []
    for rank, phase in ((0, beacon.CHECKPOINT), (1, beacon.GRAD_ALLREDUCE)):
        b = beacon.Beacon()
        b.set(phase, 7)
        who = watchdog.Identity(rank, 2, peers[rank][0], peers, "job-0")
        dog = watchdog.Watchdog(b, who, tmp_path, 1.0, 20.0, lambda: [0.01] * 10, said.append, left.append)
        dog.thread = threading.Thread(target=dog._watch, daemon=True)  # no faulthandler arming at start
        dogs.append(dog)
    return dogs, said, left


def test_a_peer_busy_in_a_long_save_is_asked_before_it_is_judged(tmp_path: Any, monkeypatch: Any) -> None:
    """Issue 22 item 1: the waiting rank fires at its steady limit, the saving rank answers that it is busy
    within its own limit, and nobody is called unresponsive, killed or blamed."""
    import time

    dogs, said, left = _two_ranks(tmp_path, monkeypatch)
    for dog in dogs:
        dog.thread.start()
    time.sleep(4.0)  # rank 1 fired after 1 s; the round took 1.5 s; the save goes on (10 s allowed)
    for dog in dogs:
        dog.stop()
    assert left == [], said
    assert not (tmp_path / watchdog.VERDICT).exists()
    assert any(line.startswith("no hang at step 7: rank 0 (node1, pid") for line in said), said
    deferred = (tmp_path / watchdog.HANG_DIR / "job-0" / "r0" / watchdog.DEFERRED).read_text()
    assert '"reason": "busy"' in deferred


def test_a_silent_peer_is_still_unresponsive(tmp_path: Any, monkeypatch: Any) -> None:
    """No miss added to fix the false alarm: a rank whose watchdog cannot answer (frozen) is named."""
    import time

    dogs, said, left = _two_ranks(tmp_path, monkeypatch)
    dogs[1].thread.start()  # rank 0's watchdog never runs: a frozen process
    deadline = time.monotonic() + 10
    while not left and time.monotonic() < deadline:
        time.sleep(0.1)
    dogs[1].stop()
    assert left == [exitcodes.HANG], said
    assert "rank 0 (node1, pid 100) is unresponsive" in said[0]


def test_a_deferral_under_a_kit_supervisor_is_said_in_the_log(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    """Under a kit supervisor the watchdog has no console to speak to (say=None): the deferral's line goes to
    the rank's own stderr (its log), and nobody is killed (it raised TypeError and ended the rank before)."""
    import time

    dogs, said, left = _two_ranks(tmp_path, monkeypatch)
    dogs[1].say = None
    for dog in dogs:
        dog.thread.start()
    time.sleep(4.0)
    for dog in dogs:
        dog.stop()
    assert left == []
    assert "no hang at step 7: rank 0 (node1, pid" in capsys.readouterr().err


def test_every_rank_in_the_same_line_of_the_task_names_the_code_and_blames_nobody() -> None:
    """Finding 12: every rank inside its own `step` at the same line (a periodic callback) is not a sick
    node; the supervisor's judgement then blames no node."""
    from hpc_ddp.ledger import judge

    frame = {"file": "mytask.py", "line": 77, "function": "callback"}
    reports = [report(r, beacon.COMPUTE, stalled=70.0 + r, host=PEERS[r][0], frame=frame) for r in range(8)]
    v = verdict.decide(reports, 8, PEERS, 5.0)
    assert v["reason"] == "user-code" and v["culprits"] == [] and v["host"] is None
    assert v["line"] == (
        "hang at step 120: every rank (8) has been in forward and backward for 77 s at the same line of the "
        'task\'s code: File "mytask.py", line 77, in callback. No rank or node is to blame: that code is slow, '
        'or stuck, on every rank. Fix: mark long legitimate work with `with hpc_ddp.long_work("what", '
        "limit_s=...)`, or raise --hang-timeout-s"
    )
    ending = judge.judge(judge.Evidence(code=76, rank_nodes=tuple(p[0] for p in PEERS), verdict=v))
    assert ending.rank is None and ending.node is None and not ending.blamed
    # Another line on one rank, or one rank waiting: the ranks outside a collective are named, as before.
    other = [*reports[:7], report(7, beacon.COMPUTE, frame={**frame, "line": 78})]
    assert verdict.decide(other, 8, PEERS, 5.0)["culprits"] == list(range(8))
    alone = [report(r, beacon.GRAD_ALLREDUCE) for r in range(7)] + [report(7, beacon.COMPUTE, frame=frame)]
    assert verdict.decide(alone, 8, PEERS, 5.0)["culprits"] == [7]
    assert verdict.decide([report(0, beacon.COMPUTE, frame=frame)], 1, PEERS[:1], 5.0)["culprits"] == [0]


def test_long_work_is_a_long_phase_with_its_own_limit_and_then_the_phase_goes_on(tmp_path: Path) -> None:
    import hpc_ddp

    with hpc_ddp.long_work("outside a run"):  # no loop in this process: nothing to mark, the block runs
        pass
    mark = beacon.Beacon()
    mark.set(beacon.COMPUTE, 7)
    dog = watchdog.Watchdog(
        mark, watchdog.Identity(0, 1, "h", (("h", 1),), "r"), tmp_path, 5.0, 600.0, list, None
    )
    previous = beacon.current()
    beacon.publish(mark)
    try:
        assert dog.limit() == 5.0
        with hpc_ddp.long_work("the periodic callback", limit_s=900):
            phase, step, _, long, limit = mark.state
            assert (phase, step, long, limit) == ("the task's long work: the periodic callback", 7, True, 900)
            assert dog.limit() == 900
        with hpc_ddp.long_work("a dump"):  # no limit given: the start-up limit, half of --timeout-s
            assert dog.limit() == 300.0
        assert mark.state[:2] == (beacon.COMPUTE, 7) and dog.limit() == 5.0
    finally:
        if previous is not None:
            beacon.publish(previous)
        else:
            beacon._LOOP.clear()
    with pytest.raises(ValueError, match="limit_s=0"):
        with hpc_ddp.long_work("nothing", limit_s=0):
            pass


def test_the_norm_for_the_records_is_the_kits_own_work_and_counted_apart() -> None:
    """`clock.norm` inside `clock.task` (the norm the step records need without --clip-grad, issue 46): out of
    the task's time, as `clock.kit` is, and also in `norm_s`, so that the end record can say what it costs."""
    from hpc_ddp.run.loop.clock import StepClock

    clock = StepClock(beacon.Beacon())
    with clock.task:
        time.sleep(0.02)
        with clock.norm:
            time.sleep(0.03)
    assert 0.015 <= clock.task_s < 0.03 and 0.03 <= clock.norm_s < 0.2
    with clock.task, clock.kit:  # the kit's other own work: out of the task's time, not the norm's
        time.sleep(0.01)
    assert 0.03 <= clock.norm_s < 0.2 and clock.task_s < 0.03


def test_the_kits_own_files_are_never_the_users_frame_wherever_they_sit() -> None:
    """The user's frame skips the whole package, its entry points at its top included: the package's folder is
    found from the package, not from the watchdog's depth in it (once it moved into run/watch, hpc_ddp/train.py
    was named as the stuck rank's own line)."""
    import os

    import hpc_ddp.train
    from hpc_ddp.run import session
    from hpc_ddp.run.watch import watchdog

    for module in (hpc_ddp.train, session, watchdog):
        assert watchdog._is_library(module.__file__), module.__file__
    assert watchdog._is_library(os.__file__)  # the standard library
    assert not watchdog._is_library(__file__)  # a test, as a user's task file
