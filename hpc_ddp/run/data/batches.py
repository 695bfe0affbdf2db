"""Batches of any structure: moved to the rank's device, checked once.

What a data loader yields is rarely an `(input, target)` pair of tensors: Hugging Face models take dicts (or a
`BatchEncoding`, which has its own `.to()`), vision code passes tuples of several inputs, research code
dataclasses and namedtuples. `to_device` walks the structure and moves every tensor, keeping each container's
type; leaves that are not tensors (strings, numbers, None) pass through untouched.

`check` looks at the first batch before training: a leaf the kit cannot move or a user's step cannot rely on
(a set, whose order differs between ranks; a generator, consumed once; an open file...) is a usage error that
names where it is (`batch["tags"]: set`), exit 2, never retried: the same data fails the same way again.

Pinned host tensors go with `non_blocking=True` (the copy overlaps the next kernels); an unpinned one would make
`non_blocking` a no-op at best, so it is only asked for pinned memory.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from hpc_ddp.errors import UsageError

# Leaves that pass through as they are: plain data every rank sees the same way.
_PLAIN = (str, bytes, int, float, bool, complex, type(None))


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _has_to(obj: Any) -> bool:
    """An object that moves itself (a Hugging Face BatchEncoding, a user's batch class)."""
    return callable(getattr(obj, "to", None)) and not isinstance(obj, torch.Tensor)


def _is_numpy(obj: Any) -> bool:
    return type(obj).__module__ == "numpy"


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor on `device`, recursively; containers keep their type (pure: no in-place change,
    except that an object with its own `.to()` is asked to move itself, as it would be in a user's loop)."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=device.type == "cuda" and batch.is_pinned())
    if isinstance(batch, _PLAIN) or _is_numpy(batch):
        return batch
    if _is_namedtuple(batch):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if isinstance(batch, Mapping) and not _has_to(batch):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # OrderedDict, a user's dict subclass
        except TypeError:  # a Mapping whose constructor takes something else (defaultdict, a custom class)
            return moved
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved_obj = copy.copy(batch)
        for f in dataclasses.fields(batch):
            # object.__setattr__: a frozen dataclass too (the copy is ours; the user's batch is not changed)
            object.__setattr__(moved_obj, f.name, to_device(getattr(batch, f.name), device))
        return moved_obj
    if _has_to(batch):
        return batch.to(device)
    return batch


def _path(parts: list[str]) -> str:
    return "batch" + "".join(parts)


def check(batch: Any) -> None:
    """Raise UsageError naming the first element of `batch` that the kit cannot use, e.g.
    `batch["tags"]: set`. Called once, on the first batch, before the first step (every rank)."""
    problem = _find(batch, [])
    if problem is not None:
        where, kind = problem
        raise UsageError(
            f"{where}: {kind} cannot be part of a batch (a batch is made of tensors, numbers, strings and None, "
            "in tuples, lists, dicts, namedtuples and dataclasses, or objects with their own .to() such as a "
            "BatchEncoding). Fix: make the dataset or Task.collate_fn return one of those (a set's order "
            "differs between processes: use a sorted list or a tensor)"
        )


def _find(obj: Any, parts: list[str]) -> tuple[str, str] | None:
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN) or _is_numpy(obj):
        return None
    if _is_namedtuple(obj):
        items: Any = ((f".{name}", v) for name, v in zip(obj._fields, obj, strict=True))
    elif isinstance(obj, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, Mapping) and not _has_to(obj):
        items = ((f"[{k!r}]", v) for k, v in obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif _has_to(obj):
        return None
    else:
        return _path(parts), type(obj).__name__
    for part, value in items:
        found = _find(value, [*parts, part])
        if found is not None:
            return found
    return None
