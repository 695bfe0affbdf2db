"""The training loader's class: torch's DataLoader, or torchdata's StatefulDataLoader for a stream whose state
lives in DataLoader workers; its sampler (`SkipSampler`); the settings a user tunes (`loader_options`); and the
end of its workers (`shut_down`). Which loader a run builds, and when: hpc_ddp.run.data.feed.

A stream (an IterableDataset) with `state_dict()`/`load_state_dict()` read in the rank's own process (no
workers) is saved and resumed by the loop itself (hpc_ddp.run.checkpoint.parts.StreamPart). Read by workers, each worker
holds its own copy of the dataset, out of the loop's reach: torchdata's `StatefulDataLoader` (the optional
dependency `hpc_ddp[data]`, torchdata >= 0.11) collects every worker's state with the batches it yields, so its
`state_dict()` is the exact position of every worker, prefetched batches excluded, and `load_state_dict()` puts
every worker back there. Checked with torch 2.13: mid-epoch resumes with 2 workers are bitwise exact
(tests/test_run_models.py). Without torchdata such a stream restarts its epoch on resume, and says so once.

Not with persistent workers: torchdata 0.11's state of a persistent worker that has not yet yielded a batch in
the current epoch is its state at the end of the previous epoch (a worker's state is taken with each batch it
yields), so a checkpoint early in any epoch after the first resumed that worker as finished, and the epoch
ended early (the same defect as huggingface/datasets#7447, "Epochs shortened after resuming mid-epoch with
Iterable dataset+StatefulDataloader(persistent_workers=True)"). Fresh workers each epoch have no such stale
state (tests/test_run_loaders.py); the price is the workers' start at each epoch.

torchdata 0.11 calls `torch.set_vital`, which torch 2.13 deprecates with a UserWarning at every new iterator:
that one warning is filtered (it says nothing about the user's run).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler, Sampler

from hpc_ddp.run.data.options import DataOptions
from hpc_ddp.run.data.workers import init as worker_start


def loader_options(cfg: DataOptions, device: Any, workers: int) -> dict[str, Any]:
    """The DataLoader settings a user tunes, for the training and the evaluation loaders: --num-workers,
    --pin-memory (auto: on a GPU), --prefetch-factor (with workers only: torch refuses it without)."""
    pin = cfg.pin_memory == "on" or (cfg.pin_memory == "auto" and device.type == "cuda")
    options: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": pin,
        "worker_init_fn": worker_start if workers else None,
        # Workers start once, not at every epoch: a start that opens shards or sockets is paid once.
        "persistent_workers": workers > 0,
    }
    if workers and cfg.prefetch_factor:
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


def stateful_loader() -> Any | None:
    """torchdata's StatefulDataLoader class, or None when torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
    return StatefulDataLoader


def has_state(dataset: Any) -> bool:
    """A dataset that can say where it is and go back there."""
    return all(callable(getattr(dataset, m, None)) for m in ("state_dict", "load_state_dict"))


def stateful_options(options: dict[str, Any]) -> dict[str, Any]:
    """The loader options for a StatefulDataLoader: the same, without persistent workers (see above)."""
    return {**options, "persistent_workers": False}


BY_LOADER = "StatefulDataLoader"  # the checkpoint's stream entry holds the loader's state under this key


def wrap(state: Any) -> dict[str, Any]:
    """A StatefulDataLoader's state as the checkpoint's `stream` entry holds it: marked, so that a resume with
    another --num-workers (0: the dataset's own state) tells the two apart."""
    return {BY_LOADER: state}


def saved_by_loader(state: Any) -> bool:
    return isinstance(state, dict) and set(state) == {BY_LOADER}


def unwrap(state: dict[str, Any]) -> Any:
    return state[BY_LOADER]


class SkipSampler(Sampler[Any]):
    """The epoch's DistributedSampler order, minus the samples a resumed run already trained on (`skip`).
    `keyed`: each index comes as (epoch, index), for a dataset read by workers (hpc_ddp.run.data.seeding)."""

    def __init__(self, base: DistributedSampler[Any], keyed: bool = False) -> None:
        self.base, self.keyed = base, keyed
        self.skip = 0
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        indices = itertools.islice(iter(self.base), self.skip, None)
        return ((self.epoch, i) for i in indices) if self.keyed else indices

    def __len__(self) -> int:
        return len(self.base) - self.skip


class Keyed(Sampler[Any]):
    """0 .. size-1 in order, each as (key, index): an evaluation shard read by workers (hpc_ddp.run.data.seeding)."""

    def __init__(self, size: int) -> None:
        self.size, self.key = size, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.key, i) for i in range(self.size))

    def __len__(self) -> int:
        return self.size


def shut_down(loader: Any) -> None:
    """End `loader`'s DataLoader workers now, and wait for them (milliseconds): a loader with persistent
    workers keeps its iterator, and when that iterator is freed by the garbage collector (it lives in a
    reference cycle) its queues are finalized before its own `__del__` asks the workers to end, so they never
    hear it, and the join waits 5 s per worker, then 5 s more after a SIGTERM they ignore (hpc_ddp.run.data.workers).
    That was 20 to 25 s at the end of every run and every preemption stop with --num-workers 2. torch has no
    public call for this; Lightning does the same (`_shutdown_workers_and_reset_iterator`)."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    if iterator is not None:
        loader._iterator = None
