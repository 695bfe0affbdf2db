"""A checkpoint write that fails in a real run (ENOSPC, from tests/robust_tasks.py:flaky_disk): reported at
the next step, retried with a doubling delay while training goes on, and, when saving keeps failing, every
rank stops at the same step with one clear line instead of dying at the next save with a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_launch_local import finish, start
from test_run_folder_rules import train

from hpc_ddp import exitcodes
from hpc_ddp.run.checkpoint import store

pytestmark = pytest.mark.slow


@pytest.mark.deadline(30)  # ~3 s (measured)
def test_a_save_that_failed_while_the_disk_was_full_is_retried_and_the_run_completes(tmp_path: Path) -> None:
    code, out = train(
        tmp_path,
        "--task",
        "robust_tasks:flaky_disk",
        "--epochs",
        "3",
        FLAKY_SAVES="2",
        HPC_DDP_SAVE_BACKOFF_S="0.2",
        ROBUST_SLEEP_S="0.01",
    )
    assert code == 0, out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "a checkpoint could not be written" in line)
    assert (
        "(No space left on device: " in lines[first]
        and "retry 1 of 5 in 0.2 s, training goes on" in lines[first]
    )
    # Reported during the next epoch, not a save interval later.
    assert (
        lines.index("Epoch 0, Loss: " + lines[first - 1].split("Loss: ")[1])
        < first
        < next(i for i, line in enumerate(lines) if line.startswith("Epoch 1, "))
    )
    assert any("written after 2 failed attempt(s)" in line for line in lines), out
    assert store.read_latest(tmp_path) == store.ckpt_dir(tmp_path) / "ckpt-00000048.pt"  # 16 steps an epoch
    assert (tmp_path / "model.pth").is_file()


@pytest.mark.deadline(30)  # 3.5-6 s
def test_saving_that_keeps_failing_stops_every_rank_at_the_same_step_with_one_line(tmp_path: Path) -> None:
    code, out = finish(
        start(
            tmp_path,
            "--task",
            "robust_tasks:flaky_disk",
            "--nodes",
            "1",
            "--epochs",
            "100",
            FLAKY_SAVES="1000",
            HPC_DDP_SAVE_BACKOFF_S="0.05",
            ROBUST_SLEEP_S="0.01",
        ),
        timeout=60,
    )
    assert code == exitcodes.FAILED, out
    rank0 = (tmp_path / "logs" / "rank0.log").read_text()
    rank1 = (tmp_path / "logs" / "rank1.log").read_text()
    assert "Traceback" not in rank0 + rank1, rank0 + rank1
    assert (
        f"error: checkpoints cannot be written to {tmp_path / 'checkpoints'} after 6 attempts: No space left "
        "on device" in rank0
    ), rank0
    step = rank0.split("Every rank stops at step ")[1].split()[0]
    assert (
        f"rank 0 could not write checkpoints (see its log); every rank stopped with it at step {step}"
        in rank1
    )
    assert "Fix: free space (or quota) there, then run the same command to resume" in rank0
    assert store.list_checkpoints(tmp_path) == []
