"""Strategies: how the model is spread over the ranks (base.py: the interface the loop talks to).

    ddp   DistributedDataParallel: a replica per rank, gradients all-reduced in backward (ddp.py)
    fsdp  FSDP2: parameters, gradients and optimizer state sharded over the ranks (fsdp.py)

`--strategy` takes its names from the registry of entry point group `hpc_ddp.strategies` (hpc_ddp.registry):
these two, declared there as built-ins, and any installed package's (docs/plugins.md). Adding one to the kit is
its module and its entry in registry.BUILTINS and pyproject.toml.

A strategy's module is imported only when a run asks for it: fsdp.py pulls in DTensor and Distributed
Checkpoint (and through them sympy), about 2 s of start-up on every rank that a ddp run would pay for nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_ddp import registry

if TYPE_CHECKING:  # torch comes with a strategy's module, when a run asks for one (`--help` does not)
    from hpc_ddp.run.strategy.base import Strategy

STRATEGIES: dict[str, str] = registry.BUILTINS["hpc_ddp.strategies"]  # the kit's own: name -> "module:class"


def kind(name: str) -> type[Strategy]:
    """The class of the strategy called `name` (its module imported now): a built-in's or a plugin's."""
    found: type[Strategy] = registry.strategies.load(name)
    return found


def create(name: str, *args: Any, **options: Any) -> Strategy:
    """The strategy called `name`, built with (cfg, env, device, **its own options)."""
    return kind(name)(*args, **options)


def for_run(cfg: Any, env: Any, device: Any, task: Any, comm_hook: Any = None) -> Strategy:
    """The strategy --strategy names, with its own options: DDP's comm hook, FSDP's `Task.shard`; and how a
    factory's modules are initialized (`Task.init_weights`). The class picks what it takes (`for_task`)."""
    return kind(cfg.strategy).for_task(cfg, env, device, task, comm_hook)
