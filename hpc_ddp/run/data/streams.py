"""Iterable (streaming) datasets across ranks and DataLoader workers: each reader its own part.

An `IterableDataset` is read by every rank, and inside each rank by every DataLoader worker: without care each
of them reads the whole stream and every sample is trained on ranks x workers times. A dataset learns where it
is with `reader()`: its index among all `ranks x workers` readers and their count. The kit exports `RANK` and
`WORLD_SIZE` (what torchrun sets) before the loader starts its workers, so this works in the main process and in
every worker; `torch.utils.data.get_worker_info()` gives the worker.

    class Lines(torch.utils.data.IterableDataset):
        def __iter__(self):
            index, count = hpc_ddp.run.data.streams.reader()
            for i, line in enumerate(open(self.path)):
                if i % count == index:          # or: yield from streams.take(self.lines(), index, count)
                    yield encode(line)

Streams of different lengths: ranks whose parts end at different steps stop the epoch together at the same
step (the loop agrees on it in its per-step all-reduce), so no rank waits in a collective for a peer that left.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def reader(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(index, count) of this reader among all ranks x DataLoader workers (rank-major)."""
    env = os.environ if environ is None else environ
    rank, world = int(env.get("RANK") or 0), int(env.get("WORLD_SIZE") or 1)
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * workers + worker, world * workers


def take(items: Iterable[T], index: int, count: int) -> Iterator[T]:
    """Every `count`-th item of `items`, from `index`: reader `index`'s part of a stream."""
    return itertools.islice(items, index, None, count)
