"""The strategy interface: how the model is spread over the ranks and kept in step.

The training loop (hpc_ddp.run.loop.trainer) names no strategy (tests/test_architecture.py checks its imports): it
asks its strategy to wrap the model and build the optimizer (in that order, `setup`), for the context of a
micro-batch whose gradients must not be synchronised yet (`no_sync`), the forward's autocast, a mark when
backward's gradients are all computed, clipping, each state to save and load, the full weights for
`model.pth`, the end-of-training check that the ranks agree, and the release of everything that holds the
process group (`close`). Two strategies implement it: DDP (ddp.py) and FSDP2 (fsdp.py); another is one more
file beside them, or a plugin's class in an installed package (hpc_ddp.registry, docs/plugins.md).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import CheckpointError
from hpc_ddp.log import RankLog
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop import materialize
from hpc_ddp.run.loop.materialize import Factory, InitWeights
from hpc_ddp.run.loop.params import Parameters, check_stepped

OptimizerFactory = Callable[[Parameters], torch.optim.Optimizer]


class Strategy(ABC):
    """One rank's share of the model and its optimizer. Build it, then `setup`; `close` on every path before
    the process group is destroyed (idempotent)."""

    name: ClassVar[str]  # what --strategy calls it
    shards_state: ClassVar[bool] = (
        False  # model and optimizer state: a shard per rank (else the same everywhere)
    )
    # Declared, for the config checks before any run (hpc_ddp.registry.trait): the strategy shards the model
    # over the ranks (FSDP), so it can write the sharded checkpoint format and takes FSDP's flags.
    # `shards_state` above is what one run's instance does (FSDP under --checkpoint-format full: whole states).
    shards_model: ClassVar[bool] = False

    def __init__(
        self, cfg: TrainConfig, env: DistEnv, device: torch.device, init_weights: InitWeights | None = None
    ) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.init_weights = init_weights  # Task.init_weights: with a factory, how each module is initialized
        self.model: nn.Module  # the user's model (after setup, on this rank's device)
        self.wrapped: nn.Module | None = None  # what the loop calls forward on: the synchronised module
        self.optimizer: torch.optim.Optimizer | None = None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        # fp16 needs loss scaling; bf16 has float32's range and does not.
        self.scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None

    @classmethod
    def for_task(
        cls, cfg: TrainConfig, env: DistEnv, device: torch.device, task: Any, comm_hook: Any = None
    ) -> Strategy:
        """This strategy for a run of `task`, with what it takes of it (`Task.init_weights`, and each
        strategy's own: DDP's comm hook, FSDP's `Task.shard`); a plugin's class built its own way overrides it."""
        return cls(cfg, env, device, init_weights=task.init_weights)

    # ----- building ---------------------------------------------------------------------------------------
    def setup(
        self, model: nn.Module | Factory, optimizer: OptimizerFactory
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap `model` (or build it first, when it is a factory), then build the optimizer over the parameters it
        must step, named (run/loop/params.py): always in this order (FSDP's parameters only become the sharded ones
        once wrapped). Returns the wrapped module and the optimizer."""
        self.wrapped = self.wrap(model)
        trained = Parameters(self.named_parameters())
        self.optimizer = optimizer(trained)
        check_stepped(self.optimizer, trained, self.name)
        return self.wrapped, self.optimizer

    @abstractmethod
    def wrap(self, model: nn.Module | Factory) -> nn.Module:
        """Put `model` on this rank's device and wrap it; keep the model in `self.model` and the wrapper in
        `self.wrapped` as soon as they exist (a later error must find them to release them). A factory is
        built the strategy's way (`build`, unless the strategy builds on the meta device itself)."""

    def build(self, model: nn.Module | Factory) -> nn.Module:
        """The model itself; a factory's, built as it builds it and given the kit's initial weights (those of
        every path for this --seed: hpc_ddp.run.loop.materialize)."""
        if not materialize.is_factory(model):
            return model  # type: ignore[return-value]
        return materialize.eager(model, self.cfg.seed, self.init_weights)  # type: ignore[arg-type]

    def parameters(self) -> Iterable[nn.Parameter]:
        """What the optimizer steps (and clipping clips)."""
        return self.model.parameters()

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """The same, with the bare model's names (no wrapper's prefix): what the optimizer factory gets."""
        return self.model.named_parameters()

    # ----- each step ----------------------------------------------------------------------------------------
    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch that is not the step's last (--grad-accum): its gradients accumulate locally."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Around the forward and the loss (--amp)."""
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    @abstractmethod
    def on_backward_end(self, loss: torch.Tensor, callback: Callable[[], None]) -> None:
        """Have `callback()` run once backward from `loss` has computed every gradient, before this rank waits
        for their synchronisation to end (the hang beacon's "gradient all-reduce" starts there)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total norm of `max_norm`; returns the norm before clipping (not synced)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)

    def grad_norm(self) -> torch.Tensor:
        """The gradients' total norm, as `clip_grad_norm` computes it but changing nothing (no --clip-grad):
        local work after DDP's all-reduce, a tensor on the device (not synced)."""
        return torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])

    # ----- state --------------------------------------------------------------------------------------------
    def model_state(self) -> dict[str, Any]:
        """The model's state as the checkpoint holds it (this rank's shard when `shards_state`)."""
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, Any], path: Path) -> None:
        load_model_state(self.model, state, path)

    def optimizer_state(self) -> dict[str, Any]:
        assert self.optimizer is not None, "the strategy was closed"
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None, "the strategy was closed"
        self.optimizer.load_state_dict(state)

    def sync_buffers(self) -> None:
        """A collective before an evaluation: every rank's buffers (BatchNorm's running statistics) the same.
        DDP broadcasts rank 0's at the first forward anyway; a strategy that does not, does it here."""
        return None

    @abstractmethod
    def full_model_state(self) -> dict[str, Any] | None:
        """A collective: the plain state dict of the whole bare model (what `model.pth` holds, loadable into the
        user's model) on rank 0, None elsewhere."""

    @abstractmethod
    def nonfinite_parameters(self) -> list[str]:
        """A collective: the names of the parameters holding NaN or infinity anywhere (the same on every rank)."""

    @abstractmethod
    def check_in_sync(self, log: RankLog) -> None:
        """A collective at the end of training: prove the ranks hold the model they should (NonFinite if the
        weights are not finite; a warning if replicas differ)."""

    def trained(self) -> None:
        """Training is over (the final save and model.pth come next): let go of what only the training steps
        use. The model and the optimizer stay as they are. Nothing by default."""
        return None

    def close(self) -> None:
        """Drop what holds the process group (the wrapper) and the optimizer. `model` stays readable."""
        self.wrapped = None
        self.optimizer = None


def load_model_state(model: nn.Module, state: dict[str, Any], path: Path) -> None:
    """load_state_dict, with a mismatch reported as a CheckpointError naming the keys."""
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # same names, other shapes
        raise CheckpointError(
            f"checkpoint {path} is for a different model: {str(e).splitlines()[-1].strip()[:300]}. "
            "Fix: the same --task, or another --folder"
        ) from e
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint {path} is for a different model: missing {list(result.missing_keys)[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}. Fix: the same --task, or another --folder"
        )
