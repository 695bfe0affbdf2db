"""The sharded format's pure parts: a state split into DCP's tensors and the rest, and the refusal of a DCP
index that would run code when loaded (DCP unpickles `.metadata` freely)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from hpc_ddp.errors import CheckpointCorrupt, CheckpointRefused
from hpc_ddp.run.checkpoint import sharded
from hpc_ddp.run.checkpoint.storage import Local


def test_split_puts_tensors_in_dcp_and_the_rest_in_the_rank_file_and_merge_undoes_it() -> None:
    state = {
        "state": {"w": {"momentum_buffer": torch.ones(2), "step": torch.tensor(3.0)}, "b": {}},
        "param_groups": [{"lr": 0.1, "params": ["w", "b"]}],
        "n": 5,
    }
    tensors, rest = sharded.split(state)
    assert set(tensors) == {"state"} and set(tensors["state"]) == {"w"}
    assert rest["param_groups"] == state["param_groups"] and rest["n"] == 5
    assert "momentum_buffer" not in rest["state"]["w"]  # no tensor goes to the rank file
    merged = sharded.merge(tensors, rest)
    assert merged["param_groups"] == state["param_groups"] and merged["state"]["b"] == {}
    assert torch.equal(merged["state"]["w"]["momentum_buffer"], torch.ones(2))


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("true",))


def test_a_dcp_index_that_would_run_code_is_refused_and_a_missing_manifest_is_torn(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": _Evil()}))
    (tmp_path / sharded.MANIFEST).write_text(json.dumps({"files": {}, "meta": {"world_size": 2}}))
    with pytest.raises(CheckpointRefused, match=r"holds posix.system|holds os.system"):
        sharded.read_manifest(tmp_path, verify=True, storage=Local())
    (tmp_path / sharded.MANIFEST).unlink()
    with pytest.raises(CheckpointCorrupt, match="it is torn"):
        sharded.read_manifest(tmp_path, verify=True, storage=Local())


def test_a_part_without_tensors_loads_from_the_rank_file_alone(tmp_path: Path) -> None:
    """SGD without momentum has no tensor in its state: nothing of it is in DCP (a load once asked DCP for it:
    'Missing key in checkpoint state_dict: optimizer')."""
    rest = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    assert sharded.split(rest) == (None, rest)
    assert sharded._Lazy(tmp_path, "optimizer", rest, Local()).fill({"state": {}, "param_groups": []}) == rest


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "fsdp", "amp": "fp16"}, "--amp fp16 with --strategy fsdp"),
        ({"checkpoint_format": "sharded"}, "--checkpoint-format sharded needs --strategy fsdp"),
        ({"reshard_after_forward": "false"}, "--reshard-after-forward false applies to --strategy fsdp only"),
        ({"strategy": "zero"}, "--strategy zero: choose one of ddp, fsdp"),
    ],
)
def test_fsdp_options_that_cannot_work_are_usage_errors(options: dict, message: str) -> None:
    from hpc_ddp.errors import UsageError
    from hpc_ddp.run.config import TrainConfig

    with pytest.raises(UsageError, match=message):
        TrainConfig(**options)


def test_the_checkpoint_format_follows_the_strategy_unless_named() -> None:
    from hpc_ddp.run.config import TrainConfig

    assert TrainConfig().format_name() == "full"
    assert TrainConfig(strategy="fsdp").format_name() == "sharded"
    assert TrainConfig(strategy="fsdp", checkpoint_format="full").format_name() == "full"
    assert TrainConfig(strategy="fsdp").to_argv() == ["--strategy=fsdp"]  # what submitters pass each task


def test_a_sharded_checkpoints_contents_are_its_rank_files_and_shards_read_through_its_format(
    tmp_path: Path,
) -> None:
    """What the resume check fingerprints (Format.contents): each rank file under "rank<n>.", every DCP tensor
    whole under "shards.", found by the format that owns the folder, never by asking whether it is one."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from hpc_ddp.run.checkpoint import formats, torchfile

    w = torch.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": w}}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    for rank in (0, 1):
        torchfile.atomic_save({"rng": {"n": rank}}, tmp_path / sharded.rank_file(rank), Local())
    fmt = formats.format_of(tmp_path, Local())
    assert fmt is sharded.Sharded
    contents = fmt.contents(tmp_path, Local())
    assert sorted(contents) == ["rank0.", "rank1.", "shards."]
    assert contents["rank1."] == {"rng": {"n": 1}} and torch.equal(contents["shards."]["model.w"], w)
