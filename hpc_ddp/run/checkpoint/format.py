"""The checkpoint format interface: how a checkpoint's parts become bytes on disk and come back.

A format decides the bytes; everything around them is shared: the names and `latest` (store), where they are
written (storage: every byte goes through the run's `Storage`), the background write and its retries (writer),
which parts there are (part), when to save and what a resume must match (hpc_ddp.run.checkpoint.checkpointer,
hpc_ddp.run.checkpoint.resume). Two formats: "full" (one file rank 0 writes, hpc_ddp.run.checkpoint.full) and "sharded"
(every rank writes its shards into `ckpt-<step>/`, hpc_ddp.run.checkpoint.sharded), listed in
hpc_ddp.registry (entry point group `hpc_ddp.checkpoint_formats`); another is one more class beside them, or
a plugin's in an installed package (docs/plugins.md).

A format owns its files, from the save to the last reader: staging a save, telling its checkpoints apart
(`owns`), verifying and opening one, whether another world size loads it (`reshards`, declared), and the
model out of one (`export`: `model.pth` and `python -m hpc_ddp.checkpoint export`; `load_model`), and what
it holds (`contents`: the resume check's fingerprints). Nothing outside this package asks a checkpoint's shape
(a file, a folder) or a format's name: it asks `formats.format_of(path, storage)`.

Every format follows the store's rule: it writes under a temporary name, renames into the final one once the
checkpoint is whole and durable, and only then promotes it (`store.promote`: `latest`, rotation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.run.checkpoint.part import Part
from hpc_ddp.run.checkpoint.storage import Storage
from hpc_ddp.run.checkpoint.writer import Job


class Opened(Protocol):
    """A checkpoint read back: what it was written with, and each part's state."""

    meta: Mapping[str, Any]  # world_size, config (TrainConfig.as_dict()), version

    def state_of(self, part: Part, rank: int) -> Any:
        """The state `part` loads on `rank` (its own copy for a PER_RANK part), None if the checkpoint has none."""
        ...


class Format(ABC):
    """How the checkpoints of one run are written (an instance: `folder`, `env`, `keep`) and read (class
    methods: resuming looks at a checkpoint before any run is set up)."""

    name: ClassVar[str]  # what --checkpoint-format calls it (a plugin's: its entry point's name)
    # What the config checks ask before any run (hpc_ddp.registry.trait; the built-ins' values are also in
    # registry.BUILTIN_TRAITS, so that the submitters need no torch):
    shards: ClassVar[bool] = (
        False  # every rank writes its own shards (needs a strategy that shards its state)
    )
    reshards: ClassVar[bool] = False  # a checkpoint of N ranks loads on M (--allow-resize, --min-nodes)

    @classmethod
    def for_run(cls, cfg: Any, folder: Path, env: DistEnv, storage: Storage) -> Format:
        """This format for a run with options `cfg`, writing into `storage` (a format with options of its own
        overrides it: the sharded one's --async-save)."""
        return cls(folder, env, cfg.keep, storage)

    def __init__(self, folder: Path, env: DistEnv, keep: int, storage: Storage) -> None:
        self.folder, self.env, self.keep = Path(folder), env, keep
        self.storage = storage  # where every byte of this run's checkpoints is written
        # `stage` calls this on a rank once the collective part of a save is over and the rank's own work (a
        # state_dict, the copy to CPU, the wait for the previous write) begins: the hang watchdog gives that
        # work the long limit, and the collective part the steady one (run/watch/beacon.py).
        self.on_own_work: Callable[[], None] = lambda: None

    def close(self) -> None:
        """Release what the format holds beyond its writes (staging buffers, a saving process): after the final
        save, and when the run closes (again: it must be idempotent)."""
        return None

    @classmethod
    @abstractmethod
    def owns(cls, path: Path, storage: Storage) -> bool:
        """`path` (a complete checkpoint by the store's naming rule, or any path --resume names) in `storage` is
        one of this format's."""

    @abstractmethod
    def stage(self, parts: Sequence[Part], meta: Mapping[str, Any], step: int) -> Job | None:
        """A collective, on the training thread (what a save stalls the loop for): take a snapshot of `parts`
        and return the job that makes checkpoint `step` durable and promotes it, run on this rank's background
        writer; None on a rank that writes nothing."""

    @classmethod
    @abstractmethod
    def open(cls, path: Path, storage: Storage, verify: bool = True) -> Opened:
        """Read checkpoint `path` from `storage` on this rank (`verify`: check its checksums first).
        CheckpointCorrupt for damaged bytes, CheckpointRefused for an intact file a weights_only load refuses,
        CheckpointError for anything else that is no usable checkpoint."""

    @classmethod
    def verify(cls, path: Path, storage: Storage) -> None:
        """Raise what `open` would (rank 0 checks a checkpoint before every rank loads it)."""
        cls.open(path, storage, verify=True)

    @classmethod
    @abstractmethod
    def export(cls, path: Path, out: Path, storage: Storage, verify: bool = True) -> int:
        """Write the model of checkpoint `path` as the bare model's plain state dict into file `out` (loadable
        with torch.load(weights_only=True)), its checksum beside it, both through `storage`, in this one process;
        returns its size (`model.pth` of a run whose state is sharded, `python -m hpc_ddp.checkpoint export`)."""

    @classmethod
    @abstractmethod
    def load_model(cls, path: Path, model: Any, storage: Storage, verify: bool = True) -> None:
        """Read the model of checkpoint `path` into the plain `model` (torch.nn.Module), in place, in this one
        process (hpc_ddp.checkpoint.load_model). CheckpointError if it is for another model."""

    @classmethod
    @abstractmethod
    def contents(cls, path: Path, storage: Storage) -> dict[str, Any]:
        """Everything checkpoint `path` holds, unverified, as data: prefix -> a nested state (the full format's
        one file under ""; the sharded format's rank files under "rank<n>.", its shards under "shards."). The
        resume check fingerprints it value by value (hpc_ddp.doctor.resume)."""

    @classmethod
    @abstractmethod
    def world_size_change(cls, saved: int | None, now: int) -> str | None:
        """Why a checkpoint written by `saved` ranks cannot be loaded by `now` ranks (shown in the refusal,
        with both sizes), or None when it can."""
