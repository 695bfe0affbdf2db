"""User tasks that fail the way real jobs fail, for the retry tests: `--task retry_tasks:NAME`.

`node_fault` raises a GPU hardware error on one node only (the node, or the comma-separated nodes, named by
RETRY_BAD_NODE, as Slurm names them in SLURMD_NODENAME), as a rank on a broken GPU does: the job must exclude that node and finish elsewhere.
`fails_everywhere` raises the same error on every attempt before any checkpoint: a crash loop.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from slow_tasks import _data
from hpc_ddp import Task


def _failing(config, should_fail, error):  # type: ignore[no-untyped-def]
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3 and should_fail():
            raise error(calls[0])
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


def node_fault(config):  # type: ignore[no-untyped-def]
    bad = os.environ.get("RETRY_BAD_NODE", "").split(",")  # one node, or several: node2,node3
    return _failing(config, lambda: os.environ.get("SLURMD_NODENAME") in bad,
                    lambda _n: RuntimeError("CUDA error: uncorrectable ECC error encountered"))


def fails_everywhere(config):  # type: ignore[no-untyped-def]
    return _failing(config, lambda: os.environ.get("RANK") == "1",
                    lambda n: ValueError(f"bad batch at call {n} (tests/retry_tasks.py:fails_everywhere)"))
