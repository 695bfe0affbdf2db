"""A checkpoint write that fails, in unit form (the real runs: tests/test_run_save_retry.py): the cause is
found whatever torch raised, the retries end by time and not by count, the other ranks' stop reads as a
consequence of rank 0's, and a refused start leaves no probe file behind."""

from __future__ import annotations

import errno
import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.errors import DiskFull, SavingFailed
from hpc_ddp.ledger import judge
from hpc_ddp.log import RankLog
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint import durable, full, store, torchfile
from hpc_ddp.run.checkpoint.checkpointer import SAVING_FAILED, Checkpointer
from hpc_ddp.run.checkpoint.part import REPLICATED, Loading, Part
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.writer import BACKOFF_VAR, AsyncWriter, retriable
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.watch.beacon import NullBeacon

TORCH_ZIP_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"

# ----- the cause, whatever torch raised --------------------------------------------------------------------


class Weights(Part):
    key, kind = "model", REPLICATED

    def state_dict(self) -> Any:
        return {"w": torch.randn(1000)}

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        pass


class _FullDisk:
    """A file that takes the first write and then meets a full disk (what torch's zip writer writes into)."""

    def __init__(self, out: Any) -> None:
        self.out, self.calls = out, 0

    def write(self, data: Any) -> int:
        self.calls += 1
        if self.calls > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self.out.write(data))

    def flush(self) -> None:
        self.out.flush()


def test_a_full_disk_inside_torchs_zip_writer_is_the_oserror_it_hides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch turns the OSError into `RuntimeError: [enforce fail ...] unexpected pos`: the write's job raises
    the OSError, which the writer retries, instead of a RuntimeError that stopped the run with a traceback."""
    monkeypatch.setattr(torchfile, "_save_stream", lambda obj, out: torch.save(obj, _FullDisk(out)))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # what torch itself raises
        torch.save({"w": torch.ones(3)}, _FullDisk(io.BytesIO()))
    job = full.Full(tmp_path, dist_env.detect({}), keep=2, storage=Local()).stage(
        [Weights()], {"world_size": 1}, step=3
    )
    assert job is not None
    with pytest.raises(OSError) as caught:
        job()
    assert caught.value.errno == errno.ENOSPC and retriable(caught.value)
    assert store.list_checkpoints(tmp_path, storage=Local()) == [] and not list(
        store.ckpt_dir(tmp_path).glob(".*tmp-*")
    )


class _Statvfs:
    def __init__(self, free: int, read_only: bool = False) -> None:
        self.f_bavail, self.f_frsize = free // 4096, 4096
        self.f_flag = os.ST_RDONLY if read_only else 0


def test_when_the_error_says_nothing_the_folder_is_asked(tmp_path: Path) -> None:
    """A bare RuntimeError (no OSError in its chain): free space, read-only, a probe write (a quota), else the
    error as it was (a bug keeps its traceback)."""
    bare = RuntimeError(TORCH_ZIP_ERROR)
    mb = 1 << 20

    def diagnose(free: int, read_only: bool = False, probe: OSError | None = None) -> BaseException:
        return durable.diagnose(
            bare, tmp_path, 14 * mb, statvfs=lambda _: _Statvfs(free, read_only), probe=lambda *_: probe
        )

    full_disk = diagnose(free=2 * mb)
    assert isinstance(full_disk, OSError) and full_disk.errno == errno.ENOSPC and retriable(full_disk)
    assert "No space left on device (2.1 MB free, about 14.7 MB needed)" in str(full_disk)
    assert diagnose(free=100 * mb, read_only=True).errno == errno.EROFS  # type: ignore[attr-defined]
    quota = diagnose(free=100 * mb, probe=OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert isinstance(quota, OSError) and quota.errno == errno.EDQUOT and retriable(quota)
    assert diagnose(free=100 * mb) is bare
    chained = RuntimeError(TORCH_ZIP_ERROR)
    chained.__context__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert durable.diagnose(chained, tmp_path) is chained.__context__
    # The real probe writes, fsyncs and removes its file.
    assert durable._probe(tmp_path, mb) is None and list(tmp_path.iterdir()) == []


# ----- retries: by time, not by count ------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _failing() -> tuple[Path, int]:
    raise OSError(errno.ENOSPC, "No space left on device", "/x/checkpoints/ckpt.pt")


def _settle(writer: AsyncWriter) -> None:
    thread = writer._thread
    if thread is not None:
        thread.join()


def test_newer_saves_that_replace_a_pending_retry_do_not_count_as_retries() -> None:
    """Saves every 0.1 s on a disk full for 4 s: each newer save fails too, and the run goes on (before, the
    sixth failed write within those 4 s stopped it)."""
    clock, warnings = _Clock(), []
    writer = AsyncWriter(warn=warnings.append, backoff_s=1.0, clock=clock)
    for _ in range(40):
        writer.submit(_failing)  # supersedes the pending retry
        _settle(writer)
        assert writer.check() is None, warnings[-1]
        clock.now += 0.1
    assert writer.failures == 40 and writer.retried == 0  # each newer save pushed retry 1 back
    assert all(w.endswith("retry 1 of 5 in 1 s, training goes on") for w in warnings)  # no doubling
    clock.now += 40.0  # the disk stays full: the next failure is 44 s after the first
    writer.submit(_failing)
    _settle(writer)
    assert isinstance(writer.check(), OSError) and writer.failures == 41


def test_the_run_gives_up_only_after_writes_failed_for_31_seconds() -> None:
    clock, warnings = _Clock(), []
    writer = AsyncWriter(warn=warnings.append, backoff_s=1.0, clock=clock)
    writer.submit(_failing)
    _settle(writer)
    started: list[float] = []
    while clock.now < 60 and writer.fatal is None:
        before = writer.retried
        writer.check()  # books a failure, or starts a retry that is due
        if writer.retried > before:
            started.append(clock.now)
        _settle(writer)
        clock.now += 0.25
    # Each failure is booked at the next check, 0.25 s after its retry started; then 1, 2, 4, 8, 16 s.
    assert started == [1.0, 3.25, 7.5, 15.75, 32.0]
    assert [w.split("; ")[1] for w in warnings] == [
        f"retry {k} of 5 in {delay} s, training goes on" for k, delay in enumerate((1, 2, 4, 8, 16), 1)
    ]
    booked = clock.now - 0.25  # the loop's last check
    assert isinstance(writer.fatal, OSError) and booked - writer.failing_since == 32.25  # >= 31 s: given up


def test_the_backoff_is_read_when_a_writer_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKOFF_VAR, "0.25")
    assert AsyncWriter().backoff_s == 0.25
    monkeypatch.setenv(BACKOFF_VAR, "2")
    assert AsyncWriter().backoff_s == 2.0 and AsyncWriter().budget_s == 62.0


# ----- the other ranks' stop is a consequence ------------------------------------------------------------------


def test_the_ranks_that_stop_because_rank_0_cannot_save_read_as_its_consequence(tmp_path: Path) -> None:
    """A rank whose own writer is fine stops at the agreed step with a message the supervisor reads as a
    consequence (judge.SECONDARY), so the first cause named is rank 0's, even when its note came later."""
    env = dist_env.DistEnv(1, 1, 2, 2, 0, 1, "127.0.0.1", 29500, "7", "slurm")
    checkpointer = Checkpointer(
        TrainConfig(), env, tmp_path, [], full.Full(tmp_path, env, 1, Local()), RankLog(1, io.StringIO()),
        lambda *_: None, NullBeacon(),
    )  # fmt: skip
    stop = checkpointer.stop(SAVING_FAILED, 12)
    assert isinstance(stop, SavingFailed) and "every rank stopped with it at step 12" in str(stop)
    assert judge.secondary(f"SavingFailed: {stop}")
    notes = (
        {"rank": 1, "time": 1.0, "type": "SavingFailed", "message": str(stop), "retry": False},
        {
            "rank": 0,
            "time": 2.0,
            "type": "SavingFailed",
            "message": "checkpoints cannot be written to /x: No space left on device",
            "retry": False,
        },
    )
    ending = judge.judge(judge.Evidence(code=1, rank_nodes=("n0", "n0"), notes=notes))
    assert ending.rank == 0 and "No space left on device" in ending.reason and not ending.retryable


# ----- a refused start leaves nothing behind ---------------------------------------------------------------------


def test_a_write_test_that_meets_a_full_disk_leaves_no_probe_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe file is created, then its write fails (ENOSPC): it is removed, and once the disk has stayed full
    for the retry window the start fails with one line, never as a usage error (issue 32, finding 10)."""
    real = Path.write_bytes

    def full_disk(self: Path, data: bytes) -> int:
        real(self, b"")  # created: the directory entry fits, its bytes do not
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    monkeypatch.setenv("HPC_DDP_SAVE_BACKOFF_S", "0.01")  # a window of 0.31 s
    with pytest.raises(
        DiskFull, match=r"cannot be written: No space left on device, still after waiting 0.31 s"
    ):
        run_folder.prepare(tmp_path)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    assert threading.active_count() >= 1
