"""Issue 36, the memory proof: a model of about 400 M parameters (1.61 GB in fp32) given as a factory trains
2 steps with --strategy fsdp on a local 2 x 2 run with plain SGD, saves its final sharded checkpoint and writes
model.pth from it, and no rank's peak resident memory, read by the rank itself (getrusage), reaches the size
of the whole model: only possible if no rank ever holds it, not at the build (meta device), not in training,
not at the save, not while rank 0 streams model.pth.

The costliest run of the suite (the four ranks move about 5 GB through loopback each step): one run, the two
steps issue 36 names (the second is the steady state: gradients and the optimizer step again, with the first
step's buffers freed), one save, every assertion that can ride on it, and its 3.2 GB of files in memory where
there is room (`in_memory`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from fsdp_tasks import HUGE_DEPTH, HUGE_WIDTH
from test_launch_local import finish, start

pytestmark = [pytest.mark.slow, pytest.mark.deadline(600)]

PARAMS = 11 * HUGE_WIDTH + HUGE_DEPTH * (HUGE_WIDTH + 1) * HUGE_WIDTH + HUGE_WIDTH + 1 + 8  # Blocks' count
MODEL_BYTES = 4 * PARAMS


SHM_PREFIX = "hpc_ddp-fsdp-memory-"


@pytest.fixture
def in_memory(tmp_path: Path) -> Iterator[Path]:
    """A run folder in memory (tmpfs) where there is room: the run writes its checkpoint and model.pth, 3.2 GB,
    which a disk makes tens of seconds of fsync. What the ranks hold is the same either way (a file's pages are
    not a process's resident memory). A folder left by a test process that is gone (a deadline's _exit skips
    this fixture's cleanup) is removed first: tmpfs holds it until a reboot."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        yield tmp_path
        return
    for stale in shm.glob(f"{SHM_PREFIX}*-*"):
        if not psutil.pid_exists(int(stale.name[len(SHM_PREFIX) :].partition("-")[0])):
            shutil.rmtree(stale, ignore_errors=True)
    if shutil.disk_usage(shm).free < 3 * MODEL_BYTES:
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_no_rank_ever_holds_the_whole_400m_model(in_memory: Path) -> None:
    assert 390e6 < PARAMS < 410e6
    args = ("--task", "fsdp_tasks:huge", "--nodes", "2", "--tasks-per-node", "2", "--gpus-per-node", "0")
    args += ("--strategy", "fsdp", "--max-steps", "2", "--batch-size", "1", "--save-every-epochs", "0")
    code, out = finish(start(in_memory, *args, "--log-every-s", "0"), timeout=540)
    assert code == 0, out
    peaks = {p.name: int(p.read_text()) for p in in_memory.glob("peak-rss-*")}
    assert sorted(peaks) == [f"peak-rss-{r}" for r in range(4)], out
    for name, peak in peaks.items():
        # Above a quarter of the model (its shards are really there), below the whole of it.
        assert MODEL_BYTES / 4 < peak < MODEL_BYTES, (
            f"{name}: {peak / 2**20:.0f} MiB, model {MODEL_BYTES / 2**20:.0f} MiB"
        )
    # model.pth, which rank 0 streamed from the shards, is the whole model; mapped here, not read.
    weights = torch.load(in_memory / "model.pth", weights_only=True, mmap=True)
    assert sum(t.numel() for t in weights.values()) == PARAMS
    assert all(t.dtype == torch.float32 for t in weights.values())
