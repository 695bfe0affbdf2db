"""Checkpoints that can be checked and always loaded, in-process and fast: one section per item of the issue
"Nothing lost, nothing hidden" (the same rules in real runs are in tests/test_run_folder_rules.py)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

from hpc_ddp import checkpoint, resume
from hpc_ddp.config import TrainConfig
from test_checkpoint import sample_state


# --- 14. A checksum of every checkpoint, verified on load ---------------------------------------------------


def test_a_flipped_bit_is_corrupt_and_the_previous_checkpoint_is_used(tmp_path: Path) -> None:
    first, _ = checkpoint.commit(tmp_path, sample_state(1), step=1, keep=3)
    state = sample_state(2)
    newest, _ = checkpoint.commit(tmp_path, state, step=2, keep=3)
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
    found = checkpoint.find_resumable(tmp_path, warnings.append)
    assert found is not None and found[0] == first
    assert "ckpt-00000002.pt cannot be loaded safely: it is corrupt (its SHA-256 is" in warnings[0], warnings


# --- 6. A `latest` pointer that cannot be read --------------------------------------------------------------


@pytest.mark.parametrize("breakage", ["not UTF-8", "a directory"])
def test_an_unreadable_latest_falls_back_to_the_newest_checkpoint_and_is_repaired(tmp_path: Path,
                                                                                 breakage: str) -> None:
    checkpoint.commit(tmp_path, sample_state(1), step=1, keep=3)
    checkpoint.commit(tmp_path, sample_state(2), step=2, keep=3)
    pointer = checkpoint.ckpt_dir(tmp_path) / "latest"
    pointer.unlink()
    if breakage == "not UTF-8":
        pointer.write_bytes(b"ckpt-\xff\xfe\x80.pt\n")
    else:
        pointer.mkdir()
        (pointer / "junk").write_text("x")
    warnings: list[str] = []
    found = checkpoint.find_resumable(tmp_path, warnings.append)
    assert found is not None and found[0].name == "ckpt-00000002.pt"
    assert f"{pointer} is unreadable" in warnings[0] and "using the newest checkpoint that loads" in warnings[0]
    # A start from it points `latest` at it again (a directory is moved aside, not deleted), and saves work.
    assert resume.choose(TrainConfig(), tmp_path, {}, warnings.append) == found[0]
    assert checkpoint.read_latest(tmp_path) == found[0]
    checkpoint.commit(tmp_path, sample_state(3), step=3, keep=3)
    assert checkpoint.read_latest(tmp_path).name == "ckpt-00000003.pt"  # type: ignore[union-attr]


# --- 1. Rotation keeps the line it continues --------------------------------------------------------------


def test_rotation_keeps_the_file_it_just_wrote_and_never_deletes_a_later_step(tmp_path: Path) -> None:
    for step in (15, 30, 45):
        checkpoint.commit(tmp_path, sample_state(step), step=step, keep=3)
    path, _ = checkpoint.commit(tmp_path, sample_state(25), step=25, keep=1)
    assert path.is_file() and checkpoint.read_latest(tmp_path) == path
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == \
        ["ckpt-00000045.pt", "ckpt-00000030.pt", "ckpt-00000025.pt"]  # 15 is older than 25: rotated
    assert not (checkpoint.ckpt_dir(tmp_path) / "ckpt-00000015.pt.sha256").exists()

