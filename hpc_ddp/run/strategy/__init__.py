"""Strategies: how the model is spread over the ranks (base.py: the interface the loop talks to).

    ddp   DistributedDataParallel: a replica per rank, gradients all-reduced in backward (ddp.py)
    fsdp  FSDP2: parameters, gradients and optimizer state sharded over the ranks (fsdp.py)

Adding one is its module and one entry in STRATEGIES (options.py, where `--strategy` takes its names from).

A strategy's module is imported only when a run asks for it: fsdp.py pulls in DTensor and Distributed
Checkpoint (and through them sympy), about 2 s of start-up on every rank that a ddp run would pay for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpc_ddp.errors import UsageError
from hpc_ddp.run.strategy.options import STRATEGIES as STRATEGIES

if TYPE_CHECKING:  # torch comes with a strategy's module, when a run asks for one (`--help` does not)
    from hpc_ddp.run.strategy.base import Strategy


def kind(name: str) -> type[Strategy]:
    """The class of the strategy called `name` (its module imported now)."""
    where = STRATEGIES.get(name)
    if where is None:
        raise UsageError(f"--strategy {name}: no such strategy. Use one of: {', '.join(STRATEGIES)}")
    module, _, cls = where.partition(":")
    found: type[Strategy] = getattr(importlib.import_module(module), cls)
    return found


def create(name: str, *args: Any, **options: Any) -> Strategy:
    """The strategy called `name`, built with (cfg, env, device, **its own options)."""
    return kind(name)(*args, **options)


def for_run(cfg: Any, env: Any, device: Any, task: Any, comm_hook: Any = None) -> Strategy:
    """The strategy --strategy names, with its own options: DDP's comm hook, FSDP's `Task.shard`; and how a
    factory's modules are initialized (`Task.init_weights`)."""
    if cfg.strategy == "fsdp":
        return create("fsdp", cfg, env, device, shard=task.shard, init_weights=task.init_weights)
    return create(cfg.strategy, cfg, env, device, comm_hook=comm_hook, init_weights=task.init_weights)
