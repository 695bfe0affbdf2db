"""The DDP loop in-process, on a real one-rank gloo group: accumulation, AMP, clipping, metrics, resume.
Every Trainer is closed inside its process_group() block (see hpc_ddp.cluster.group: teardown order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trainer_state
from conftest import local_checkpoints

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.log import RankLog
from hpc_ddp.run import strategy, tasks
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.trainer import Trainer


@pytest.fixture
def single() -> dist_env.DistEnv:
    return dist_env.detect({})


def make(cfg: TrainConfig, env: dist_env.DistEnv, folder: Path, **kwargs: Any) -> Trainer:
    torch.manual_seed(cfg.seed)
    cfg = cfg.with_folder(str(folder))
    storage = kwargs.pop("storage", None) or Local()
    checkpoints = CheckpointStore(folder, storage)
    return Trainer(cfg, env, torch.device("cpu"), tasks.build(cfg), RankLog(0), checkpoints, **kwargs)


def test_grad_accum_all_reduces_once_per_optimizer_step(single: dist_env.DistEnv, tmp_path: Path) -> None:
    cfg = TrainConfig(epochs=1, batch_size=10, grad_accum=4, save_every_epochs=0)  # 100 micro-batches
    calls: list[int] = []

    def counting(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(1)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    with process_group(single, torch.device("cpu")):
        torch.manual_seed(cfg.seed)
        cfg = cfg.with_folder(str(tmp_path))
        task = tasks.build(cfg)
        # The caller composes the strategy: DDP with a comm hook of its own.
        ddp = strategy.for_run(cfg, single, torch.device("cpu"), task, comm_hook=counting)
        with Trainer(
            cfg, single, torch.device("cpu"), task, RankLog(0), local_checkpoints(cfg), strategy=ddp
        ) as trainer:
            outcome = trainer.run()
    assert outcome.finished
    assert trainer.pos.step == 25  # 100 micro-batches / 4
    assert len(calls) == 25  # no all-reduce on the 75 non-final micro-steps


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_trains_and_the_loss_goes_down(amp: str, single: dist_env.DistEnv, tmp_path: Path) -> None:
    cfg = TrainConfig(epochs=3, amp=amp, lr=0.05, clip_grad=1.0, save_every_epochs=0)
    with process_group(single, torch.device("cpu")), make(cfg, single, tmp_path) as trainer:
        assert (trainer.scaler is not None) == (amp == "fp16")
        trainer.run()
        trainer.metrics.end(trainer.pos)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["event"] == "epoch"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert records[-1]["event"] == "end" and records[-1]["samples_per_s"] > 0


def test_state_restores_position_optimizer_and_rng(single: dist_env.DistEnv, tmp_path: Path) -> None:
    cfg = TrainConfig(epochs=1, max_steps=5, save_every_epochs=0)
    with process_group(single, torch.device("cpu")):
        with make(cfg, single, tmp_path) as first:
            first.run()
            state = trainer_state.gather(first)
        assert state is not None
        with make(cfg, single, tmp_path) as second:
            trainer_state.restore(second, state, tmp_path / "x.pt")
    assert second.pos == first.pos and second.pos.step == 5
    assert all(
        torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True)
    )
    assert torch.equal(torch.get_rng_state(), state["rng"][0]["cpu"])


def test_a_step_driven_alone_is_one_step_of_the_loop(single: dist_env.DistEnv, tmp_path: Path) -> None:
    """The loop's own step, driven alone (as the bench drives it): same weights after one step, same loss."""
    cfg = TrainConfig(epochs=1, max_steps=1, save_every_epochs=0, log_every_s=0)
    (tmp_path / "loop").mkdir()
    (tmp_path / "step").mkdir()  # the step records itself as the loop does
    with process_group(single, torch.device("cpu")):
        with make(cfg, single, tmp_path / "loop") as looped:
            looped.run()
            looped.metrics.end(looped.pos)
        with make(cfg, single, tmp_path / "step") as stepped:
            stepped.feed.sampler.set_epoch(0)
            stepped.feed.generator.manual_seed(cfg.seed * 1_000_003)
            inputs, target = next(iter(stepped.feed.loader))
            agreed = stepped.step([(inputs, target)], 1)
    assert all(
        torch.equal(a, b) for a, b in zip(looped.model.parameters(), stepped.model.parameters(), strict=True)
    )
    first = json.loads((tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()[0])
    assert agreed.count == 1 and agreed.loss_sum == pytest.approx(first["loss"]) and not agreed.requeue


def test_the_checkpoint_storage_is_the_callers_to_swap(single: dist_env.DistEnv, tmp_path: Path) -> None:
    """Trainer(checkpoints=CheckpointStore(folder, storage)) writes every checkpoint through that storage."""
    from hpc_ddp.run.checkpoint import store

    calls: list[int] = []

    class Counted(Local):
        def write(self, path: str, fill: Any) -> int:
            calls.append(store.ckpt_step(Path(path)))
            return super().write(path, fill)

    cfg = TrainConfig(epochs=2, save_every_epochs=1)
    with (
        process_group(single, torch.device("cpu")),
        make(cfg, single, tmp_path, storage=Counted()) as trainer,
    ):
        trainer.run()
        trainer.save(final=True)
    assert (
        calls == [31, 62]
        and store.read_latest(tmp_path, storage=Local()) == tmp_path / "checkpoints" / "ckpt-00000062.pt"
    )
