"""Checkpoint tools: `python -m hpc_ddp.checkpoint export` turns any checkpoint of a run into a plain `model.pth`;
`load_model(model, path)` reads a checkpoint's model into a plain model in this one process.

    from hpc_ddp.checkpoint import load_model
    load_model(model, "runs/exp1/checkpoints/ckpt-00000120")    # sharded (any number of ranks) or full
    load_model(model, "runs/exp1/checkpoints/best")             # or latest: the checkpoint the pointer names

Both stream: a sharded checkpoint's tensors are read a slice at a time, into the model's own tensors (`load_model`)
or into the file a batch at a time (`export`), so neither ever holds a second copy of the whole model. Both ask
the checkpoint's own format (each format owns its files, hpc_ddp.run.checkpoint.formats), and read it through
the storage `checkpoint_storage` names: the run's --checkpoint-storage (and, given `checkpoint_format`, the
run's --checkpoint-format reads it first: a plugin's class derived from a built-in reads its base's files).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from hpc_ddp.run.checkpoint.format import Format
    from hpc_ddp.run.checkpoint.storage import Storage


def load_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    verify: bool = True,
    checkpoint_storage: str = "local",
    checkpoint_format: str = "auto",
) -> nn.Module:
    """Load the model of `checkpoint` (a sharded `ckpt-<step>/` folder, a full `ckpt-<step>.pt` file, or a run's
    `checkpoints/best` or `checkpoints/latest`, the checkpoint each names) into `model`, in place, and return it.
    `verify`: check its checksums first (reads every byte of it once). `checkpoint_storage`: the name the run
    gave --checkpoint-storage (where its checkpoints are kept); `checkpoint_format`: its --checkpoint-format
    (auto: the first installed format that owns the checkpoint). CheckpointError (and its kinds, hpc_ddp.errors)
    for a damaged checkpoint or one of another model."""
    from hpc_ddp.run.checkpoint import store

    storage = store.storage_named(checkpoint_storage)
    path, fmt = found(checkpoint, storage, checkpoint_format)
    fmt.load_model(path, model, storage, verify)
    return model


def found(checkpoint: str | os.PathLike[str], storage: Storage, fmt: str) -> tuple[Path, type[Format]]:
    """The checkpoint a path names (a pointer: the one it names) and its format (`fmt`, a --checkpoint-format
    name, when it owns it; auto: the first installed that does); CheckpointError if there is none."""
    from pathlib import Path

    from hpc_ddp.errors import CheckpointError
    from hpc_ddp.run.checkpoint import formats, store

    given = Path(checkpoint)
    if not (storage.isfile(str(given)) or storage.isdir(str(given))):
        raise CheckpointError(
            f"{given}: no such checkpoint. Give a ckpt-<step>/ folder or ckpt-<step>.pt file"
        )
    path = store.resolve(given, storage)  # checkpoints/best, checkpoints/latest: the checkpoint each names
    return path, formats.format_of(path, storage, None if fmt == "auto" else formats.named(fmt))
