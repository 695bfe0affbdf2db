"""Strategies: how the model is spread over the ranks (base.py: the interface the loop talks to).

    ddp   DistributedDataParallel: a replica per rank, gradients all-reduced in backward (ddp.py)

Adding one (FSDP) is its module and one entry in STRATEGIES.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.run.strategy.base import Strategy
from hpc_ddp.run.strategy.ddp import DDPStrategy

STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (DDPStrategy,)}


def create(name: str, *args: Any, **options: Any) -> Strategy:
    """The strategy called `name`, built with (cfg, env, device, **its own options)."""
    kind = STRATEGIES.get(name)
    if kind is None:
        raise UsageError(f"--strategy {name}: no such strategy. Use one of: {', '.join(STRATEGIES)}")
    return kind(*args, **options)
