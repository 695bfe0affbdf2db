"""Signals that come while the local launcher restarts its ranks are held, never fatal: a training rank
starts with SIGUSR1/SIGUSR2/SIGTERM blocked until its handlers are set (hpc_ddp.launch.local.processes.die_with_parent,
hpc_ddp.run.loop.preemption.install), and the launcher sends what came during the restart to every new rank.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from test_launch_local import finish, read_until, start

# ~15 s (measured); alone: its second signal must land during the restart, which a busy machine stretches
pytestmark = [pytest.mark.slow, pytest.mark.deadline(75), pytest.mark.alone]


def test_a_second_preemption_signal_during_the_restart_preempts_again_instead_of_killing(
    tmp_path: Path,
) -> None:
    proc = start(
        tmp_path,
        "--task",
        "slow_tasks:slow",
        "--nodes",
        "1",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        SLOW_TASK_SLEEP_S="0.02",
    )
    read_until(proc, "Epoch 0,")
    proc.send_signal(signal.SIGUSR1)
    lines = read_until(proc, "[launcher] preempted: restarting all ranks (1 of --max-requeue 3)")
    time.sleep(0.05)  # the new ranks are starting: Python is not even running their code yet
    proc.send_signal(signal.SIGUSR1)
    code, rest = finish(proc, timeout=90)
    out = "\n".join(lines) + "\n" + rest
    assert code == 0, out
    assert "killed by" not in out
    assert "[launcher] preempted: restarting all ranks (2 of --max-requeue 3)" in out  # held, then delivered
    assert out.count("SIGUSR1: preempted: checkpoint saved") == 2, out
