"""A torch file written tensor by tensor: the `model.pth` of a model that no process holds whole.

`torch.save` pickles the whole object first, then writes each tensor's bytes as one record of its zip file
(`data/<key>`): every tensor must exist at once. Here the pickle is made from placeholders (`Later`: a shape
and a dtype), written first as torch.save writes it, and the tensors' bytes are asked for afterwards, in file
order, a batch of about `batch_bytes` at a time (`fetch`): the memory is one batch, not the file. The file is
torch.save's own format (the same records and alignment, written by the same zip writer, without CRC32s as
the kit's other torch files): `torch.load(path, weights_only=True)` reads it, and with `mmap=True` reads
nothing until a tensor is used.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

BATCH_BYTES = 256 * 2**20  # what a fetch may hold at once (a tensor larger than this comes alone)


class _Storage:
    """Where a `Later`'s bytes go: its record's key, pickled as torch.save pickles a storage."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class Later:
    """A tensor whose bytes are written after the pickle: pickled as torch.save pickles a contiguous tensor."""

    def __init__(self, key: int, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype
        self.storage = _Storage(str(key), dtype, self.shape.numel())

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def __reduce_ex__(self, protocol: Any) -> Any:
        stride = [1] * len(self.shape)
        for dim in range(len(self.shape) - 2, -1, -1):
            stride[dim] = stride[dim + 1] * self.shape[dim + 1]
        args = (self.storage, 0, tuple(self.shape), tuple(stride), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def placeholders(shapes: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[Later]:
    """One `Later` per (shape, dtype), keyed in this order: the order their bytes are written and fetched."""
    return [Later(i, shape, dtype) for i, (shape, dtype) in enumerate(shapes)]


def _pickled(obj: Any) -> bytes:
    storage_types = torch.storage._dtype_to_storage_type_map()

    class Pickler(pickle.Pickler):
        def persistent_id(self, item: Any) -> Any:
            if isinstance(item, _Storage):
                kind = getattr(torch, storage_types[item.dtype])
                return ("storage", kind, item.key, "cpu", item.numel)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)  # torch.save's protocol
    return buf.getvalue()


def batches(laters: Sequence[Later], batch_bytes: int = BATCH_BYTES) -> Iterator[list[Later]]:
    """`laters` in order, grouped so that each group's bytes stay under `batch_bytes` (or one tensor alone)."""
    group: list[Later] = []
    size = 0
    for later in laters:
        if group and size + later.nbytes > batch_bytes:
            yield group
            group, size = [], 0
        group.append(later)
        size += later.nbytes
    if group:
        yield group


def save(
    obj: Any,
    laters: Sequence[Later],
    fetch: Callable[[list[Later]], Sequence[torch.Tensor]],
    out: Any,
    batch_bytes: int = BATCH_BYTES,
) -> None:
    """Write `obj` (which holds `laters` where its tensors are) to the file object `out` in torch.save's format,
    then each tensor's bytes, `fetch(batch)` giving a batch's tensors (on CPU, their shapes and dtypes)."""
    data = _pickled(obj)
    writer = torch._C.PyTorchFileWriter(out, False, torch.serialization._get_storage_alignment())
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    alignment = str(torch.serialization._get_storage_alignment())
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for batch in batches(laters, batch_bytes):
        tensors = fetch(batch)
        for later, tensor in zip(batch, tensors, strict=True):
            if tensor.shape != later.shape or tensor.dtype != later.dtype:
                raise ValueError(
                    f"tensor {later.storage.key}: {tuple(tensor.shape)} {tensor.dtype} given, "
                    f"{tuple(later.shape)} {later.dtype} expected"
                )
            tensor = tensor.detach().to("cpu")
            storage = tensor.untyped_storage()
            if not tensor.is_contiguous() or tensor.storage_offset() or storage.nbytes() != later.nbytes:
                storage = tensor.contiguous().clone().untyped_storage()  # its own bytes only
            writer.write_record(f"data/{later.storage.key}", storage, later.nbytes)
        del tensors
    writer.write_end_of_file()
    out.flush()
