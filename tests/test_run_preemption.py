"""Preemption of a real 2 x 1 local run (two nodes of one rank): an agreed save, a restart, and a bitwise-equal end.

Each run uses tests/slow_tasks.py:slow (dropout, momentum, a short sleep per step) with --deterministic, so the
interrupted-and-resumed run must reproduce model, optimizer state and data order exactly.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import psutil
import pytest
import torch
from conftest import DETERMINISTIC_2X1, STEPS_PER_EPOCH_2X1
from test_launch_local import finish, ranks_of, read_until, start

from hpc_ddp import exitcodes
from hpc_ddp.run.checkpoint import full, store
from hpc_ddp.run.checkpoint.storage import Local

pytestmark = [
    pytest.mark.slow,
    pytest.mark.deadline(150),
]  # 7-29 s each, + 8 s for conftest's `uninterrupted_2x1` (measured)

ARGS = DETERMINISTIC_2X1  # conftest's uninterrupted_2x1 is the same run, uninterrupted
SLOW = {"SLOW_TASK_SLEEP_S": "0.03"}
STEPS_PER_EPOCH = STEPS_PER_EPOCH_2X1


def final_state(folder: Path) -> tuple[dict, dict]:
    model = torch.load(folder / "model.pth", weights_only=True)
    last = full.load(store.list_checkpoints(folder, storage=Local())[0], storage=Local())
    return model, last


def assert_bitwise_equal(a: Path, b: Path) -> None:
    (model_a, ckpt_a), (model_b, ckpt_b) = final_state(a), final_state(b)
    assert model_a.keys() == model_b.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    state_a, state_b = ckpt_a["optimizer"]["state"], ckpt_b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    assert all(torch.equal(state_a[k]["momentum_buffer"], state_b[k]["momentum_buffer"]) for k in state_a)
    assert ckpt_a["position"] == ckpt_b["position"]


def test_usr2_to_the_launcher_then_to_one_rank_saves_restarts_and_ends_bitwise_equal(
    tmp_path: Path, uninterrupted_2x1: Path
) -> None:
    """One run, two preemptions: SIGUSR2 to the launcher in epoch 1, then, once resumed, to the last rank
    alone (on the second node): every rank stops at the same step each time, and the end is bitwise equal."""
    proc = start(tmp_path, *ARGS, **SLOW)
    lines = read_until(proc, "Epoch 0,")
    proc.send_signal(signal.SIGUSR2)
    lines += read_until(proc, "Resuming from ")
    rank1 = ranks_of(proc.pid)[1]
    rank1.send_signal(signal.SIGUSR2)  # 1.5 epochs still to go
    code, out = finish(proc)
    out = "\n".join(lines) + "\n" + out
    assert code == 0, out
    assert "SIGUSR2: preempted: checkpoint saved at step " in out and "the launcher decides" in out
    assert "[launcher] preempted: restarting all ranks (1 of --max-requeue 3)" in out
    assert "[launcher] preempted: restarting all ranks (2 of --max-requeue 3)" in out  # the rank's signal
    assert out.count("Resuming from ") == 2, out
    assert "Resuming from " in out and "at epoch 1, step " in out
    step = int(out.split("at epoch 1, step ")[1].split()[0])
    assert step % STEPS_PER_EPOCH != 0, "the signal should land mid-epoch"  # exercised: mid-epoch resume
    assert_bitwise_equal(tmp_path, uninterrupted_2x1)


def test_sigterm_saves_and_does_not_restart_then_the_same_command_resumes(
    tmp_path: Path, uninterrupted_2x1: Path
) -> None:
    proc = start(tmp_path, *ARGS, **SLOW)
    read_until(proc, "Epoch 0,")
    rank0 = ranks_of(proc.pid)[0]
    proc.send_signal(signal.SIGTERM)
    # More SIGTERMs straight to rank 0, every few ms until it is gone: some land during its save, which rank 0
    # reports (below), and none may tear anything.
    done = threading.Event()

    def pelt() -> None:
        while not done.wait(0.003):
            try:
                rank0.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                return

    pelter = threading.Thread(target=pelt, daemon=True)
    pelter.start()
    try:
        code, out = finish(proc)
    finally:
        done.set()
        pelter.join()
    assert code == exitcodes.PREEMPTED, out
    assert "SIGTERM: every rank stopped at step" in out
    assert "another signal came during the save: noted, the save went on to the end" in out
    assert "stopped by SIGTERM: checkpoint saved, not requeued" in out
    assert "restarting" not in out
    assert json.loads((tmp_path / "preempted.json").read_text())["requeue"] is False
    code, out = finish(start(tmp_path, *ARGS, **SLOW))
    assert code == 0, out
    assert "Resuming from " in out
    assert_bitwise_equal(tmp_path, uninterrupted_2x1)


def test_max_requeue_0_ends_cleanly_with_the_checkpoint(tmp_path: Path) -> None:
    proc = start(tmp_path, *ARGS, "--max-requeue", "0", **SLOW)
    read_until(proc, "Epoch 0,")
    proc.send_signal(signal.SIGUSR1)
    code, out = finish(proc)
    assert code == exitcodes.PREEMPTED, out
    assert "requeue budget spent (0 of --max-requeue 0), not requeued" in out
    latest = store.read_latest(tmp_path, storage=Local())
    assert latest is not None and full.load(latest, storage=Local())["position"]["epoch"] >= 1
