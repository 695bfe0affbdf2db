"""The checkpoint seams: the store's naming rule (files and directories), the format interface (a new part
round-trips through the full format; a new world size is refused with both sizes), and the torch-free
`latest_step` the supervisors use."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import clean_environ

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.errors import CheckpointCorrupt, CheckpointError
from hpc_ddp.log import RankLog
from hpc_ddp.run.checkpoint import formats, full, store
from hpc_ddp.run.checkpoint.checkpointer import Checkpointer
from hpc_ddp.run.checkpoint.part import PER_RANK, REPLICATED, Loading, Part
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.watch.beacon import NullBeacon

# ----- the store: names, latest, rotation ------------------------------------------------------------------


def _file(folder: Path, step: int) -> Path:
    path = store.ckpt_dir(folder) / store.ckpt_name(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def _directory(folder: Path, step: int) -> Path:
    path = store.ckpt_dir(folder) / store.ckpt_name(step, suffix="")
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m")
    (path / "__0_0.distcp").write_bytes(b"shard")
    return path


def test_a_checkpoint_is_a_file_or_a_directory_by_its_name(tmp_path: Path) -> None:
    one, two = _file(tmp_path, 1), _directory(tmp_path, 2)
    directory = store.ckpt_dir(tmp_path)
    (directory / "ckpt-00000003.pt").mkdir()  # a .pt name that is a directory: no checkpoint
    (directory / "ckpt-00000004").write_bytes(b"x")  # a directory name that is a file: no checkpoint
    (directory / ".ckpt-00000005.tmp-1-2").mkdir()  # a format's temporary directory: never listed
    (directory / ".ckpt-00000006.pt.tmp-1-2").write_bytes(b"x")
    assert store.list_checkpoints(tmp_path, storage=Local()) == [two, one]
    assert [store.ckpt_step(p) for p in (one, two)] == [1, 2]
    assert store.latest_step(tmp_path, storage=Local()) == 2  # no `latest` yet: the newest listed
    store.point_latest(tmp_path, one, storage=Local())
    assert (
        store.read_latest(tmp_path, storage=Local()) == one
        and store.latest_step(tmp_path, storage=Local()) == 1
    )
    store.point_latest(tmp_path, two, storage=Local())
    assert store.read_latest(tmp_path, storage=Local()) == two
    assert store.remove_stale_temporaries(tmp_path, storage=Local()) == 2
    assert sorted(p.name for p in directory.iterdir()) == [
        "ckpt-00000001.pt",
        "ckpt-00000002",
        "ckpt-00000003.pt",
        "ckpt-00000004",
        "latest",
    ]


def test_promote_rotates_files_and_directories_alike_and_keeps_later_steps(tmp_path: Path) -> None:
    made = [_file(tmp_path, 1), _directory(tmp_path, 2), _file(tmp_path, 3), _directory(tmp_path, 9)]
    newest = _directory(tmp_path, 4)
    store.promote(tmp_path, newest, keep=2, storage=Local())
    # Step 9 is no part of this line (a later step): rotation never deletes it; of the rest, 4 and 3 stay.
    assert store.list_checkpoints(tmp_path, storage=Local()) == [made[3], newest, made[2]]
    assert not made[1].exists() and not made[0].exists()
    assert (
        store.read_latest(tmp_path, storage=Local()) == newest
        and store.latest_step(tmp_path, storage=Local()) == 4
    )


def test_latest_step_is_torch_free_for_supervisors(tmp_path: Path) -> None:
    """A supervisor (local launcher, Slurm batch step) asks for the latest checkpoint's step without torch."""
    _file(tmp_path, 7)
    store.point_latest(tmp_path, _directory(tmp_path, 12), storage=Local())
    code = (
        "import sys\n"
        "from hpc_ddp.run.checkpoint import store\n"
        f"print(store.of_run({str(tmp_path)!r}, 'local').latest_step(), "
        f"store.of_run({str(tmp_path / 'none')!r}, 'local').latest_step())\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=clean_environ(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["12 None", "[]"]


# ----- the format interface: parts round-trip, a new world size is refused ------------------------------------


class Counter(Part):
    """A part a later change could add (a scheduler, say): one small class and its key."""

    key, kind = "counter", REPLICATED

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return {"value": self.value, "history": torch.arange(self.value)}

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        self.value = state["value"]
        assert torch.equal(state["history"], torch.arange(self.value))


class Noise(Part):
    """Each rank's own state (like the RNG)."""

    key, kind = "noise", PER_RANK

    def __init__(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    def state_dict(self) -> Any:
        return {"generator": self.state, "note": "mine"}

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        self.state = state["generator"]


class Weights(Part):
    """Every checkpoint has a model (a torch file without one is no hpc_ddp checkpoint)."""

    key, kind = "model", REPLICATED

    def state_dict(self) -> Any:
        return {"w": torch.ones(2)}

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        assert torch.equal(state["w"], torch.ones(2))


class Where(Part):
    key, kind = "position", REPLICATED

    def __init__(self) -> None:
        self.pos = Position()

    def state_dict(self) -> Any:
        return {
            "epoch": self.pos.epoch,
            "batch": 0,
            "step": self.pos.step,
            "loss_sum": 0.0,
            "loss_count": 0.0,
        }

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        self.pos = Position(**state)


def _checkpointer(tmp_path: Path, env: dist_env.DistEnv, parts: list[Part]) -> tuple[Checkpointer, list]:
    records: list[tuple] = []
    cfg = TrainConfig(folder=str(tmp_path), keep=2)
    return (
        Checkpointer(
            cfg,
            env,
            tmp_path,
            parts,
            full.Full(tmp_path, env, cfg.keep, Local()),
            RankLog(0, io.StringIO()),
            lambda *record: records.append(record),
            NullBeacon(),
        ),
        records,
    )


def test_a_new_part_round_trips_through_the_full_format(tmp_path: Path) -> None:
    env = dist_env.detect({})
    with process_group(env, torch.device("cpu")):
        saved, records = _checkpointer(tmp_path, env, [Weights(), Counter(5), Noise(1), Where()])
        saved.save(Position(epoch=1, step=5), final=True)
        saved.close()
        path = store.read_latest(tmp_path, storage=Local())
        assert path is not None and path.name == "ckpt-00000005.pt"
        assert records == [(1, 5, records[0][2], records[0][3], True)]  # the "save" record, once durable
        # The file holds each part under its key, a PER_RANK part as every rank's list, and the meta.
        raw = full.load(path, storage=Local())
        assert raw["counter"]["value"] == 5 and [r["note"] for r in raw["noise"]] == ["mine"]
        assert raw["world_size"] == 1 and raw["config"]["keep"] == 2
        counter, noise = Counter(), Noise(2)
        loaded, _ = _checkpointer(tmp_path, env, [Weights(), counter, noise, Where()])
        assert loaded.load(path) == []
    assert counter.value == 5
    assert torch.equal(noise.state, torch.Generator().manual_seed(1).get_state())
    assert formats.format_of(path, storage=Local()) is full.Full


def test_the_full_format_refuses_a_new_world_size_naming_both(tmp_path: Path) -> None:
    assert full.Full.world_size_change(2, 2) is None
    assert full.Full.world_size_change(2, 3) == "world size 2 (now 3)"
    env = dist_env.detect({})
    with process_group(env, torch.device("cpu")):
        saved, _ = _checkpointer(tmp_path, env, [Weights(), Counter(3), Where()])
        saved.save(Position(step=3), final=True)
        saved.close()
        path = store.read_latest(tmp_path, storage=Local())
        assert path is not None
        state = dict(full.load(path, storage=Local()))
        state["world_size"] = 2  # as if written by 2 ranks; this run has 1
        counter = Counter()
        loading, _ = _checkpointer(tmp_path, env, [Weights(), counter, Where()])
        with pytest.raises(CheckpointError, match=r"written with world size 2 \(now 1\); an exact resume"):
            loading.restore(full.Loaded(state), path)
    assert counter.value == 0  # refused before any part was loaded


def test_a_directory_no_format_reads_is_refused_in_one_line(tmp_path: Path) -> None:
    # Issue 20: a folder of DCP shards is the sharded format's (torn here: no manifest); one that holds no
    # shard, no index and no manifest is still no checkpoint this kit reads.
    path = _directory(tmp_path, 2)
    with pytest.raises(CheckpointCorrupt, match="it is torn"):
        formats.verify(path, storage=Local())
    other = store.ckpt_dir(tmp_path) / store.ckpt_name(3, suffix="")
    other.mkdir()
    (other / "notes.txt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a directory that no checkpoint format of this kit reads"):
        formats.verify(other, storage=Local())
