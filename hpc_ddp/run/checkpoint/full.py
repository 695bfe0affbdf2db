"""The "full" format: one file, `checkpoints/ckpt-<step>.pt`, written by rank 0, holding every part.

    {"model": ..., "optimizer": ..., "scaler": ..., "position": ..., "rng": [rank 0's, rank 1's, ...],
     "world_size": N, "config": {...}, "version": "..."}

Each part's entry is under its key: a REPLICATED part's is rank 0's state, a PER_RANK part's is the list of
every rank's, gathered to rank 0 with one all_gather_object. Rank 0 copies it all to CPU on the training thread
(the loop's stall) and its background writer streams it into the file (torchfile, durable), checks each part's
state first (weights that are not finite are never written), then promotes it (store). Every rank reads the
whole file to resume. A checkpoint of this format needs the world size it was written with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hpc_ddp.errors import CheckpointError
from hpc_ddp.run.checkpoint import content, durable, store, torchfile
from hpc_ddp.run.checkpoint.format import Format
from hpc_ddp.run.checkpoint.part import PER_RANK, REPLICATED, Part
from hpc_ddp.run.checkpoint.storage import Storage
from hpc_ddp.run.checkpoint.writer import Job


def commit(
    folder: str | Path, state: dict[str, Any], step: int, keep: int, storage: Storage
) -> tuple[Path, int]:
    """Write checkpoint `step` into `storage` (durable, renamed into place, when it returns), then promote it
    (`latest`, rotation to `keep`). Returns the checkpoint's path and size."""
    directory = store.ckpt_dir(folder)
    storage.makedirs(str(directory))
    path = directory / store.ckpt_name(step)
    nbytes = torchfile.atomic_save(state, path, storage)
    store.promote(folder, path, keep, storage)
    return path, nbytes


def load(
    path: str | Path, storage: Storage, map_location: Any = "cpu", verify: bool = True
) -> dict[str, Any]:
    """A full checkpoint as data, read from `storage` (torchfile.load_file: weights_only, checksum when
    `verify`); `path` may be a run's `checkpoints/best` or `checkpoints/latest` (the checkpoint each names).
    CheckpointError if it is no hpc_ddp checkpoint."""
    path = store.resolve(path, storage)
    if storage.isdir(str(path)):
        raise CheckpointError(
            f"{path} is a sharded checkpoint (a folder), not a full one. Fix: read its model with "
            "hpc_ddp.checkpoint.load_model(model, path), or export it with python -m hpc_ddp.checkpoint export"
        )
    state = torchfile.load_file(path, storage, map_location, verify)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not an hpc_ddp checkpoint (no 'model' entry)")
    return state


class Loaded:
    """A full checkpoint in memory (`Opened`): its entries are the parts' states."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.meta = state

    def state_of(self, part: Part, rank: int) -> Any:
        value = self.meta.get(part.key)
        if part.kind == PER_RANK:
            return value[rank] if isinstance(value, list) and 0 <= rank < len(value) else None
        return value


class Full(Format):
    name = "full"

    @classmethod
    def owns(cls, path: Path, storage: Storage) -> bool:
        return not storage.isdir(str(path))  # any file: `--resume PATH` may name one that is not ckpt-*.pt

    def gather(self, parts: Sequence[Part], meta: Mapping[str, Any]) -> dict[str, Any] | None:
        """Collective: every rank's PER_RANK states to rank 0; the whole checkpoint state on rank 0 (not yet
        copied), None elsewhere."""
        mine = {p.key: _pack(p.state_dict()) for p in parts if p.kind == PER_RANK}
        everyone: list[Any] = [None] * self.env.world_size
        if mine:
            dist.all_gather_object(everyone, mine)
        # The writer's own work starts here: its state_dict() calls may be long (a big model to CPU); a rank
        # waiting for it in a collective is then waiting for a busy peer, not for a hung one (run/watch/beacon.py).
        if self.env.is_main:
            self.on_own_work()
        # Asked on every rank, in the same order: a strategy that shards (FSDP) gathers a whole state with a
        # collective, which rank 0 gets (the others get nothing, at the cost of a few references under DDP).
        whole = {p.key: p.state_dict() for p in parts if p.kind == REPLICATED}
        if not self.env.is_main:
            return None
        state: dict[str, Any] = {}
        for part in parts:
            if part.kind == REPLICATED:
                state[part.key] = whole[part.key]
            elif part.kind == PER_RANK:
                state[part.key] = [_unpack(rank_states[part.key]) for rank_states in everyone]
            else:
                raise CheckpointError(
                    f"{part.describe()} is sharded; the full format saves only whole states. Fix: "
                    "--checkpoint-format sharded"
                )
        return {**state, **meta}

    def stage(self, parts: Sequence[Part], meta: Mapping[str, Any], step: int) -> Job | None:
        state = self.gather(parts, meta)
        if state is None:
            return None
        snapshot = content.to_cpu(state, "the checkpoint state")
        checks = [(part.check, part.key) for part in parts]
        folder, keep, storage = self.folder, self.keep, self.storage

        def write() -> tuple[Path, int]:  # on the writer thread: the checks cost the training nothing
            for check, key in checks:
                check(snapshot.get(key), step)
            try:
                return commit(folder, snapshot, step, keep, storage)
            except Exception as e:
                # Whatever torch raised (its zip writer hides a full disk in a RuntimeError): the OSError it
                # really is, so that it is retried and said in one line.
                cause = durable.diagnose(e, store.ckpt_dir(folder), store.newest_size(folder, storage))
                if cause is e or not isinstance(cause, OSError):
                    raise
                where = cause.filename or str(store.ckpt_dir(folder) / store.ckpt_name(step))
                raise OSError(cause.errno, cause.strerror, where) from e

        return write

    @classmethod
    def open(cls, path: Path, storage: Storage, verify: bool = True) -> Loaded:
        return Loaded(load(path, storage, verify=verify))

    @classmethod
    def export(cls, path: Path, out: Path, storage: Storage, verify: bool = True) -> int:
        model = load(path, storage, verify=verify).get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"checkpoint {path} holds no model state")
        return torchfile.atomic_save(model, out, storage)

    @classmethod
    def load_model(cls, path: Path, model: Any, storage: Storage, verify: bool = True) -> None:
        from hpc_ddp.run.strategy.base import load_model_state

        load_model_state(model, load(path, storage, verify=verify)["model"], path)

    @classmethod
    def contents(cls, path: Path, storage: Storage) -> dict[str, Any]:
        return {"": torchfile.load_file(path, storage, verify=False)}

    @classmethod
    def world_size_change(cls, saved: int | None, now: int) -> str | None:
        return None if saved == now else f"world size {saved} (now {now})"


class _Uint8(NamedTuple):
    """A CPU uint8 vector (an RNG state) on its way to rank 0, as its bytes."""

    data: bytes


# RNG states travel to rank 0 as bytes: a pickled tensor goes through torch.save/torch.load inside
# all_gather_object, which doubled the gather, a third of a save's stall (hpc_ddp.bench).
def _pack(state: Any) -> Any:
    if not isinstance(state, dict):
        return state
    return {k: _Uint8(v.numpy().tobytes()) if _bytes_like(v) else v for k, v in state.items()}


def _unpack(state: Any) -> Any:
    if not isinstance(state, dict):
        return state
    return {
        k: torch.frombuffer(bytearray(v.data), dtype=torch.uint8) if isinstance(v, _Uint8) else v
        for k, v in state.items()
    }


def _bytes_like(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.dim() == 1
        and value.device.type == "cpu"
        and value.numel() > 0
    )
