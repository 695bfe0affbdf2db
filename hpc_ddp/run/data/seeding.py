"""The data's randomness, reproducible after a resume: each batch's generators are seeded from where it is.

A dataset that draws random numbers while it makes samples (augmentation in `__getitem__`, masking in a
`collate_fn`, a stream that shuffles a buffer in `__iter__`) draws from the generators of the process that makes
the batch. In a DataLoader worker those are seeded once, when the worker starts (`base_seed + worker id`), and
then run on: with persistent workers across epochs, and a resumed run's new workers start from the seed again,
so the batches after a resume differ from the uninterrupted run's. Saving every worker's generators would not
help either: workers read ahead, so their state at the step boundary is not what the next batch needs.

So here nothing is saved and nothing is read ahead of: before each batch, the process that makes it seeds
torch's CPU generator, Python's `random` and NumPy's global one (when NumPy is loaded) from
`derive(--seed, kind, key, position)`, a pure function of where that batch is. Every run, resumed or not, with
any number of workers, any prefetch, gives a batch the same draws.

    SeededBatches   a map-style dataset read by workers: its sampler yields (key, index) pairs (the training
                    loader's key is the epoch, the evaluation's the step); a batch is seeded from its key and its
                    first index (unique within an epoch: DistributedSampler gives each index once). The user's
                    `set_epoch(epoch)`, if any, is also called in the worker's own copy when a new epoch's first
                    batch comes: persistent workers hold a copy the loop's call never reaches.
    SeededStream    an IterableDataset: before each batch of `batch_size` items, seeded from its key (the epoch,
                    or the evaluation's step), its reader (rank x workers, hpc_ddp.run.data.streams.reader) and the
                    batch's number in the epoch. That number is part of its state: `StatefulSeededStream` adds it
                    to the dataset's own `state_dict()`, so a stream resumed mid-epoch goes on seeding where it was.

Generators a dataset creates itself (`np.random.default_rng()` in `__init__`) are the dataset's to seed: they
are copied into each worker as they are and not reseeded here. CUDA generators are never touched (data is made
on the CPU). Without workers a map-style dataset is read lazily in the rank's own process, from the training's
generators, which every checkpoint saves: it needs none of this (hpc_ddp.run.data.feed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hpc_ddp.run.data import streams
from hpc_ddp.run.loop import rng

TRAIN, EVAL = "train", "eval"
_STATE = "hpc_ddp.seeding"  # the key of a SeededStream's own entries in the state it saves


def derive(seed: int, *key: int | str) -> int:
    """A 64-bit seed for `key` under `seed` (pure, the same in every process and Python version)."""
    digest = hashlib.blake2b(repr((int(seed), *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SeededBatches(Dataset[Any]):
    """`dataset` read through keyed indices: `(key, index)` pairs from the sampler (see the module docstring)."""

    def __init__(self, dataset: Any, seed: int, kind: str) -> None:
        self.dataset, self.seed, self.kind = dataset, seed, kind
        self._epoch: int | None = None  # the epoch this copy last saw (a worker's copy: set_epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        key, first = keys[0]
        if self.kind == TRAIN and key != self._epoch:
            self._epoch = key
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch) and get_worker_info() is not None:
                set_epoch(key)  # the worker's copy (the rank's own was called by the loop)
        rng.seed_cpu(derive(self.seed, self.kind, key, first))
        indices = [index for _, index in keys]
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if callable(getitems) else [self.dataset[i] for i in indices]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]


class SeededStream(IterableDataset[Any]):
    """`dataset` (a stream) seeded before each batch of `batch_size` items (see the module docstring). `key`
    is set before each epoch's (or evaluation's) iterator is made, `batches` to 0 with it."""

    def __init__(self, dataset: Any, seed: int, kind: str, batch_size: int) -> None:
        self.dataset, self.seed, self.kind, self.batch_size = dataset, seed, kind, batch_size
        self.key = 0
        self.items = 0  # items yielded in this epoch (the batch number is items // batch_size)

    def start(self, key: int) -> None:
        """A new epoch (or evaluation) `key`, from its first batch."""
        self.key, self.items = key, 0

    def __iter__(self) -> Iterator[Any]:
        reader, _ = streams.reader()
        items: Iterator[Any] | None = None
        while True:
            if self.items % self.batch_size == 0:  # a batch begins: seeded before any of its draws
                rng.seed_cpu(derive(self.seed, self.kind, self.key, reader, self.items // self.batch_size))
            if items is None:
                items = iter(self.dataset)  # its own __iter__ may draw (a shuffle): after the first seed
            try:
                item = next(items)
            except StopIteration:
                return
            self.items += 1
            yield item


class StatefulSeededStream(SeededStream):
    """A SeededStream over a stream with `state_dict()`/`load_state_dict()`: its state is the dataset's plus
    the items of the epoch so far. A state without that entry (a checkpoint of an earlier version) loads as the
    dataset's own, its batches numbered from the epoch's first again."""

    def state_dict(self) -> dict[str, Any]:
        return {_STATE: {"key": self.key, "items": self.items}, "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, dict) and set(state) == {_STATE, "dataset"}:
            self.key, self.items = int(state[_STATE]["key"]), int(state[_STATE]["items"])
            state = state["dataset"]
        self.dataset.load_state_dict(state)
