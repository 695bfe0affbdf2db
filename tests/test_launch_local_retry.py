"""End-to-end: failures that are not preemption, on the local launcher (real gloo ranks, real SIGKILL).

A failure ends the attempt; the launcher starts every rank again from the latest checkpoint within
--max-restarts, records each attempt in attempts.jsonl, and stops a crash loop (the same error again without
a newer checkpoint) after two attempts, showing that error's traceback once.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import DETERMINISTIC_2X1, STEPS_PER_EPOCH_2X1
from test_launch_local import finish, ranks_of, read_until, start

from hpc_ddp import exitcodes
from hpc_ddp.ledger import attempts

pytestmark = [pytest.mark.slow, pytest.mark.deadline(120)]


def test_a_rank_killed_mid_run_resumes_from_its_checkpoint_and_ends_bitwise_equal(
    tmp_path: Path, uninterrupted_2x1: Path
) -> None:
    """The reference end is conftest's uninterrupted_2x1 (the same arguments, no sleep, shared with
    tests/test_run_preemption.py)."""
    reference = uninterrupted_2x1
    folder = tmp_path / "killed"
    # 0.1 s a step: epoch 2 lasts 1.6 s or more, time enough for the kill to land in it on a busy machine
    proc = start(folder, *DETERMINISTIC_2X1, SLOW_TASK_SLEEP_S="0.1")
    read_until(proc, "Epoch 1,")  # a checkpoint of epoch 1 is being written; the kill lands in epoch 2
    by_rank = ranks_of(proc.pid)
    by_rank[1].send_signal(signal.SIGKILL)  # the second node's
    code, out = finish(proc)
    assert code == 0, out
    assert (
        "attempt 1 failed on node 1 (127.0.0.2) (points at the node): rank 1 was killed by SIGKILL; restarting from "
        "the checkpoint at step" in out
    ), out
    first, second = attempts.read(folder)
    assert (first.outcome, first.rank, first.node, first.blamed, first.decision, first.signature) == (
        "failed",
        1,
        "127.0.0.2",
        True,
        "restart",
        "signal SIGKILL",
    )
    assert first.exclude == ()  # locally blame is recorded, nothing is excluded
    assert first.checkpoint is not None and first.checkpoint >= STEPS_PER_EPOCH_2X1  # epoch 0's at least
    assert (second.restart, second.outcome, second.decision) == (1, "completed", "done")
    assert second.resumed_from == first.checkpoint
    assert second.ranks == ("127.0.0.1", "127.0.0.2")
    assert f"Resuming from {folder / 'checkpoints'}" in out
    expected = torch.load(reference / "model.pth", weights_only=True)
    got = torch.load(folder / "model.pth", weights_only=True)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_max_restarts_0_ends_at_the_first_failure(tmp_path: Path) -> None:
    code, out = finish(
        start(tmp_path, "--task", "retry_tasks:fails_everywhere", "--nodes", "1", "--max-restarts", "0")
    )
    assert code == exitcodes.FAILED, out
    (only,) = attempts.read(tmp_path)
    assert (only.outcome, only.rank, only.decision) == ("failed", 1, "stop")
    assert "restart budget spent: 1 failure(s), --max-restarts 0" in out
    assert out.count("Process 0 initialized") == 1


def test_a_crash_loop_stops_after_two_attempts_with_the_traceback_shown_once(tmp_path: Path) -> None:
    code, out = finish(
        start(tmp_path, "--task", "retry_tasks:fails_everywhere", "--nodes", "1", "--max-restarts", "5")
    )
    assert code == exitcodes.FAILED, out
    first, second = attempts.read(tmp_path)
    assert (
        first.signature
        == second.signature
        == "ValueError: bad batch at call N (tests/retry_tasks.py:fails_everywhere)"
    )
    assert (first.decision, second.decision) == ("restart", "stop")
    assert first.blamed is False  # an error in the code is not the node's fault
    assert "crash loop: attempt 2 failed with the same error as attempt 1 and no newer checkpoint" in out
    # The traceback once, though two attempts (and rank 1's log) raised it.
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count("raise error(calls[0])") == 1, out
    notes = sorted((tmp_path / "exits").iterdir())
    assert len(notes) == 2 and all((n / "rank1.json").is_file() for n in notes)
    assert json.loads((notes[0] / "rank1.json").read_text())["type"] == "ValueError"
