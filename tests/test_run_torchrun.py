"""Under real torchrun (2 processes, gloo): `--max-restarts N` restarts the kit's tasks, which resume the run's
own latest checkpoint; a SIGTERM from torchrun's agent ends a rank that is still joining the group at once."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp import exitcodes

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.deadline(240)
@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="no torchrun")
def test_torchrun_max_restarts_resumes_the_runs_own_checkpoint(tmp_path: Path) -> None:
    """Before: the second round never trained. Its ranks read the first round's gloo addresses from torchrun's
    agent store (connectFullMesh: connection refused, or a hang), a rank stuck joining ignored torchrun's
    SIGTERM for 30 s, and a round after the first counted as a first start (`--resume never --overwrite`
    would have deleted the run's own checkpoints)."""
    folder = tmp_path / "run"
    cmd = [
        str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "hpc_ddp.train",
        "--resume",
        "never",
        "--overwrite",
        "--folder",
        str(folder),
        "--task",
        "torchrun_tasks:fails_once",
        "--epochs",
        "3",
        "--save-every-steps",
        "4",
    ]
    proc = subprocess.run(
        cmd,
        env=clean_environ(TORCHRUN_FAIL_MARKER=str(tmp_path / "failed-once"), SLOW_TASK_SLEEP_S="0.01"),
        capture_output=True,
        text=True,
        timeout=200,
        preexec_fn=die_with_test,
    )
    out = proc.stdout + proc.stderr
    assert (tmp_path / "failed-once").exists(), out[-3000:]  # the first round did fail
    assert proc.returncode == 0, out[-5000:]
    assert "connectFullMesh" not in out and "Unable to shutdown" not in out
    assert "Resuming from " in out and "ckpt-" in out.split("Resuming from ", 1)[1].splitlines()[0]
    assert "--resume never --overwrite: deleted" not in out  # the restart kept the run's own checkpoints
    starts = [json.loads(line) for line in (folder / "attempts.jsonl").read_text().splitlines()]
    assert [(s["event"], s["restart"]) for s in starts] == [("start", 0), ("start", 1)]
    assert starts[0]["resumed_from"] is None and starts[1]["resumed_from"] is not None
    assert (folder / "model.pth").is_file()


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc/<pid>/status, SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.deadline(90)
def test_a_sigterm_before_training_ends_a_torchrun_rank_at_once(tmp_path: Path) -> None:
    """Rank 1 of a torchrun round whose store never answers: it waits in C++ (the store's connect), where a
    Python handler never runs. torchrun's agent SIGTERMs it when a peer failed; before, the rank only noted
    it and stayed until the agent's SIGKILL 30 s later (here: until --timeout-s, 60 s)."""
    env = clean_environ(
        TORCHELASTIC_RUN_ID="t1",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),  # nobody listens there
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp.train", "--folder", str(tmp_path / "run"), "--timeout-s", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )
    try:
        # Once its handlers are installed (the kernel shows SIGUSR1 caught), wherever it is: importing torch,
        # or waiting in C++ for the store.
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGUSR1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
    finally:
        proc.kill()
        proc.wait()
    assert code == -signal.SIGTERM  # the default action: nothing to save before training
    assert code != exitcodes.PREEMPTED
