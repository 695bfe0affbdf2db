"""How a sharded checkpoint's tensors are staged and written (hpc_ddp.run.checkpoint.dcpwrite): one staging
copy reused while writes succeed, a failed write's copy left alone for its retry, `--async-save` checked at
start, DCP's rendezvous variables set only around its call, and a saving process that ends with its rank.

The real writes of both kinds: tests/test_run_fsdp.py (a run preempted twice, process-based, ends bitwise
equal to a thread-based one) and the 400 M parameter run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import clean_environ, die_with_test

from hpc_ddp.errors import UsageError
from hpc_ddp.run.checkpoint import dcpwrite
from hpc_ddp.run.config import ASYNC_SAVE_DEFAULT, TrainConfig


def test_one_staging_copy_is_reused_while_writes_succeed_and_a_failed_write_keeps_its_own() -> None:
    weights = {"w": torch.ones(3)}
    staging = dcpwrite.Staging(shared=False)
    first, a = staging.stage(weights)
    staging.over(first, written=True)
    weights["w"] += 1
    second, b = staging.stage(weights)
    assert b["w"].data_ptr() == a["w"].data_ptr()  # the same buffer, copied into again
    assert torch.equal(b["w"], torch.full((3,), 2.0)) and second == first + 1
    staging.over(second, written=False)  # failed: its job may retry from this copy
    weights["w"] += 1
    third, c = staging.stage(weights)
    assert c["w"].data_ptr() != b["w"].data_ptr() and torch.equal(b["w"], torch.full((3,), 2.0))
    assert torch.equal(c["w"], torch.full((3,), 3.0))
    staging.over(third, written=True)
    _, d = staging.stage(weights)
    assert d["w"].data_ptr() == c["w"].data_ptr()  # written again: reused again


def test_async_save_is_checked_at_start_and_auto_is_the_measured_default() -> None:
    assert TrainConfig(strategy="fsdp").async_save_kind() == ASYNC_SAVE_DEFAULT
    assert TrainConfig(strategy="fsdp", async_save="process").async_save_kind() == "process"
    for options in ({}, {"strategy": "fsdp", "checkpoint_format": "full"}):
        with pytest.raises(UsageError, match="--async-save process writes sharded checkpoints"):
            TrainConfig(async_save="process", **options)
    with pytest.raises(UsageError, match="--async-save fork: choose one of auto, thread, process"):
        TrainConfig(strategy="fsdp", async_save="fork")


def test_dcp_rendezvous_variables_are_set_only_around_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "12345")
    monkeypatch.delenv("DCP_USE_PREFIX_STORE", raising=False)
    with dcpwrite._environ({"MASTER_PORT": "40000", "DCP_USE_PREFIX_STORE": "1"}):
        assert os.environ["MASTER_PORT"] == "40000" and os.environ["DCP_USE_PREFIX_STORE"] == "1"
    assert os.environ["MASTER_PORT"] == "12345" and "DCP_USE_PREFIX_STORE" not in os.environ


@pytest.mark.process
def test_a_saving_process_outlives_stop_signals_and_ends_when_its_rank_is_killed() -> None:
    """The rank (here a plain python) starts the saving process from a thread, as DCP does; the stop signals
    leave it alone; SIGKILL the rank and it is gone."""
    child = (
        "from hpc_ddp.run.checkpoint.dcpwrite import in_saving_process; in_saving_process(0.05); "
        "import time; print('up', flush=True); time.sleep(60)"
    )
    rank = (
        "import subprocess, sys, threading\n"
        f"start = lambda: print(subprocess.Popen([sys.executable, '-c', {child!r}]).pid, flush=True)\n"
        "t = threading.Thread(target=start); t.start(); t.join()\n"
        "import time; time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True, env=clean_environ(),
        preexec_fn=die_with_test,
    )  # fmt: skip
    assert proc.stdout is not None
    saver = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "up"
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):  # Slurm's, to every process of the step
        os.kill(saver, sig)
    time.sleep(0.3)
    assert _alive(saver)  # they are its rank's to act on
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(saver):
        time.sleep(0.05)
    assert not _alive(saver)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie (reaped later by init) has exited
    except FileNotFoundError:
        return False
