"""Strategies: how the model is spread over the ranks (base.py: the interface the loop talks to).

    ddp   DistributedDataParallel: a replica per rank, gradients all-reduced in backward (ddp.py)
    fsdp  FSDP2: parameters, gradients and optimizer state sharded over the ranks (fsdp.py)

Adding one is its module and one entry in STRATEGIES (and its name in run/config.py's STRATEGIES).
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.run.strategy.base import Strategy
from hpc_ddp.run.strategy.ddp import DDPStrategy
from hpc_ddp.run.strategy.fsdp import FSDPStrategy

STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (DDPStrategy, FSDPStrategy)}


def create(name: str, *args: Any, **options: Any) -> Strategy:
    """The strategy called `name`, built with (cfg, env, device, **its own options)."""
    kind = STRATEGIES.get(name)
    if kind is None:
        raise UsageError(f"--strategy {name}: no such strategy. Use one of: {', '.join(STRATEGIES)}")
    return kind(*args, **options)


def for_run(cfg: Any, env: Any, device: Any, task: Any, comm_hook: Any = None) -> Strategy:
    """The strategy --strategy names, with its own options: DDP's comm hook, FSDP's `Task.shard`."""
    if cfg.strategy == "fsdp":
        return create("fsdp", cfg, env, device, shard=task.shard)
    return create(cfg.strategy, cfg, env, device, comm_hook=comm_hook)
