"""The stateful parts of a training run's checkpoint (hpc_ddp.run.checkpoint.part: what a part is).

    model      the strategy's model state (REPLICATED under DDP); weights that are not finite are never written
    optimizer  the strategy's optimizer state; a changed --lr is applied on resume, and said
    scaler     the fp16 GradScaler's state (None without one)
    scheduler  the LR scheduler's state (None without one); a changed --lr scales its rates on resume
    position   where the run is: epoch, batch, step, the epoch's loss so far
    rng        every rank's own RNG (PER_RANK): torch's CPU (and CUDA) generator, Python's `random`, NumPy's
               (hpc_ddp.run.loop.rng)
    stream     every rank's IterableDataset state_dict() (PER_RANK) at the start of its next step, when it
               has one: the dataset's own without DataLoader workers, the StatefulDataLoader's (every
               worker's) with them (hpc_ddp.run.data.loaders); None otherwise
    best       --keep-best: the best evaluation value so far and its step (hpc_ddp.run.loop.best); None without
    callbacks  every rank's state of the task's callbacks that have state_dict()/load_state_dict() (PER_RANK,
               hpc_ddp.run.callbacks); the part exists only when such a callback does

Their keys are the entries of every checkpoint written since 0.1.0: never rename one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from hpc_ddp.run.callbacks import WHAT, Callbacks
from hpc_ddp.run.checkpoint import content, resume
from hpc_ddp.run.checkpoint.part import PER_RANK, REPLICATED, SHARDED, Loading, Part
from hpc_ddp.run.loop import rng, schedules
from hpc_ddp.run.loop.best import Best
from hpc_ddp.run.loop.position import Position
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


class SchedulerPart(Part):
    """The LR scheduler (Task.scheduler or --lr-schedule). Loaded after the optimizer, whose state holds the
    groups' current rates. --lr changed on resume: every rate (the scheduler's base rates, each group's current
    rate) is scaled by new/old --lr, so the schedule goes on from the step it reached at the new base. A total
    that changed (`ctx.total_steps`, the one this run's scheduler is built over: --epochs raised on a finished
    run) is gone on with deliberately, and said (schedules.total_changed): never a silent jump of the rate."""

    key, kind, what = "scheduler", REPLICATED, "the LR scheduler's state_dict()"

    def __init__(self, get: Callable[[], Any]) -> None:
        self.get = get

    def state_dict(self) -> Any:
        scheduler = self.get()
        return scheduler.state_dict() if scheduler is not None else None

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        scheduler = self.get()
        if scheduler is None or state is None:
            return  # none now or none then: the optimizer's rates, as loaded, stand
        # --lr-schedule's factors span the run's total steps as the options give them now (--epochs or
        # --max-steps may change on resume): loading would put back the old total, which is kept out.
        totals = [
            (f, f.total) for f in getattr(scheduler, "lr_lambdas", ()) if isinstance(f, schedules.Factor)
        ]
        scheduler.load_state_dict(state)
        for f, total in totals:
            f.total = total
        saved = ctx.meta.get("config", {}).get("lr")
        changed = saved is not None and saved != ctx.cfg.lr
        ratio = ctx.cfg.lr / saved if changed else 1.0
        groups = scheduler.optimizer.param_groups
        if changed and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [rate * ratio for rate in scheduler.base_lrs]
            for group in groups:
                if "initial_lr" in group:
                    group["initial_lr"] *= ratio
        if totals:  # a LambdaLR of --lr-schedule: the rate of its step, as LambdaLR computes it
            rates = [
                b * f(scheduler.last_epoch)
                for b, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
            ]
        else:  # a task's own: the rates it reached, scaled
            rates = [rate * ratio for rate in state.get("_last_lr") or [g["lr"] for g in groups]]
        before = list(state.get("_last_lr") or [g["lr"] for g in groups])
        for group, rate in zip(groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = [g["lr"] for g in groups]
        note = self._total_note(scheduler, state, ctx, totals, before[0] * ratio)
        if note:
            ctx.notes.append(note)
        if not changed:
            return
        ctx.notes.append(
            f"the LR schedule goes on from step {state.get('last_epoch')} at the new --lr {ctx.cfg.lr} (every "
            f"rate scaled by {ratio:g})"
        )

    def _total_note(
        self, scheduler: Any, state: Any, ctx: Loading, totals: list[tuple[Any, int]], before: float
    ) -> str | None:
        """The line a changed total gets (group 0's rate before and after), or None."""
        step = int(state.get("last_epoch") or 0)
        why = schedules.why_total(ctx.meta.get("config") or {}, ctx.cfg.as_dict())
        if totals:  # --lr-schedule: its Factor's total is in the state (LambdaLR saves a callable's __dict__)
            saved = [d.get("total") for d in state.get("lr_lambdas") or () if isinstance(d, dict)]
            after = scheduler.optimizer.param_groups[0]["lr"]
            return schedules.total_changed(
                saved[0] if saved else None, totals[0][1], step, before, after, False, why
            )
        if "total_steps" not in ctx.meta or ctx.meta["total_steps"] == ctx.total_steps:
            return None  # a checkpoint written before it said its total, or the same total
        after = (
            before
            if schedules.is_plateau(scheduler)
            else schedules.trial_step(scheduler, scheduler.optimizer)[0]
        )
        return schedules.total_changed(
            ctx.meta["total_steps"], ctx.total_steps, step + 1, before, after, True, why
        )


class PositionPart(Part):
    key, kind = "position", REPLICATED

    def __init__(self, get: Callable[[], Position], set_: Callable[[Position], None]) -> None:
        self.get, self.set = get, set_

    def state_dict(self) -> Any:
        return asdict(self.get())

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        pos = Position(**state)
        saved = int(ctx.meta.get("world_size") or 0)
        if saved and ctx.world_size and saved != ctx.world_size:
            # Resharded (--allow-resize): the epoch's shuffle is the same, split over other ranks; the samples
            # it already trained on are `batch` per rank times the old ranks, so each new rank skips its share.
            pos.batch = pos.batch * saved // ctx.world_size
        self.set(pos)


class StreamPart(Part):
    key, kind, what = "stream", PER_RANK, "the IterableDataset's state_dict()"

    def __init__(self, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        self.get, self.set = get, set_

    def state_dict(self) -> Any:
        return self.get()

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        self.set(state)  # used when the stream's epoch goes on (feed.stream_epoch)


class BestPart(Part):
    key, kind = "best", REPLICATED

    def __init__(self, best: Best | None) -> None:
        self.best = best

    def state_dict(self) -> Any:
        return self.best.state_dict() if self.best is not None else None

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        note = self.best.load_state_dict(state) if self.best is not None else None
        if note:
            ctx.notes.append(note)


class RngPart(Part):
    key, kind = "rng", PER_RANK

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> Any:
        return rng.state(self.device)

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        if state is None:
            return  # no RNG of this rank in the checkpoint: the run goes on with the seed's stream
        rng.load(state, self.device)


class CallbacksPart(Part):
    """Per rank: under ddp an EMA of the weights is the same on every rank, but under fsdp it holds each rank's
    shards, and a callback may keep what is its rank's own; each rank's is saved and loaded back by that rank.
    The cost: the full format gathers every rank's copy to rank 0 (a copy per rank in the file); the sharded
    format writes each into its rank's own file.

    The state is copied to the CPU here, on every rank: the full format sends each rank's to rank 0 pickled
    (all_gather_object), where a GPU tensor would come back on the sender's device index, which rank 0 may not
    have (another node) or must not fill (another rank's GPU)."""

    key, kind, what = "callbacks", PER_RANK, WHAT

    def __init__(self, callbacks: Callbacks) -> None:
        self.callbacks = callbacks

    def state_dict(self) -> Any:
        return content.to_cpu(self.callbacks.state_dict(), self.what)

    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        ctx.notes.extend(self.callbacks.load_state_dict(state))
