"""On the real local Slurm cluster (2 nodes x 1 task): a preemption signal that reaches the tasks while they start (issue 23
item 3). `scancel --signal=USR2` arrives after the task starter's first instruction and before the task's
handler exists; held there (blocked), it is honoured once the handler is installed: the attempt ends as a
preemption, requeued, and the job completes. Before the fix every task died "killed by SIGUSR2", its node
was blamed, and two in a row ended the job as a crash loop.

The window is held open by a stand-in python (`--python`), which starts each task through tests/slow_start.py:
on the first run the tasks wait there until the signal is pending. One job, one requeue.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launch_slurm_submit import HANG_GUARD_S, sacct_records, start_submit

from hpc_ddp.ledger import attempts

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.deadline(360)]  # 25 s alone; 140 s at load 17

# A stand-in python: every task goes through the kit's starter, then tests/slow_start.py; all else as is.
STANDIN_PYTHON = """#!/bin/bash
if [[ "$*" == "-u -m hpc_ddp.launch.slurm.start "* ]]; then
  shift 3
  exec {python} -u -m hpc_ddp.launch.slurm.start -u -m slow_start "$@"
fi
exec {python} "$@"
"""


def test_a_usr2_while_the_tasks_start_is_a_preemption_not_a_crash(slurm_cluster: str, tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(STANDIN_PYTHON.replace("{python}", sys.executable))
    python.chmod(0o755)
    gate = tmp_path / "gate"
    gate.mkdir()
    folder = tmp_path / "run"
    proc, job_id = start_submit(
        folder,
        "--python",
        str(python),
        "--tasks-per-node",  # one task a node (the last one counts): two tasks, two nodes, half the imports
        "1",
        "--task",
        "slow_tasks:slow",
        "--epochs",
        "2",
        SLOW_TASK_SLEEP_S="0",
        SLOW_START_DIR=str(gate),
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while len(list(gate.glob("starting.*"))) < 2:  # every task has started, none has its handler yet
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out
    assert "killed by SIGUSR2" not in out and "crash loop" not in out, out
    first, finished = attempts.read(folder)
    assert (first.outcome, first.blamed, first.decision) == ("preempted", False, "requeue"), out
    assert (finished.outcome, finished.decision) == ("completed", "done"), out
    assert sacct_records(job_id) == ["REQUEUED", "COMPLETED"]
    assert out.rstrip().endswith(f"[submit] job {job_id} completed; run folder {folder}"), out
