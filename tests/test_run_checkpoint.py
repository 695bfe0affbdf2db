"""Checkpoints: round trip, atomicity under SIGKILL, fallback from a corrupt latest, code-running pickles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import clean_environ, die_with_test
from torch.utils.data import DistributedSampler, TensorDataset

from hpc_ddp.errors import CheckpointError, UsageError
from hpc_ddp.run.checkpoint import formats, full, resume, store
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.checkpoint.writer import AsyncWriter
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.data.loaders import SkipSampler as _SkipSampler
from hpc_ddp.run.strategy.base import load_model_state


def sample_state(step: int) -> dict:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": None,
        "position": {"epoch": 1, "batch": 5, "step": step, "loss_sum": 1.5, "loss_count": 3.0},
        "rng": [{"cpu": torch.get_rng_state(), "python": [3, list(range(625)), None]}],
        "world_size": 1,
        "config": TrainConfig().as_dict(),
        "version": "test",
    }


def test_round_trip_keeps_model_optimizer_rng_and_position(tmp_path: Path) -> None:
    state = sample_state(7)
    path, nbytes = full.commit(tmp_path, state, step=7, keep=3, storage=Local())
    assert nbytes == path.stat().st_size
    assert store.read_latest(tmp_path, storage=Local()) == path
    loaded = full.load(path, storage=Local())  # weights_only=True
    assert loaded["position"] == state["position"]
    assert torch.equal(loaded["rng"][0]["cpu"], state["rng"][0]["cpu"])
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    momentum = loaded["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, state["optimizer"]["state"][0]["momentum_buffer"])


def test_keep_rotates_and_latest_points_at_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        full.commit(tmp_path, sample_state(step), step=step, keep=2, storage=Local())
    assert [p.name for p in store.list_checkpoints(tmp_path, storage=Local())] == [
        "ckpt-00000004.pt",
        "ckpt-00000003.pt",
    ]
    assert store.read_latest(tmp_path, storage=Local()).name == "ckpt-00000004.pt"


def test_corrupt_latest_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    full.commit(tmp_path, sample_state(1), step=1, keep=3, storage=Local())
    newest, _ = full.commit(tmp_path, sample_state(2), step=2, keep=3, storage=Local())
    newest.write_bytes(newest.read_bytes()[:100])  # torn by something outside our control
    warnings: list[str] = []
    found = formats.find_resumable(CheckpointStore(tmp_path, Local()), warnings.append)
    assert found is not None and found.name == "ckpt-00000001.pt"
    assert "ckpt-00000002.pt cannot be loaded safely" in warnings[0]


class _RunsCode:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": _RunsCode()}, evil)
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        full.load(evil, storage=Local())
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "pwned").exists()


_WRITER = """
import sys, torch
from hpc_ddp.run.checkpoint import full
from hpc_ddp.run.checkpoint.storage import Local
folder = sys.argv[1]
full.commit(folder, {"model": {"w": torch.ones(3)}}, step=1, keep=5, storage=Local())
print("first", flush=True)
big = {"model": {"w": torch.randn(64 * 1024 * 1024)}}  # 256 MB: the kill lands mid-write
for step in range(2, 100):
    full.commit(folder, big, step=step, keep=5, storage=Local())
"""


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        env=clean_environ(),
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_test,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
    directory = store.ckpt_dir(tmp_path)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".ckpt-") for p in directory.iterdir()):  # a write is in progress
        assert time.monotonic() < deadline, "the writer never started a big save"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(".tmp-" in p.name for p in directory.iterdir()), "the kill should land mid-write"
    listed = store.list_checkpoints(tmp_path, storage=Local())
    assert listed, "the first checkpoint must survive"
    for path in listed:  # every promoted file is complete: temporary files are never listed or pointed at
        full.load(path, storage=Local())
    latest = store.read_latest(tmp_path, storage=Local())
    assert latest is not None and latest in listed
    found = formats.find_resumable(CheckpointStore(tmp_path, Local()), pytest.fail)
    assert found is not None
    assert store.remove_stale_temporaries(tmp_path, storage=Local()) >= 1
    assert not any(".tmp-" in p.name for p in directory.iterdir())


def test_async_writer_reports_errors_on_the_training_thread(tmp_path: Path) -> None:
    writer = AsyncWriter()

    def failing() -> tuple[Path, int]:
        raise OSError("disk full")

    writer.submit(failing)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()


def test_set_epoch_changes_the_order_and_a_restart_reproduces_it() -> None:
    data = TensorDataset(torch.arange(64.0))

    def order(epoch: int, skip: int = 0) -> list[int]:
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
        sampler.set_epoch(epoch)
        skipping = _SkipSampler(sampler)
        skipping.skip = skip
        return list(skipping)

    assert order(0) != order(1)
    assert order(1) == order(1)  # a new process (restart) gets the same order for the same epoch
    assert order(1, skip=8) == order(1)[8:]  # mid-epoch resume continues exactly where it stopped


def test_resume_never_refuses_existing_checkpoints_unless_overwrite(tmp_path: Path) -> None:
    full.commit(tmp_path, sample_state(1), step=1, keep=3, storage=Local())
    with pytest.raises(UsageError, match="--resume never, but .* already holds 1 checkpoint"):
        resume.choose(TrainConfig(resume="never"), CheckpointStore(tmp_path, Local()), {}, print)
    assert (
        resume.choose(
            TrainConfig(resume="never", overwrite=True), CheckpointStore(tmp_path, Local()), {}, print
        )
        is None
    )
    assert store.list_checkpoints(tmp_path, storage=Local()) == []


def test_a_restart_always_resumes_its_own_latest(tmp_path: Path) -> None:
    path, _ = full.commit(tmp_path, sample_state(1), step=1, keep=3, storage=Local())
    restarted = {"SLURM_RESTART_COUNT": "1"}
    assert (
        resume.choose(TrainConfig(resume="never"), CheckpointStore(tmp_path, Local()), restarted, print)
        == path
    )
    assert (
        resume.choose(
            TrainConfig(resume="/elsewhere.pt"), CheckpointStore(tmp_path, Local()), restarted, print
        )
        == path
    )


def test_incompatible_checkpoint_names_the_difference(tmp_path: Path) -> None:
    state = sample_state(1)
    with pytest.raises(CheckpointError, match=r"--batch-size 32 \(now 64\).*world size 1 \(now 4\)"):
        resume.check_compatible(
            state, tmp_path / "x.pt", TrainConfig(batch_size=64), world_size=4, fmt=full.Full
        )
    with pytest.raises(CheckpointError, match="is for a different model"):
        load_model_state(torch.nn.Linear(5, 2), state["model"], tmp_path / "x.pt")


def test_best_and_latest_work_wherever_a_checkpoint_path_does(tmp_path: Path) -> None:
    """Issue 32, finding 14: the pointer files were read as checkpoints ("holds kpt, which a weights_only load
    refuses"); they name one, and `checkpoint export` and `--resume` take the one they name. Issue 42: so do
    `hpc_ddp.checkpoint.load_model` and `full.load` (the loader README names), through the same resolver."""
    from hpc_ddp.checkpoint import load_model
    from hpc_ddp.checkpoint.__main__ import main, run_export

    states = {step: sample_state(step) for step in (4, 8)}
    for step, state in states.items():
        full.commit(tmp_path, state, step=step, keep=3, storage=Local())
    store.point_best(tmp_path, store.ckpt_dir(tmp_path) / store.ckpt_name(4), keep=3, storage=Local())
    pointers = store.ckpt_dir(tmp_path)
    for name, step in (("best", 4), ("latest", 8)):
        out = tmp_path / f"{name}.pth"
        run_export(pointers / name, out, "local")
        expected = states[step]["model"]
        exported = torch.load(out, weights_only=True)
        assert exported.keys() == expected.keys()
        assert all(torch.equal(exported[k], expected[k]) for k in expected)
        loaded = load_model(torch.nn.Linear(4, 2), pointers / name).state_dict()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
        assert full.load(pointers / name, storage=Local())["position"]["step"] == step
        assert full.load(str(pointers / name), storage=Local())["position"]["step"] == step
    assert main(["export", str(pointers / "best"), str(tmp_path / "cli.pth")]) == 0
    assert torch.equal(
        torch.load(tmp_path / "cli.pth", weights_only=True)["weight"], states[4]["model"]["weight"]
    )
    # --resume checkpoints/best: an earlier checkpoint of this folder, so a new line (the later one set aside).
    chosen = resume.plan(
        TrainConfig(resume=str(pointers / "best")), CheckpointStore(tmp_path, Local()), {}, print
    )
    assert chosen.start == pointers / "ckpt-00000004.pt"
    assert chosen.set_aside == (pointers / "ckpt-00000008.pt",)
    chosen = resume.plan(
        TrainConfig(resume=str(pointers / "latest")), CheckpointStore(tmp_path, Local()), {}, print
    )
    assert chosen.start == pointers / "ckpt-00000008.pt" and chosen.set_aside == ()
    (pointers / "best").write_text("ckpt-00000099.pt\n")
    with pytest.raises(
        UsageError, match=r"best names 'ckpt-00000099.pt', which is not a checkpoint beside it"
    ):
        run_export(pointers / "best", tmp_path / "x.pth", "local")
    for load in (lambda p: load_model(torch.nn.Linear(4, 2), p), lambda p: full.load(p, Local())):
        with pytest.raises(
            UsageError, match=r"best names 'ckpt-00000099.pt', which is not a checkpoint beside"
        ):
            load(pointers / "best")
    assert main(["export", str(pointers / "best"), str(tmp_path / "x.pth")]) == 2


def test_a_changed_checkpoint_format_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """Issue 32, finding 15: a sharded checkpoint resumed with --checkpoint-format full said "is for a different
    model"."""
    from hpc_ddp.run.checkpoint.sharded import Sharded

    meta = {"world_size": 2, "config": TrainConfig(strategy="fsdp").as_dict()}
    cfg = TrainConfig(strategy="fsdp", checkpoint_format="full")
    with pytest.raises(
        CheckpointError,
        match=r"ckpt-00000008 is a sharded checkpoint, but this run writes "
        r"--checkpoint-format full; .*Fix: --checkpoint-format sharded to resume it",
    ):
        resume.check_compatible(meta, tmp_path / "ckpt-00000008", cfg, 2, Sharded)
    meta = {"world_size": 2, "config": TrainConfig(strategy="fsdp", checkpoint_format="full").as_dict()}
    with pytest.raises(
        CheckpointError,
        match=r"--checkpoint-format sharded \(auto: sharded under --strategy "
        r"fsdp\); .*Fix: --checkpoint-format full to resume it",
    ):
        resume.check_compatible(
            meta, tmp_path / "ckpt-00000008.pt", TrainConfig(strategy="fsdp"), 2, full.Full
        )
