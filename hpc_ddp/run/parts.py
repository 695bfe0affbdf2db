"""The stateful parts of a training run's checkpoint (hpc_ddp.run.checkpoint.part: what a part is).

    model      the strategy's model state (REPLICATED under DDP); weights that are not finite are never written
    optimizer  the strategy's optimizer state; a changed --lr is applied on resume, and said
    scaler     the fp16 GradScaler's state (None without one)
    position   where the run is: epoch, batch, step, the epoch's loss so far
    rng        every rank's own RNG (PER_RANK): torch's CPU (and CUDA) generator and Python's `random`

Their keys are the entries of every checkpoint written since 0.1.0: never rename one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from hpc_ddp.run import resume
from hpc_ddp.run.checkpoint import content
from hpc_ddp.run.checkpoint.part import PER_RANK, REPLICATED, SHARDED, Loading, Part
from hpc_ddp.run.position import Position
from hpc_ddp.run.strategy.base import Strategy


class ModelPart(Part):
    key, what = "model", "the model's state_dict()"

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.kind = SHARDED if strategy.shards_state else REPLICATED
        self.names = [name for name, _ in strategy.model.named_parameters()]  # buffers may hold -inf (masks)

    def state_dict(self) -> Any:
        return self.strategy.model_state()

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        self.strategy.load_model_state(state, ctx.path)

    def check(self, state: Any, step: int) -> None:
        content.require_finite(state, self.names, step)  # the update before it overflowed: keep the last good


class OptimizerPart(Part):
    key, what = "optimizer", "the optimizer's state_dict()"

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.kind = SHARDED if strategy.shards_state else REPLICATED

    def state_dict(self) -> Any:
        return self.strategy.optimizer_state()

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        optimizer = self.strategy.optimizer
        assert optimizer is not None, "the strategy was closed"
        fresh = [g.get("lr") for g in optimizer.param_groups]  # as the current options build it
        self.strategy.load_optimizer_state(state)
        note = resume.reapply_lr(optimizer, fresh, ctx.meta, ctx.cfg, ctx.path)
        if note:
            ctx.notes.append(note)


class ScalerPart(Part):
    key, kind = "scaler", REPLICATED

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler

    def state_dict(self) -> Any:
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


class PositionPart(Part):
    key, kind = "position", REPLICATED

    def __init__(self, get: Callable[[], Position], set_: Callable[[Position], None]) -> None:
        self.get, self.set = get, set_

    def state_dict(self) -> Any:
        return asdict(self.get())

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        self.set(Position(**state))


class RngPart(Part):
    key, kind = "rng", PER_RANK

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> Any:
        state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": _to_lists(random.getstate())}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        if state is None:
            return  # no RNG of this rank in the checkpoint: the run goes on with the seed's stream
        torch.set_rng_state(state["cpu"])
        random.setstate(_to_tuples(state["python"]))
        if self.device.type == "cuda" and state.get("cuda") is not None:
            torch.cuda.set_rng_state(state["cuda"], self.device)


def _to_lists(obj: Any) -> Any:
    """random.getstate() as nested lists: plain data that loads under weights_only=True."""
    return [_to_lists(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _to_tuples(obj: Any) -> Any:
    return tuple(_to_tuples(x) for x in obj) if isinstance(obj, list) else obj
