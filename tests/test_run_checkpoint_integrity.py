"""Checkpoints that can be checked and always loaded, in-process and fast: one section per item of the issue
"Nothing lost, nothing hidden" (the same rules in real runs are in tests/test_run_folder_rules.py)."""

from __future__ import annotations

import errno
import hashlib
import itertools
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_run_checkpoint import sample_state

from hpc_ddp.errors import CheckpointError
from hpc_ddp.run.checkpoint import content, formats, full, resume, store
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.checkpoint.writer import AsyncWriter
from hpc_ddp.run.config import TrainConfig


def wait_for(predicate, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


# --- 14. A checksum of every checkpoint, verified on load ---------------------------------------------------


def test_a_flipped_bit_is_corrupt_and_the_previous_checkpoint_is_used(tmp_path: Path) -> None:
    first, _ = full.commit(tmp_path, sample_state(1), step=1, keep=3, storage=Local())
    state = sample_state(2)
    newest, _ = full.commit(tmp_path, state, step=2, keep=3, storage=Local())
    # Kept next to the file in sha256sum's format, so `sha256sum -c` checks it by hand too.
    sums = (newest.parent / (newest.name + ".sha256")).read_text()
    assert re.fullmatch(r"[0-9a-f]{64}  ckpt-00000002\.pt\n", sums)
    assert sums.split()[0] == hashlib.sha256(newest.read_bytes()).hexdigest()

    data = bytearray(newest.read_bytes())
    at = data.find(state["model"]["weight"].numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x10  # one bit of one weight
    newest.write_bytes(bytes(data))
    damaged = torch.load(newest, weights_only=True)  # what loaded silently before: torch does not notice
    assert not torch.equal(damaged["model"]["weight"], state["model"]["weight"])

    warnings: list[str] = []
    found = formats.find_resumable(CheckpointStore(tmp_path, Local()), warnings.append)
    assert found is not None and found == first
    assert "ckpt-00000002.pt cannot be loaded safely: it is corrupt (its SHA-256 is" in warnings[0], warnings


# --- 6. A `latest` pointer that cannot be read --------------------------------------------------------------


@pytest.mark.parametrize("breakage", ["not UTF-8", "a directory"])
def test_an_unreadable_latest_falls_back_to_the_newest_checkpoint_and_is_repaired(
    tmp_path: Path, breakage: str
) -> None:
    full.commit(tmp_path, sample_state(1), step=1, keep=3, storage=Local())
    full.commit(tmp_path, sample_state(2), step=2, keep=3, storage=Local())
    pointer = store.ckpt_dir(tmp_path) / "latest"
    pointer.unlink()
    if breakage == "not UTF-8":
        pointer.write_bytes(b"ckpt-\xff\xfe\x80.pt\n")
    else:
        pointer.mkdir()
        (pointer / "junk").write_text("x")
    warnings: list[str] = []
    found = formats.find_resumable(CheckpointStore(tmp_path, Local()), warnings.append)
    assert found is not None and found.name == "ckpt-00000002.pt"
    assert (
        f"{pointer} is unreadable" in warnings[0] and "using the newest checkpoint that loads" in warnings[0]
    )
    # A start from it points `latest` at it again (a directory is moved aside, not deleted), and saves work.
    assert resume.choose(TrainConfig(), CheckpointStore(tmp_path, Local()), {}, warnings.append) == found
    assert store.read_latest(tmp_path, storage=Local()) == found
    full.commit(tmp_path, sample_state(3), step=3, keep=3, storage=Local())
    assert store.read_latest(tmp_path, storage=Local()).name == "ckpt-00000003.pt"  # type: ignore[union-attr]


# --- 4. What the kit saves, it can load; "corrupt" means corrupt -------------------------------------------


class _NotData:
    """Pickled by reference to this module: a weights_only load refuses it."""


def test_numpy_scalars_are_saved_as_python_numbers_and_other_types_fail_before_writing(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=np.float64(0.01), momentum=np.float32(0.9))
    state = {**sample_state(1), "optimizer": opt.state_dict()}
    snapshot = content.to_cpu(state)
    group = snapshot["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and type(group["momentum"]) is float and group["lr"] == 0.01
    path, _ = full.commit(tmp_path, snapshot, step=1, keep=3, storage=Local())
    assert full.load(path, storage=Local())["optimizer"]["param_groups"][0]["lr"] == 0.01

    odd = {"param_groups": [{"lr": 0.1, "tracker": _NotData()}]}
    pattern = r"the optimizer's state_dict\(\)\['param_groups'\]\[0\]\['tracker'\] is a .*_NotData"
    with pytest.raises(CheckpointError, match=pattern):
        content.check_savable(odd, "the optimizer's state_dict()")
    with pytest.raises(CheckpointError, match=r"\['tracker'\] is a .*_NotData.*weights_only"):
        content.to_cpu({"optimizer": odd})
    with pytest.raises(CheckpointError, match=r"\['w'\] is a numpy.ndarray"):
        content.to_cpu({"w": np.zeros(3)})


def test_a_checkpoint_with_numpy_scalars_from_before_the_fix_still_loads(tmp_path: Path) -> None:
    state = sample_state(1)
    state["optimizer"]["param_groups"][0]["lr"] = np.float64(0.01)
    path = store.ckpt_dir(tmp_path) / store.ckpt_name(1)
    path.parent.mkdir(parents=True)
    torch.save(state, path)  # as the kit used to write them: no checksum, numpy inside
    assert full.load(path, storage=Local())["optimizer"]["param_groups"][0]["lr"] == 0.01


def test_an_intact_checkpoint_a_safe_load_refuses_is_never_called_corrupt(tmp_path: Path) -> None:
    path = store.ckpt_dir(tmp_path) / store.ckpt_name(1)
    path.parent.mkdir(parents=True)
    torch.save({**sample_state(1), "extra": _NotData()}, path)
    warnings: list[str] = []
    assert formats.find_resumable(CheckpointStore(tmp_path, Local()), warnings.append) is None
    assert "it is intact, but holds test_run_checkpoint_integrity._NotData" in warnings[0], warnings
    assert "corrupt" not in warnings[0]
    with pytest.raises(CheckpointError) as refused:
        resume.choose(TrainConfig(), CheckpointStore(tmp_path, Local()), {}, warnings.append)
    assert "ckpt-00000001.pt are intact but refused" in str(refused.value)
    assert "corrupt" not in str(refused.value)
    assert path.is_file()


# --- 1. Rotation keeps the line it continues --------------------------------------------------------------


def test_rotation_keeps_the_file_it_just_wrote_and_never_deletes_a_later_step(tmp_path: Path) -> None:
    for step in (15, 30, 45):
        full.commit(tmp_path, sample_state(step), step=step, keep=3, storage=Local())
    path, _ = full.commit(tmp_path, sample_state(25), step=25, keep=1, storage=Local())
    assert path.is_file() and store.read_latest(tmp_path, storage=Local()) == path
    assert [p.name for p in store.list_checkpoints(tmp_path, storage=Local())] == [
        "ckpt-00000045.pt",
        "ckpt-00000030.pt",
        "ckpt-00000025.pt",
    ]  # 15 is older than 25: rotated
    assert not (store.ckpt_dir(tmp_path) / "ckpt-00000015.pt.sha256").exists()


# --- 11. A failed background save is reported at once and retried ------------------------------------------


def test_a_failed_background_save_is_retried_with_backoff_until_it_is_written(tmp_path: Path) -> None:
    warnings: list[str] = []
    writer = AsyncWriter(warn=warnings.append, retries=3, backoff_s=0.05)
    attempts = [0]

    def job() -> tuple[Path, int]:
        attempts[0] += 1
        if attempts[0] <= 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))
        return full.commit(tmp_path, sample_state(1), step=1, keep=3, storage=Local())

    writer.submit(job)
    wait_for(lambda: writer.check() is None and attempts[0] >= 1 and not writer._thread)
    assert "retry 1 of 3 in 0.05 s" in warnings[0] and "No space left on device" in warnings[0]
    wait_for(lambda: writer.check() is None and writer.last is not None)
    assert attempts[0] == 3 and "retry 2 of 3 in 0.1 s" in warnings[1]
    assert "written after 2 failed attempt(s)" in warnings[2]
    assert store.read_latest(tmp_path, storage=Local()) == writer.wait()[0]  # type: ignore[index]


def test_saving_that_keeps_failing_is_reported_when_the_retries_are_spent(tmp_path: Path) -> None:
    # The writer's clock advances 1 ms each time it is read (only between writes), not with the wall: under
    # load a retry started late must not spend the 30 ms budget before its third attempt.
    ticks = itertools.count()
    writer = AsyncWriter(warn=lambda _: None, retries=2, backoff_s=0.01, clock=lambda: next(ticks) * 0.001)
    attempts = [0]

    def full() -> tuple[Path, int]:
        attempts[0] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.submit(full)
    wait_for(lambda: writer.check() is not None)
    assert attempts[0] == 3 and isinstance(writer.check(), OSError)
    with pytest.raises(OSError, match="No space"):
        writer.wait(retry=True)
    # A folder that is a file is no passing trouble: no retry.
    once = AsyncWriter(warn=lambda _: None, retries=5, backoff_s=0.01)
    once.submit(
        lambda: (
            full.commit(tmp_path / "x" / "y", sample_state(1), 1, 1, storage=Local())
            if (tmp_path / "x").write_text("a file")
            else None
        )
    )  # type: ignore[func-returns-value]
    wait_for(lambda: once.check() is not None)
    assert once.failures == 1
