"""The checkpoint storage seam (hpc_ddp.run.checkpoint.storage): the store and the full format write and read
only through it. A storage that keeps everything in a dict, one class here, serves a whole save, promotion,
rotation and `latest` without a byte on disk; the local filesystem's does what the store did before."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from hpc_ddp.errors import CheckpointCorrupt
from hpc_ddp.run.checkpoint import formats, full, store
from hpc_ddp.run.checkpoint.durable import checksum_path
from hpc_ddp.run.checkpoint.storage import Local, Storage


class Memory(Storage):
    """Every file a bytes value, every directory implied by the names under it (an object store's model)."""

    dcp_layer = "none"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> int:
        out = io.BytesIO()
        fill(out)
        data = out.getvalue()
        self.files[path] = data
        self.files[str(checksum_path(Path(path)))] = f"{hashlib.sha256(data).hexdigest()}  x\n".encode()
        return len(data)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.files[path] = bytes(data)

    def makedirs(self, path: str) -> None:
        pass

    def install(self, temp: str, final: str) -> None:
        self.remove(final)
        for name in [n for n in self.files if n.startswith(temp + "/")]:
            self.files[final + name[len(temp) :]] = self.files.pop(name)

    def remove(self, path: str) -> None:
        for name in [n for n in self.files if n == path or n.startswith(path + "/")]:
            del self.files[name]
        self.files.pop(str(checksum_path(Path(path))), None)

    def rename(self, path: str, to: str) -> None:
        self.files[to] = self.files.pop(path)

    def isdir(self, path: str) -> bool:
        return any(n.startswith(path + "/") for n in self.files)

    def isfile(self, path: str) -> bool:
        return path in self.files

    def listdir(self, path: str) -> list[str]:
        return sorted({n[len(path) + 1 :].split("/")[0] for n in self.files if n.startswith(path + "/")})

    def read_bytes(self, path: str) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    def open(self, path: str) -> BinaryIO:
        return io.BytesIO(self.read_bytes(path))

    def size(self, path: str) -> int:
        return sum(len(v) for n, v in self.files.items() if n == path or n.startswith(path + "/"))

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()


def test_a_storage_of_its_own_takes_every_save_promotion_and_rotation(tmp_path: Path) -> None:
    """Nothing reaches the disk: the checkpoints, their checksums and `latest` are the storage's, and the store
    lists, rotates and reads them back through it."""
    mem = Memory()
    for step in (1, 2, 3):
        path, nbytes = full.commit(tmp_path, {"model": {"w": torch.full((3,), float(step))}}, step, 2, mem)
        assert nbytes == len(mem.files[str(path)])
    checkpoints = store.ckpt_dir(tmp_path)
    assert not checkpoints.exists()  # no byte on disk
    assert store.list_checkpoints(tmp_path, mem) == [
        checkpoints / "ckpt-00000003.pt",
        checkpoints / "ckpt-00000002.pt",
    ]
    assert store.read_latest(tmp_path, storage=mem) == checkpoints / "ckpt-00000003.pt"
    assert sorted(mem.files) == sorted(
        str(checkpoints / name)
        for name in (
            "ckpt-00000002.pt",
            "ckpt-00000002.pt.sha256",
            "ckpt-00000003.pt",
            "ckpt-00000003.pt.sha256",
            "latest",
        )
    )
    loaded = torch.load(io.BytesIO(mem.files[str(checkpoints / "ckpt-00000003.pt")]), weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.full((3,), 3.0))
    # Read back through the storage too: its checksum checked, the file loaded, all from memory (issue 43).
    opened = formats.open_checkpoint(checkpoints / "ckpt-00000003.pt", mem)
    assert torch.equal(opened.meta["model"]["w"], torch.full((3,), 3.0))
    mem.files[str(checkpoints / "ckpt-00000002.pt")] += b"!"  # a damaged file: its sum, read from memory
    with pytest.raises(CheckpointCorrupt, match="is corrupt"):
        formats.verify(checkpoints / "ckpt-00000002.pt", mem)
    assert store.newest_size(tmp_path, mem) == len(mem.files[str(checkpoints / "ckpt-00000003.pt")])


def test_the_store_moves_and_removes_temporaries_through_the_storage(tmp_path: Path) -> None:
    mem = Memory()
    checkpoints = store.ckpt_dir(tmp_path)
    mem.write_bytes(str(checkpoints / ".ckpt-00000004.pt.tmp-1-2"), b"torn")
    mem.write_bytes(str(checkpoints / ".ckpt-00000005.tmp-sharded-1" / "rank-00000.pt"), b"torn")
    assert store.remove_stale_temporaries(tmp_path, mem) == 2 and mem.files == {}
    full.commit(tmp_path, {"model": {}}, 7, 3, mem)
    aside = tmp_path / "aside"
    store.move(checkpoints / "ckpt-00000007.pt", aside, mem)
    assert sorted(mem.files) == [
        str(aside / "ckpt-00000007.pt"),
        str(aside / "ckpt-00000007.pt.sha256"),
        str(checkpoints / "latest"),
    ]


def test_the_local_storage_installs_over_a_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    """A step saved again with a later state replaces the first under its name, never a rename onto it."""
    final, temp = tmp_path / "ckpt-00000009", tmp_path / ".ckpt-00000009.tmp-sharded-2"
    for folder, text in ((final, b"first"), (temp, b"second")):
        folder.mkdir()
        (folder / "rank-00000.pt").write_bytes(text)
    LOCAL = Local()
    LOCAL.install(str(temp), str(final))
    assert (final / "rank-00000.pt").read_bytes() == b"second" and not temp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000009"]  # nothing left aside
    assert LOCAL.listdir(str(tmp_path / "missing")) == [] and LOCAL.size(str(final)) == len(b"second")
    LOCAL.remove(str(final))
    assert not final.exists()


def test_the_sharded_format_gets_dcps_writer_and_reader_for_the_storages_layer(tmp_path: Path) -> None:
    """The shards go through DCP's storage layer that the storage names (`dcp_layer`, dcpwrite.DCP_LAYERS):
    the local filesystem's is DCP's FileSystemWriter/Reader, at the path given."""
    import torch.distributed.checkpoint as dcp

    from hpc_ddp.run.checkpoint import dcpwrite

    writer = dcpwrite.storage_writer(Local(), str(tmp_path))
    reader = dcpwrite.storage_reader(Local(), str(tmp_path))
    assert isinstance(writer, dcp.FileSystemWriter) and isinstance(reader, dcp.FileSystemReader)
    assert Path(writer.path) == tmp_path and Path(reader.path) == tmp_path
    with pytest.raises(KeyError):
        dcpwrite.storage_writer(Memory(), str(tmp_path))  # a layer DCP has not been given a writer for
