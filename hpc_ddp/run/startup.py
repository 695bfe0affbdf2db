"""A rank's first import of torch, and what the garbage collector does with it.

Importing torch and torch._dynamo is nearly all of a rank's start-up, and every rank pays it: DDP's
constructor reads `torch._dynamo.utils.get_optimize_ddp_mode()` and the optimizers wrap `add_param_group` in
`torch._disable_dynamo`, so a rank that trains imports torch._dynamo anyway. Those imports leave hundreds of
thousands of long-lived objects (modules, functions, op registrations) and no garbage cycles worth collecting.
Yet CPython's cyclic collector walks all of them again: during the imports, on every later full collection,
and once more when the interpreter exits.

So the collector is paused while they run, and `gc.freeze()` then moves everything imported into the permanent
generation, which no collection walks. Of the two, the freeze is most of the gain: about a third less CPU for
a process that imports and exits (`python -m hpc_ddp.bench launch`, "paused / plain": 0.64x on this
project's 2-core test machine). It is also what CPython's documentation recommends before forking: a
DataLoader worker forked from the rank (Linux's default start method) no longer copies the pages the collector
would have written to. Nothing here changes what is imported or in what order; an object frozen here that later
becomes cyclic garbage is not freed, which for modules and registrations loaded once per process is moot.
"""

from __future__ import annotations

import gc
import importlib


def import_frozen(*modules: str) -> None:
    """Import `modules` with the collector paused, then freeze everything loaded so far (see above)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        if was_enabled:
            gc.enable()
    gc.freeze()


# What a training rank imports besides torch (run/session.py imports most of it inside its functions, so that
# `--help` and a refusal answer before torch is imported). The local launcher's fork server imports these once
# for every rank it forks (launch/local/forkserver.py): 0.05 CPU-s a rank on the 2-core test machine. Only plain
# modules: importing one reads no environment, working directory or clock, starts no thread and sets no signal
# handler (tests/test_architecture.py), so a rank forked after them is the rank that would have imported them
# itself. One missing here is imported by the rank, as before: a slower start, nothing else.
RANK_MODULES = (
    "hpc_ddp.cli",
    "hpc_ddp.errors",
    "hpc_ddp.cluster.group",
    "hpc_ddp.cluster.placement",
    "hpc_ddp.run.config",
    "hpc_ddp.run.configfile",
    "hpc_ddp.run.quiet",
    "hpc_ddp.run.session",
    "hpc_ddp.run.tasks",
    "hpc_ddp.run.checkpoint.content",
    "hpc_ddp.run.checkpoint.exact",
    "hpc_ddp.run.checkpoint.formats",
    "hpc_ddp.run.checkpoint.resume",
    "hpc_ddp.run.checkpoint.store",
    "hpc_ddp.run.checkpoint.torchfile",
    "hpc_ddp.run.loop.position",
    "hpc_ddp.run.loop.preemption",
    "hpc_ddp.run.loop.rng",
    "hpc_ddp.run.loop.trainer",
    "hpc_ddp.run.records.record",
    "hpc_ddp.run.records.tblog",
    "hpc_ddp.run.snapshot.recover",
    "hpc_ddp.run.strategy.ddp",
    "hpc_ddp.run.watch.watchdog",
    "hpc_ddp.scheduler.slurm.lost",
)


# What every training rank imports of torch: DDP's constructor and the optimizers import torch._dynamo (see above).
TORCH_MODULES = ("torch", "torch._dynamo", "torch.distributed")


def import_torch() -> None:
    """Import what every training rank imports of torch, with the collector paused, then freeze the result."""
    import_frozen(*TORCH_MODULES)


def import_rank() -> None:
    """TORCH_MODULES, then RANK_MODULES, in one paused import: what the fork server holds for the ranks it forks."""
    import_frozen(*TORCH_MODULES, *RANK_MODULES)
