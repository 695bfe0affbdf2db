"""The "sharded" format: `checkpoints/ckpt-<step>/`, a folder every rank writes its own shards into (DCP).

    ckpt-00000120/
        __0_0.distcp, __1_0.distcp, ...   each rank's tensors (Distributed Checkpoint, one file or more a rank)
        .metadata                         DCP's index of them, written by rank 0 once every rank's are written
        rank-00000.pt, rank-00001.pt      each rank's parts that are not sharded tensors (a torch file)
        hpc_ddp-manifest.json             rank 0, last: the SHA-256 of every file above, and what it was
                                          written with (world_size, config, version)

A SHARDED part's tensors go to DCP and the rest of its state (an optimizer's param_groups, numbers) to the
rank file, so nothing DCP would unpickle with `weights_only=False` is ever written; DCP's `.metadata` is read
with an unpickler that takes only DCP's own index classes (`safe_metadata`). Every other part goes whole into
each rank's file: a REPLICATED part is loaded from rank 0's, a PER_RANK part from the loading rank's own.

Saving: `stage` (training thread, the loop's stall) takes each part's state and copies the tensors to CPU
(DCP's DefaultStager); the job (each rank's background writer) writes them with `dcp.save` over a gloo group
of its own, created once at start by every rank, so that the writers' collectives never mix with the training
thread's. The job's collectives are made so that every rank reaches the same verdict: the rank files and the
finite check are agreed on before DCP writes, and DCP reports a failure to every rank; an OSError anywhere is
an OSError everywhere, so all ranks retry together (writer.py's rules). After the write every rank checksums
its own files and all-gathers the sums; rank 0 writes the manifest, renames `.ckpt-<step>.tmp-sharded-<n>/` (n:
the save's number, the same on every rank, so that no two saves ever share a folder) to `ckpt-<step>/` (so a
listed checkpoint is a complete one, as for every format; `store.install`: never onto an existing folder) and
promotes it (`latest`, rotation). A rank killed mid-save leaves only the temporary folder: the newest complete checkpoint stands.

Loading needs no rank to hold the whole model: each rank reads the shards it needs for its own layout, which
is also how a checkpoint of N ranks loads on M (`reshards`: with --allow-resize).

DCP and DTensor are imported where they are used: every run imports this module to tell formats apart, and
they cost about 2 s of start-up on every rank (sympy comes with them).
"""

from __future__ import annotations

import errno
import fnmatch
import io
import json
import pickle
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import CheckpointCorrupt, CheckpointError, CheckpointRefused, NonFinite
from hpc_ddp.run import memory
from hpc_ddp.run.checkpoint import content, dcpwrite, store, streamed, torchfile
from hpc_ddp.run.checkpoint.format import Format
from hpc_ddp.run.checkpoint.part import PER_RANK, SHARDED, Part
from hpc_ddp.run.checkpoint.storage import Storage
from hpc_ddp.run.checkpoint.writer import Job

MANIFEST = store.MANIFEST
METADATA = ".metadata"
TEMP_SUFFIX = ".tmp-sharded"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ----- a state split into DCP's tensors and the rest ---------------------------------------------------------
def split(state: Any) -> tuple[Any, Any]:
    """(the tensors of `state`, nested as in it; everything else). Dicts are walked; a tensor is DCP's; any
    other value (a list, a number) goes whole to the rest."""
    if isinstance(state, torch.Tensor):
        return state, None
    if not isinstance(state, dict):
        return None, state
    tensors, rest = {}, {}
    for key, value in state.items():
        t, r = split(value)
        if t is not None:
            tensors[key] = t
        if r is not None or t is None:
            rest[key] = r
    return (tensors or None), rest


def merge(tensors: Any, rest: Any) -> Any:
    """`split`'s inverse."""
    if not isinstance(tensors, dict):
        return tensors if tensors is not None else rest
    out = dict(rest or {})
    for key, value in tensors.items():
        out[key] = merge(value, out.get(key))
    return out


def _local(state: Any) -> Any:
    """This rank's shards as plain tensors (checks on the writer thread must not run DTensor collectives)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    return state


# ----- reading -----------------------------------------------------------------------------------------------
class _Unpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: only its own index classes (and torch's dtypes and sizes) may be in it."""

    ALLOWED = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
    PLAIN = {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("torch.serialization", "_get_layout"),  # a layout by its name
        ("pathlib", "PosixPath"),  # DCP's storage metadata names the folder it was written to
        ("pathlib._local", "PosixPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module.startswith(self.ALLOWED) or (module, name) in self.PLAIN or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def safe_metadata(path: Path, storage: Storage) -> None:
    """CheckpointRefused unless `path/.metadata` holds only DCP's index (DCP itself unpickles it freely)."""
    try:
        _Unpickler(io.BytesIO(storage.read_bytes(str(path / METADATA)))).load()
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(
            f"checkpoint {path}: its {METADATA} holds {e}, which only DCP's index classes may be: it could run "
            "code when loaded, so it is not loaded. Fix: --resume PATH of a checkpoint written by this kit"
        ) from e
    except OSError as e:
        raise CheckpointCorrupt(f"checkpoint {path} cannot be read ({e.strerror or e})") from e


class _Lazy:
    """A SHARDED part's tensors, read by `fill(template)` into this rank's layout (a collective: every rank
    loads at the same time); the rest of its state merged back."""

    def __init__(self, path: Path, key: str, rest: Any, storage: Storage) -> None:
        self.path, self.key, self.rest, self.storage = path, key, rest, storage

    def fill(self, template: Any) -> Any:
        tensors, _ = split(template)
        if tensors is None:  # no tensor in this part's state (SGD without momentum): all of it is in `rest`
            return self.rest
        import torch.distributed.checkpoint as dcp

        box = {self.key: tensors}
        dcp.load(box, storage_reader=dcpwrite.storage_reader(self.storage, str(self.path)))
        return merge(box[self.key], self.rest)


class Opened:
    def __init__(self, path: Path, manifest: Mapping[str, Any], verify: bool, storage: Storage) -> None:
        self.path, self.meta, self.verify, self.storage = path, manifest["meta"], verify, storage
        self._files: dict[int, Any] = {}

    def _rank(self, rank: int) -> Any:
        if rank not in self._files:
            self._files[rank] = torchfile.load_file(self.path / rank_file(rank), self.storage, verify=False)
        return self._files[rank]

    def state_of(self, part: Part, rank: int) -> Any:
        saved = int(self.meta.get("world_size") or 0)
        if part.kind == PER_RANK:
            return self._rank(rank).get(part.key) if rank < saved else None  # a new rank: none of its own
        entry = self._rank(0).get(part.key)
        if part.kind == SHARDED:
            return _Lazy(self.path, part.key, entry, self.storage)
        return entry


def read_manifest(path: Path, verify: bool, storage: Storage) -> dict[str, Any]:
    """The manifest, after checking every file it names (`verify`); CheckpointCorrupt for a torn or damaged
    checkpoint."""
    try:
        manifest = json.loads(storage.read_bytes(str(path / MANIFEST)).decode("utf-8"))
        files: dict[str, str] = manifest["files"]
        manifest["meta"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(
            f"checkpoint {path} cannot be loaded safely: it is torn (no readable {MANIFEST}: {e})"
        ) from e
    if verify:
        for name, expected in sorted(files.items()):
            try:
                actual = storage.sha256(str(path / name))
            except OSError as e:
                raise CheckpointCorrupt(
                    f"checkpoint {path} cannot be loaded safely: its shard {name} cannot be read "
                    f"({e.strerror or e})"
                ) from e
            if actual != expected:
                raise CheckpointCorrupt(
                    f"checkpoint {path} cannot be loaded safely: its shard {name} is corrupt (SHA-256 "
                    f"{actual[:16]}..., the manifest recorded {expected[:16]}... when it was written)"
                )
        safe_metadata(path, storage)
    return manifest


# ----- the format --------------------------------------------------------------------------------------------
class Sharded(Format):
    name = "sharded"
    shards = True
    reshards = True  # a checkpoint of N ranks loads on M (--allow-resize)

    @classmethod
    def for_run(cls, cfg: Any, folder: Path, env: DistEnv, storage: Storage) -> Format:
        return cls(folder, env, cfg.keep, cfg.async_save_kind(), storage)

    def __init__(self, folder: Path, env: Any, keep: int, async_save: str, storage: Storage) -> None:
        super().__init__(folder, env, keep, storage)
        # The background writers' own group: created once, by every rank in the same order (a collective).
        self.group = dist.new_group(backend="gloo")
        # Saves staged so far: every rank stages the same ones, in the same order, so every rank names the same
        # temporary folder for a save, and no two saves share one (a save of a step already saved, a finished
        # run's final one, writes beside the first until it replaces it).
        self.staged = 0
        self.write = dcpwrite.writer(async_save, env, self.group, storage)  # a collective with `process`
        self.staging = dcpwrite.Staging(shared=async_save == "process")

    def close(self) -> None:
        self.staging.release()
        memory.trim()  # the staging copy's pages back to the system, not kept in malloc's heaps (run/memory.py)
        self.write.close()

    @classmethod
    def owns(cls, path: Path, storage: Storage) -> bool:
        """A folder with a manifest, DCP's index or a shard: a sharded checkpoint (torn if the manifest is
        missing); any other folder is no checkpoint this kit reads."""
        if not storage.isdir(str(path)):
            return False
        names = storage.listdir(str(path))
        return any(n in names for n in (MANIFEST, METADATA, rank_file(0))) or any(
            n.endswith(".distcp") for n in names
        )

    def stage(self, parts: Sequence[Part], meta: Mapping[str, Any], step: int) -> Job | None:
        tensors: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        checks = []
        for part in parts:
            state = part.state_dict()
            if part.kind == SHARDED:
                tensors[part.key], rest[part.key] = split(state)
            else:
                rest[part.key] = state
            checks.append((part.check, part.key))
        self.on_own_work()
        # A CPU copy of this rank's shards (DTensors stay DTensors): training may change its own at once.
        generation, staged = self.staging.stage({k: v for k, v in tensors.items() if v is not None})
        extras = content.to_cpu(rest, "the checkpoint state")
        self.staged += 1
        return _Write(self, staged, generation, extras, checks, dict(meta), step)

    @classmethod
    def open(cls, path: Path, storage: Storage, verify: bool = True) -> Opened:
        return Opened(path, read_manifest(path, verify, storage), verify, storage)

    @classmethod
    def export(cls, path: Path, out: Path, storage: Storage, verify: bool = True) -> int:
        return export(path, out, storage, verify)

    @classmethod
    def load_model(cls, path: Path, model: Any, storage: Storage, verify: bool = True) -> None:
        load_model(path, model, storage, verify)

    @classmethod
    def contents(cls, path: Path, storage: Storage) -> dict[str, Any]:
        ranks = sorted(n for n in storage.listdir(str(path)) if fnmatch.fnmatchcase(n, "rank-*.pt"))
        found = {f"rank{int(n[5:-3])}.": torchfile.load_file(path / n, storage, verify=False) for n in ranks}
        return {**found, "shards.": _shards(path, storage)}

    @classmethod
    def world_size_change(cls, saved: int | None, now: int) -> str | None:
        return None if saved == now else f"world size {saved} (now {now})"


class _Write:
    """One sharded checkpoint's write, on every rank's background writer, run again after a failure until it
    succeeds (writer.py's retries): every rank's file and shards, their checksums agreed on, then rank 0's
    manifest, the rename to `ckpt-<step>/` and the promotion. Its collectives (over the writers' own group) are
    made so that every rank reaches the same verdict (see the module docstring)."""

    def __init__(
        self,
        fmt: Sharded,
        staged: dict[str, Any],
        generation: int,
        extras: Any,
        checks: list[Any],
        meta: dict[str, Any],
        step: int,
    ) -> None:
        self.fmt, self.staged, self.generation, self.extras, self.checks = (
            fmt,
            staged,
            generation,
            extras,
            checks,
        )
        self.meta, self.step, self.rank, self.storage = meta, step, fmt.env.rank, fmt.storage
        self.directory = store.ckpt_dir(fmt.folder)
        self.final = self.directory / store.ckpt_name(step, suffix="")
        self.temp = self.directory / f".{self.final.name}{TEMP_SUFFIX}-{fmt.staged}"
        self.done: dict[str, Any] = {}  # what a retry on rank 0 need not do again

    def __call__(self) -> tuple[Path, int]:
        written = False
        try:
            result = self._write()
            written = True
            return result
        finally:  # the staging copy is free for the next save once this succeeded (else kept for a retry)
            self.fmt.staging.over(self.generation, written)

    def _write(self) -> tuple[Path, int]:
        temp, done = self.temp, self.done
        if "sums" not in done:
            self._verdict(self._agree(self._attempt(self._write_rank_file)))
            try:
                self.fmt.write.write(self.staged, temp)  # on this thread, or in this rank's saving process
            except BaseException as e:  # DCP tells every rank the same: an OSError on any is one on all
                cause = _oserror(e)
                if cause is None:
                    raise
                done.clear()
                raise OSError(cause.errno or errno.EIO, cause.strerror or str(cause), str(temp)) from e
            everyone = self._agree(self._attempt(self._checksum) or ("sums", done.get("mine")))
            self._verdict([r if r[0] != "sums" else None for r in everyone])
            done["sums"] = {name: sum_ for r in everyone for name, sum_ in r[1].items()}
        if self.rank != 0:
            return temp, 0
        return self._promote(done["sums"])

    def _agree(self, mine: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.fmt.env.world_size
        dist.all_gather_object(everyone, mine, group=self.fmt.group)
        return everyone

    def _verdict(self, everyone: list[Any]) -> None:
        """The same error on every rank, from what every rank reported (None: fine)."""
        for report in everyone:
            if report is not None and report[0] == "nonfinite":
                raise NonFinite(report[1])
        for report in everyone:
            if report is not None:
                self.done.clear()  # every rank starts the whole save again
                raise OSError(report[1], report[2], report[3])

    def _attempt(self, fn: Any) -> Any:
        try:
            fn()
        except NonFinite as e:
            return ("nonfinite", str(e))
        except OSError as e:
            return ("oserror", e.errno or errno.EIO, e.strerror or str(e), e.filename or str(self.temp))
        return None

    def _write_rank_file(self) -> None:
        local, extras = _local(self.staged), self.extras
        for check, key in self.checks:
            check(merge(local.get(key), extras.get(key)) if key in local else extras.get(key), self.step)
        self.storage.makedirs(str(self.temp))
        torchfile.atomic_save(extras, self.temp / rank_file(self.rank), self.storage)

    def _checksum(self) -> None:
        rank, temp = self.rank, self.temp
        names = [
            n for n in self.storage.listdir(str(temp)) if n.startswith(f"__{rank}_") or n == rank_file(rank)
        ]
        if rank == 0:
            names.append(METADATA)
        self.done["mine"] = {n: self.storage.sha256(str(temp / n)) for n in names}

    def _promote(self, sums: dict[str, str]) -> tuple[Path, int]:
        """Rank 0: the manifest last, the complete folder renamed into place, `latest` and rotation."""
        storage, temp, final, directory = self.storage, self.temp, self.final, self.directory
        if storage.isdir(str(temp)):
            storage.write_bytes(str(temp / MANIFEST), json.dumps({"files": sums, "meta": self.meta}).encode())
            store.install(temp, final, storage)  # the name is given to a complete checkpoint only
        store.promote(self.fmt.folder, final, self.fmt.keep, storage)
        # An older save that failed and was superseded by this one (writer.py) left its temporary folder.
        for old in storage.listdir(str(directory)):
            if not fnmatch.fnmatchcase(old, f".ckpt-*{TEMP_SUFFIX}-*"):
                continue
            if 0 <= store.ckpt_step(Path(old[1:].partition(TEMP_SUFFIX)[0])) < self.step:
                storage.remove(str(directory / old))
        return final, sum(storage.size(str(final / n)) for n in sums)


def _oserror(error: BaseException) -> OSError | None:
    """The OSError behind DCP's CheckpointException (any rank's), if there is one."""
    if isinstance(error, OSError):
        return error
    for failure in getattr(error, "failures", {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, OSError):
            return exc
    return None


def export(
    path: Path, out: Path, storage: Storage, verify: bool = True, batch_bytes: int = streamed.BATCH_BYTES
) -> int:
    """Write the model of sharded checkpoint `path` as a plain state dict (`model.pth`: loadable with
    torch.load(weights_only=True) into the bare model), with its checksum, in one process. Streaming: the file's
    tensors are read from the shards and written a batch of `batch_bytes` at a time (streamed.save), so no
    process holds the whole model. `verify`: check the checkpoint's checksums first. Returns the file's size
    (`out`, written through `storage` as the checkpoint is read from it)."""
    import torch.distributed.checkpoint as dcp

    read_manifest(path, verify, storage)
    metadata = dcpwrite.storage_reader(storage, str(path)).read_metadata()
    names, shapes = [], []
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(item, "size"):
            names.append(key[len("model.") :])
            shapes.append((item.size, item.properties.dtype))
    if not names:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    laters = streamed.placeholders(shapes)
    extras = torchfile.load_file(path / rank_file(0), storage, verify=False).get("model") or {}

    def fetch(batch: list[streamed.Later]) -> list[torch.Tensor]:
        wanted = {
            names[int(later.storage.key)]: torch.empty(later.shape, dtype=later.dtype) for later in batch
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                {"model": wanted}, storage_reader=dcpwrite.storage_reader(storage, str(path)), no_dist=True
            )
        return list(wanted.values())

    state = merge(dict(zip(names, laters, strict=True)), extras)
    return storage.write(str(out), lambda f: streamed.save(state, laters, fetch, f, batch_bytes))  # type: ignore[arg-type]


def load_model(path: Path, model: torch.nn.Module, storage: Storage, verify: bool = True) -> None:
    """Read the model of sharded checkpoint `path` straight into `model`'s own tensors (a plain model in one
    process, on any device): DCP copies each stored slice into place, so nothing but the model itself is held.
    `verify`: check the checkpoint's checksums first. CheckpointError if it is for another model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hpc_ddp.run.strategy.base import load_model_state

    read_manifest(path, verify, storage)
    tensors, _ = split(model.state_dict())
    extras = torchfile.load_file(path / rank_file(0), storage, verify=False).get("model") or {}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            reader = dcpwrite.storage_reader(storage, str(path))
            dcp.load({"model": tensors or {}}, storage_reader=reader, no_dist=True)
    except CheckpointException as e:  # a key or a shape the checkpoint does not have (a BaseException)
        raise CheckpointError(
            f"checkpoint {path} is for a different model: {str(e).strip().splitlines()[-1][:300].rstrip('.')}. "
            "Fix: build the model the run trained"
        ) from e
    load_model_state(model, merge(tensors, extras), path)  # the non-tensor state; tensors onto themselves


def _shards(path: Path, storage: Storage) -> dict[str, Any]:
    """Every tensor of sharded checkpoint `path` by DCP's key, whole, read in this one process (`contents`)."""
    import torch.distributed.checkpoint as dcp

    reader = dcpwrite.storage_reader(storage, str(path))
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in reader.read_metadata().state_dict_metadata.items()
        if hasattr(item, "size")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state
