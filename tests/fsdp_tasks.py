"""Tasks for the --strategy fsdp tests (`--task fsdp_tasks:NAME`, tests/ on PYTHONPATH): a tiny model whose
blocks sit in an nn.ModuleList (what fsdp shards by default), with dropout (its RNG must resume too), momentum
(optimizer state) and a scheduler. The model is given as a factory (the class): fsdp builds it on the meta
device and the kit sets its initial weights (hpc_ddp.run.loop.materialize)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from hpc_ddp import Task
from hpc_ddp.run.tasks import _synthetic_regression


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Dropout(0.1), nn.ReLU()) for _ in range(depth)
        )
        self.out = nn.Linear(width, 1)
        # Two probes of weight decay (issue 37 item 1): in the forward with a zero weight, so their gradient is
        # zero and only a decay can move them. `no_dropout`'s optimizer decays one of them, by name.
        self.norm_scale = nn.Parameter(torch.full((4,), 0.5))
        self.decayed = nn.Parameter(torch.full((4,), 0.5))

    def reset_parameters(
        self,
    ) -> None:  # its own tensors only: the kit sets each module's (run/loop/materialize.py)
        nn.init.constant_(self.norm_scale, 0.5)
        nn.init.constant_(self.decayed, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x) + 0.0 * (self.norm_scale.sum() + self.decayed.sum())


def blocks(config):  # type: ignore[no-untyped-def]
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))  # lets a test's signal land mid-run
        return nn.functional.mse_loss(out, y)

    return Task(
        model=Blocks,
        dataset=_synthetic_regression(256, 10, 1, config.seed),
        loss_fn=loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
        scheduler=lambda opt, total: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.95**s),
    )


def without_dropout() -> Blocks:
    model = Blocks()
    for layer in model.layers:
        layer[1].p = 0.0
    return model


def no_dropout(config):  # type: ignore[no-untyped-def]
    """The same without dropout: fsdp and ddp draw the same numbers only where no RNG is involved. Its optimizer
    has two groups by parameter name (the factory's `params.named()`): weight decay for all but the biases and
    the norm's scale. With $INITIAL_OUT, rank 0 writes there the initial parameters, whole, as the optimizer is
    built (in model order: under fsdp each is gathered from every rank's shard, a collective every rank makes
    at that moment)."""
    task = blocks(config)
    task.model = without_dropout

    def optimizer(params):  # type: ignore[no-untyped-def]
        named = params.named()
        keep = [p for n, p in named if n.endswith("bias") or "norm" in n]
        decay = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": keep, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=config.lr, momentum=0.9)

    task.optimizer = optimizer
    out = os.environ.get("INITIAL_OUT")
    if out:

        def dumping(params):  # type: ignore[no-untyped-def]
            import torch.distributed as dist
            from torch.distributed.tensor import DTensor

            whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
            if dist.get_rank() == 0:
                torch.save([t.detach().cpu().clone() for t in whole], out)
            return optimizer(params)

        task.optimizer = dumping
    return task


def big(config):  # type: ignore[no-untyped-def]
    """Wide blocks (about 17 M parameters, a checkpoint of ~130 MB with momentum): a save lasts long enough
    for a test to kill a rank in the middle of it."""
    task = blocks(config)
    task.model = lambda: Blocks(width=1024, depth=8)
    return task


def flaky_rank(config):  # type: ignore[no-untyped-def]
    """On rank $FLAKY_RANK only, the first $FLAKY_SAVES checkpoint writes fail with ENOSPC (a full local
    disk freed later): every rank must agree to retry, or the others would wait in DCP for it."""
    import errno

    from hpc_ddp.run.checkpoint import torchfile

    failures = [
        int(os.environ.get("FLAKY_SAVES", "0"))
        if os.environ.get("RANK") == os.environ.get("FLAKY_RANK")
        else 0
    ]
    real = torchfile._save_stream

    def save_stream(obj, out):  # type: ignore[no-untyped-def]
        if failures[0] > 0 and "ckpt-" in out.name:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", out.name)
        return real(obj, out)

    torchfile._save_stream = save_stream
    return blocks(config)


HUGE_WIDTH, HUGE_DEPTH = 4096, 24  # 24 blocks of Linear(4096, 4096): 402,800,641 parameters, 1.61 GB in fp32


def huge(config):  # type: ignore[no-untyped-def]
    """About 400 M parameters, given as a factory (built on the meta device under fsdp), plain SGD (no state):
    each rank writes its own peak resident memory (getrusage's ru_maxrss, a maximum the kernel keeps) to
    `<folder>/peak-rss-<rank>` whenever it grows, checked every 20 ms, so the file holds the rank's peak up
    to moments before it exits (the kit's ranks leave with os._exit: no atexit)."""
    import resource
    import threading
    from pathlib import Path

    path = Path(config.folder) / f"peak-rss-{os.environ.get('SLURM_PROCID', '0')}"

    def watch() -> None:
        written = -1
        while True:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
            if peak != written:
                path.with_suffix(".tmp").write_text(str(peak))
                os.replace(path.with_suffix(".tmp"), path)
                written = peak
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    x = torch.randn(8, 10, generator=torch.Generator().manual_seed(config.seed))
    return Task(
        model=lambda: Blocks(width=HUGE_WIDTH, depth=HUGE_DEPTH),
        dataset=torch.utils.data.TensorDataset(x, x[:, :1]),
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(
            params, lr=1e-9
        ),  # 24 residual blocks: a larger step explodes
    )
