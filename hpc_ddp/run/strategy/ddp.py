"""DDP: a full replica of the model on every rank, gradients averaged by an all-reduce during backward.

Every rank holds the same weights and the same optimizer state, so a checkpoint saves rank 0's copy (the model
and optimizer parts are REPLICATED), `model.pth` is rank 0's state dict, and at the end the ranks prove they
still agree (two float64 sums per rank).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp.cluster import group
from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import NonFinite
from hpc_ddp.log import RankLog
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.materialize import Factory, InitWeights
from hpc_ddp.run.strategy.base import Strategy

CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


def ordered_mean_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    """--deterministic: all-gather each bucket and sum in rank order, so the result doesn't depend on how
    DDP laid out its buckets. DDP rebuilds buckets after a process's first backward; a resumed process would
    otherwise sum its first step in a different grouping than the uninterrupted run did.

    The all-gather is waited for here and the sum done on this thread, not chained with `future.then(...)`:
    that callback would run Python on gloo's own thread, which creates and deletes a Python thread state
    each time, and a DataLoader worker forked at that moment deadlocks in CPython 3.11's fork (gh-112275).
    --deterministic gives up the overlap of this all-gather with the rest of the backward; it is for
    exactness, not speed."""
    buffer = bucket.buffer()
    world = dist.get_world_size()
    parts = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(parts, buffer)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    # A CUDA result needs a future that knows its device (DDP waits on it from its stream).
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.device.type == "cuda" else None
    )
    done.set_result(total.div_(world))
    return done


class DDPStrategy(Strategy):
    """`comm_hook`, if given, is DDP's comm hook (none by default: DDP's own C++ all-reduce; the ordered
    all-gather under --deterministic with more than one rank)."""

    name = "ddp"

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        comm_hook: CommHook | None = None,
        init_weights: InitWeights | None = None,
    ) -> None:
        super().__init__(cfg, env, device, init_weights)
        self.comm_hook = comm_hook

    @classmethod
    def for_task(
        cls, cfg: TrainConfig, env: DistEnv, device: torch.device, task: Any, comm_hook: Any = None
    ) -> Strategy:
        return cls(cfg, env, device, comm_hook=comm_hook, init_weights=task.init_weights)

    def wrap(self, model: nn.Module | Factory) -> nn.Module:
        self.model = built = self.build(model).to(self.device)
        # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving a copy per step.
        self.wrapped = DDP(
            built,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        group.hold(self.wrapped)  # its Reducer holds the group: it must be gone before the group is
        # No comm hook unless one is needed: any hook, even a Python copy of DDP's own all-reduce, costs an
        # extra pass over every gradient (DDP divides while copying into its buckets only without a hook).
        hook = self.comm_hook or (
            ordered_mean_hook if self.cfg.deterministic and self.env.world_size > 1 else None
        )
        if hook is not None:
            self.wrapped.register_comm_hook(None, hook)
        return self.wrapped

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        assert isinstance(self.wrapped, DDP), "the strategy was closed"
        return self.wrapped.no_sync()

    def on_backward_end(self, loss: torch.Tensor, callback: Callable[[], None]) -> None:
        # The hook runs as backward starts (the loss's gradient) and queues `callback` for the end of the
        # backward graph. It is queued before DDP's own (which DDP queues once its last bucket is ready), so it
        # runs first: all gradients are computed, and from then on this rank only waits for the all-reduce.
        loss.register_hook(lambda grad: Variable._execution_engine.queue_callback(callback))

    def full_model_state(self) -> dict[str, Any] | None:
        return self.model.state_dict() if self.env.is_main else None  # every replica is the same

    def nonfinite_parameters(self) -> list[str]:
        with torch.no_grad():
            return [
                name
                for name, p in self.model.named_parameters()
                if p.is_floating_point() and not bool(torch.isfinite(p).all())
            ]

    def check_in_sync(self, log: RankLog) -> None:
        """DDP keeps replicas equal only if every rank applies the same update; prove it once at the end.
        Bitwise-equal parameters give bitwise-equal float64 sums, so two numbers per rank are enough."""
        with torch.no_grad():
            flat = [p.detach().double() for p in self.model.parameters()]
            mine = (sum(float(t.sum()) for t in flat), sum(float((t * t).sum()) for t in flat))
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, mine)
        # NaN equals nothing, itself included: non-finite weights are their own finding, not a difference.
        broken = [r for r, fp in enumerate(everyone) if not all(math.isfinite(x) for x in fp)]
        if broken:
            raise NonFinite(
                f"the weights are not finite at the end of training (ranks {broken}): model.pth was not "
                "written. Fix: a smaller --lr or --clip-grad, then resume from the last good checkpoint"
            )
        differing = [r for r, fp in enumerate(everyone) if fp != everyone[0]]
        if differing and self.env.is_main:
            log.warn(f"parameters differ between rank 0 and ranks {differing} at the end of training")
        elif not differing:
            log.main(f"Parameters identical on {_all_ranks(self.env.world_size)}")


def _all_ranks(world_size: int) -> str:
    """'all 4 ranks', or 'the 1 rank' for a world of one (pure)."""
    return f"all {world_size} ranks" if world_size != 1 else "the 1 rank"
