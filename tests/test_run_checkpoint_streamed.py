"""A torch file written tensor by tensor (hpc_ddp.run.checkpoint.streamed): what torch.load reads back, with
and without mmap, whatever the dtypes, views and batches; a fetch that gives the wrong tensor is refused."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from hpc_ddp.run.checkpoint import streamed


def test_written_in_batches_it_loads_as_torch_save_would_have_written_it(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "w": torch.randn(5, 3),
        "view": base[1:3, 2:],  # not contiguous, inside a larger storage: only its own bytes are written
        "half": torch.randn(7, dtype=torch.bfloat16),
        "count": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    laters = streamed.placeholders([(t.shape, t.dtype) for t in tensors.values()])
    names = list(tensors)
    asked: list[list[str]] = []

    def fetch(batch: list[streamed.Later]) -> list[torch.Tensor]:
        asked.append([names[int(later.storage.key)] for later in batch])
        return [tensors[n] for n in asked[-1]]

    obj = {**dict(zip(names, laters, strict=True)), "step": 12, "nested": {"again": laters[0]}}
    path = tmp_path / "model.pth"
    with open(path, "wb") as f:
        streamed.save(obj, laters, fetch, f, batch_bytes=96)
    assert asked == [
        ["w", "view"],
        ["half", "count", "empty"],
    ]  # 96 bytes a batch at most, in order: a few tensors each, in order
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert loaded["step"] == 12 and set(loaded) == {*names, "step", "nested"}
        for name, t in tensors.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
        assert loaded["nested"]["again"] is loaded["w"]  # one tensor, one record, as torch.save keeps it


def test_a_fetch_that_gives_another_shape_is_an_error() -> None:
    laters = streamed.placeholders([((2, 2), torch.float32)])
    with pytest.raises(
        ValueError, match=r"tensor 0: \(3,\) torch.float32 given, \(2, 2\) torch.float32 expected"
    ):
        streamed.save({"w": laters[0]}, laters, lambda batch: [torch.zeros(3)], io.BytesIO())
