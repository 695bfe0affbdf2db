"""FSDP2: every rank holds a shard of each parameter, its gradient and its optimizer state (`--strategy fsdp`).

`fully_shard` goes on each block (the modules of the model's `nn.ModuleList`s, or what `Task.shard(model)`
returns), then on the root: a block's parameters are all-gathered just before its forward (and again before
its backward with `--reshard-after-forward true`), and its gradients are reduce-scattered as soon as its
backward ends, so a rank never holds more than a few blocks in full.

On CPU ranks (gloo) the reduce-scatter is an all-to-all and a sum, and the collectives' block-sized buffers are
reused (hpc_ddp.run.strategy.gloo_comm): gloo's own reduce-scatter is slower than an all-reduce.

The mesh is always given: without one, `fully_shard` picks a CUDA mesh whenever CUDA exists, which breaks a
gloo group on a GPU machine (pytorch#132471). `--amp bf16` is FSDP's mixed precision (bf16 parameters for the
compute, fp32 gradient reductions and fp32 sharded weights), not autocast.

State: the model's and the optimizer's states are sharded DTensor state dicts (`get_model_state_dict`,
`get_optimizer_state_dict`); a sharded checkpoint format saves each rank's own shards. With the full format,
`full_states` makes them full CPU state dicts gathered from every rank (a collective on every rank), which is
also what `model.pth` holds.

Buffers (BatchNorm's running statistics): FSDP2 neither shards nor synchronizes them, so each rank would update
its own copy from its own batches, and a checkpoint keeps one copy (DCP saves a replicated entry once, from
whichever rank its plan picks): a resumed run would evaluate with other statistics than the uninterrupted one,
and `export` could disagree with another rank's view. So they are replicated as DDP replicates them: rank 0's
are broadcast before every training forward (one broadcast per dtype, only for a model that has persistent
buffers), and again before every evaluation and every save (`sync_buffers`), so every rank evaluates and every
checkpoint holds the same, rank 0's, whichever rank writes them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hpc_ddp import registry
from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import CheckpointError, NonFinite, UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop import materialize
from hpc_ddp.run.loop.materialize import Factory, InitWeights
from hpc_ddp.run.strategy import gloo_comm
from hpc_ddp.run.strategy.base import Strategy

Shard = Callable[[nn.Module], Iterable[nn.Module]]
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, on CPU; others: {}


def blocks(model: nn.Module) -> list[nn.Module]:
    """The default blocks: the modules of every nn.ModuleList in `model`, innermost first (FSDP2 shards from
    the leaves up: a block inside a sharded block must be sharded before it)."""
    found: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            found.extend(module)
    return list(reversed(found))


class FSDPStrategy(Strategy):
    name = "fsdp"
    shards_model = True

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        shard: Shard | None = None,
        init_weights: InitWeights | None = None,
    ) -> None:
        super().__init__(cfg, env, device, init_weights)
        self.shard = shard
        # The checkpoint holds whole states, not shards: its format declares whether it writes shards.
        self.full_states = not registry.checkpoint_formats.trait(cfg.format_name(), "shards")
        self.shards_state = not self.full_states  # type: ignore[misc]
        self.autocast_dtype = None  # the mixed-precision policy casts; autocast stays off
        self.policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if cfg.amp == "bf16"
            else MixedPrecisionPolicy()
        )
        self.blocks: list[nn.Module] = []
        self.pool: gloo_comm.BufferPool | None = None  # the collectives' buffers on CPU ranks (gloo_comm)

    @classmethod
    def for_task(
        cls, cfg: TrainConfig, env: DistEnv, device: torch.device, task: Any, comm_hook: Any = None
    ) -> Strategy:
        return cls(cfg, env, device, shard=task.shard, init_weights=task.init_weights)

    def wrap(self, model: nn.Module | Factory) -> nn.Module:
        # No model.to(device) first: that would put the whole model on every GPU, which is what fsdp is for
        # avoiding. `fully_shard` moves each block's parameters to the mesh's device as it shards them, one
        # block at a time, so a rank's device never holds more than one whole block plus its shards. A factory
        # is built on the meta device: sharded there, then only this rank's shards are allocated (`to_empty`)
        # and set (hpc_ddp.run.loop.materialize), so no rank ever holds the whole model, not even in CPU memory.
        reference = None
        if materialize.is_factory(model):
            model = materialize.on_meta(model)  # type: ignore[arg-type]
            materialize.check(model, self.init_weights)
            reference = materialize.meta_reference(model)  # unsharded shapes, for each module's full init
        assert isinstance(model, nn.Module)
        self.model = model
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        chosen = list(self.shard(model)) if self.shard is not None else blocks(model)
        for module in chosen:
            if not isinstance(module, nn.Module) or module is model:
                raise UsageError(
                    f"Task.shard returned {type(module).__name__}: expected submodules of the model (the "
                    "root is sharded last by the kit). Fix: return the model's blocks, e.g. model.layers"
                )
        reshard = self.cfg.reshard_after_forward == "true"
        for module in chosen:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=self.policy)
        self.blocks = chosen
        # The root gathers what no block holds (embeddings, the head); it never reshards after forward, since
        # its backward comes at once (FSDP2 does the same by default).
        self.wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=self.policy)
        # CPU ranks: gloo's reduce-scatter replaced by an all-to-all, block buffers reused (run/strategy/gloo_comm)
        self.pool = gloo_comm.install([*chosen, model], mesh.get_group(), self.device)
        if reference is not None:
            model.to_empty(device=self.device)
            materialize.fill(model, reference, self.cfg.seed, self.init_weights)
        if _buffers(model) and self.env.world_size > 1:
            model.register_forward_pre_hook(self._before_forward)
        return self.wrapped

    def trained(self) -> None:
        if self.pool is not None:  # CPU ranks: the kept block buffers, two blocks' worth, go before the save
            self.pool.release()

    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        if module.training and torch.is_grad_enabled():  # a training forward: rank 0's buffers first, as DDP
            self.sync_buffers()

    def sync_buffers(self) -> None:
        """A collective: every rank's persistent buffers become rank 0's."""
        if self.env.world_size < 2:
            return
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in _buffers(self.model):
            by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        with torch.no_grad():
            for same in by_kind.values():
                flat = torch.cat([b.reshape(-1) for b in same])
                dist.broadcast(flat, src=0)
                for b, value in zip(same, flat.split([b.numel() for b in same]), strict=True):
                    b.copy_(value.view_as(b))

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """FSDP2's counterpart of DDP's no_sync: gradients of the micro-batch stay unsharded and accumulate;
        the step's last backward reduce-scatters the sum."""
        model = self.wrapped
        assert model is not None, "the strategy was closed"
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def on_backward_end(self, loss: torch.Tensor, callback: Callable[[], None]) -> None:
        # As under DDP: queued when backward starts, before FSDP's own end-of-backward callback (queued by the
        # root's pre-backward), so it runs first: from then on the rank waits for the last reduce-scatters.
        loss.register_hook(lambda grad: Variable._execution_engine.queue_callback(callback))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # The norm of sharded gradients is a DTensor: the total over every rank's shards (a collective).
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def grad_norm(self) -> torch.Tensor:
        # The global norm of the sharded gradients: one all-reduce of a scalar (as clipping's).
        norm = super().grad_norm()
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ----- state --------------------------------------------------------------------------------------------
    def model_state(self) -> dict[str, Any]:
        """A collective: this rank's shards (DTensors), or with the full format the whole CPU state on rank 0
        (an empty dict elsewhere); the buffers rank 0's on every rank."""
        self.sync_buffers()
        return get_model_state_dict(self.model, options=FULL if self.full_states else None)

    def load_model_state(self, state: Any, path: Path) -> None:
        if callable(getattr(state, "fill", None)):  # a sharded checkpoint's entry: read into our own shards
            state = state.fill(get_model_state_dict(self.model))
        try:
            set_model_state_dict(
                self.model, state, options=StateDictOptions(full_state_dict=self.full_states)
            )
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {path} is for a different model: {str(e).splitlines()[-1].strip()[:300]}. "
                "Fix: the same --task, or another --folder"
            ) from e

    def optimizer_state(self) -> dict[str, Any]:
        assert self.optimizer is not None, "the strategy was closed"
        fresh = not self.optimizer.state
        state = get_optimizer_state_dict(
            self.model, self.optimizer, options=FULL if self.full_states else None
        )
        if fresh:
            # torch gives an optimizer that never stepped a state by stepping it once, with zero gradients and a
            # zero learning rate (state_dict._init_optim_state). That step counts: Adam's `step` becomes 1 (the
            # first real step's bias correction is then the second's), and SGD's momentum takes weight decay x
            # the weights. The checkpointer asks for this state before the first step (check_savable), so the
            # first real step would differ from ddp's. Dropped: that step starts from nothing, as under ddp.
            self.optimizer.state.clear()
        return state

    def load_optimizer_state(self, state: Any) -> None:
        assert self.optimizer is not None, "the strategy was closed"
        if callable(getattr(state, "fill", None)):
            state = state.fill(get_optimizer_state_dict(self.model, self.optimizer))
        set_optimizer_state_dict(
            self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=self.full_states)
        )

    def full_model_state(self) -> dict[str, Any] | None:
        """A collective: every shard gathered, block by block, into rank 0's CPU memory (never the whole model
        on one GPU)."""
        self.sync_buffers()
        state = get_model_state_dict(self.model, options=FULL)
        return state if self.env.is_main else None

    def _local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.named_parameters():
            yield name, (p.to_local() if isinstance(p, DTensor) else p).detach()

    def nonfinite_parameters(self) -> list[str]:
        with torch.no_grad():
            mine = [
                n for n, t in self._local() if t.is_floating_point() and not bool(torch.isfinite(t).all())
            ]
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, mine)  # a shard lives on one rank only: the union is the answer
        return sorted({name for names in everyone for name in names})

    def check_in_sync(self, log: RankLog) -> None:
        """Under FSDP no two ranks hold the same weights, so there are no replicas to compare: every shard is
        stepped by its own rank only. What can still go wrong is non-finite weights: checked on every shard."""
        with torch.no_grad():
            mine = sum(float(t.double().sum()) for _, t in self._local())
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, mine)
        broken = [r for r, total in enumerate(everyone) if not math.isfinite(total)]
        if broken:
            raise NonFinite(
                f"the weights are not finite at the end of training (the shards of ranks {broken}): model.pth "
                "was not written. Fix: a smaller --lr or --clip-grad, then resume from the last good checkpoint"
            )
        log.main(
            f"Parameters sharded over {self.env.world_size} ranks (fsdp): no replicas to compare; every "
            "shard is finite"
        )


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's persistent buffers (those its state_dict holds), each once."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found.setdefault(id(buffer), buffer)
    return list(found.values())
