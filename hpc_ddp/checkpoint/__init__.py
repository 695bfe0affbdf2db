"""Checkpoint tools: `python -m hpc_ddp.checkpoint export` turns any checkpoint of a run into a plain `model.pth`;
`load_model(model, path)` reads a checkpoint's model into a plain model in this one process.

    from hpc_ddp.checkpoint import load_model
    load_model(model, "runs/exp1/checkpoints/ckpt-00000120")    # sharded (any number of ranks) or full
    load_model(model, "runs/exp1/checkpoints/best")             # or latest: the checkpoint the pointer names

Both stream: a sharded checkpoint's tensors are read a slice at a time, into the model's own tensors (`load_model`)
or into the file a batch at a time (`export`), so neither ever holds a second copy of the whole model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def load_model(model: nn.Module, checkpoint: str | os.PathLike[str], verify: bool = True) -> nn.Module:
    """Load the model of `checkpoint` (a sharded `ckpt-<step>/` folder, a full `ckpt-<step>.pt` file, or a run's
    `checkpoints/best` or `checkpoints/latest`, the checkpoint each names) into `model`, in place, and return it. `verify`: check its checksums first (reads every byte of it once).
    CheckpointError (and its kinds, hpc_ddp.errors) for a damaged checkpoint or one of another model."""
    from pathlib import Path

    from hpc_ddp.errors import CheckpointError
    from hpc_ddp.run.checkpoint import full, sharded, store
    from hpc_ddp.run.strategy.base import load_model_state

    path = store.resolve(Path(checkpoint))  # checkpoints/best, checkpoints/latest: the checkpoint each names
    if path.is_dir():
        sharded.load_model(path, model, verify)
        return model
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such checkpoint. Give a ckpt-<step>/ folder or ckpt-<step>.pt file"
        )
    load_model_state(model, full.load(path, verify=verify)["model"], path)
    return model
