"""Tasks that draw random numbers where a resume finds it hardest (issue 32), for `--task exact_tasks:NAME`
(tests/ on PYTHONPATH) and for in-process Trainers: augmentation in `__getitem__`, a stream that draws in
`__iter__`, an evaluation that masks its input, BatchNorm.

A stop at a chosen point: EXACT_STOP_STEP=N (the N-th call of the training step in this process, counted from
1: with --grad-accum, a micro-batch) or EXACT_STOP_EVAL=N (the N-th evaluation batch) notes a SIGUSR2 on rank 0
exactly as its handler would (hpc_ddp.run.loop.preemption), once per EXACT_STOP_MARK (a file path prefix: a resumed
run, whose counts start again, does not stop again)."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from hpc_ddp import Task
from hpc_ddp.run.data import streams
from hpc_ddp.run.loop import preemption

_calls = {"step": 0, "eval": 0}


def stop_once(kind: str) -> None:
    _calls[kind] += 1
    at, mark = os.environ.get(f"EXACT_STOP_{kind.upper()}"), os.environ.get("EXACT_STOP_MARK")
    if not at or not mark or os.environ.get("RANK", "0") != "0" or _calls[kind] != int(at):
        return
    if not os.path.exists(mark + kind):
        open(mark + kind, "w").close()
        preemption._note(signal.SIGUSR2, None)


def _pairs(seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


class Augmented(Dataset):
    """Map-style: each sample gets noise from torch's, Python's and NumPy's generators (random augmentation)."""

    def __init__(self, seed: int, samples: int) -> None:
        self.x, self.y = _pairs(seed, samples)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.randn(8) + 0.01 * random.random() + 0.01 * float(np.random.rand())
        return self.x[i] + noise, self.y[i]


class DrawingStream(IterableDataset):
    """A stream with state: each reader (rank x worker) its every count-th sample; each item drawn a noise in
    `__iter__`. Its state is the index of its next item."""

    def __init__(self, seed: int, samples: int) -> None:
        self.x, self.y = _pairs(seed, samples)
        self.next, self.resume_at = 0, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        index, count = streams.reader()
        mine = list(range(index, len(self.x), count))
        start, self.resume_at = self.resume_at, 0
        for k in range(start, len(mine)):
            self.next = k + 1
            i = mine[k]
            yield self.x[i] + 0.1 * torch.randn(8), self.y[i]

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["next"]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    stop_once("step")
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Masks a tenth of the input at random (a draw in the evaluation), and reports one draw as `draw`."""
    stop_once("eval")
    x, y = batch
    mask = (torch.rand_like(x) > 0.1).float()
    return {"mse": nn.functional.mse_loss(model(x * mask), y), "draw": torch.rand(())}


def _reset() -> None:
    _calls.update(step=0, eval=0)


def _drawing(config, dataset, **more):  # type: ignore[no-untyped-def]
    """A task on `dataset` whose evaluation (24 augmented samples) draws."""
    _reset()
    eval_set = Augmented(config.seed + 1, 24)
    return Task(
        model=_model(), dataset=dataset, step=step, eval_dataset=eval_set, eval_step=eval_step, **more
    )


def augmented(config):  # type: ignore[no-untyped-def]
    """96 augmented training samples, 24 augmented evaluation samples, an evaluation that draws."""
    return _drawing(config, Augmented(config.seed, 96))


def drawing_stream(config):  # type: ignore[no-untyped-def]
    """A stream of 120 samples that draws in `__iter__` (state_dict too), an evaluation that draws."""
    return _drawing(config, DrawingStream(config.seed, 120))


class Normed(nn.Module):
    """Two blocks (an nn.ModuleList: fsdp shards each) with BatchNorm: running statistics are buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Sequential(nn.Linear(16, 1))]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def plain_eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    x, y = batch
    return {"mse": nn.functional.mse_loss(model(x), y)}


def batchnorm(config):  # type: ignore[no-untyped-def]
    """BatchNorm (each rank's batches move its running statistics), an evaluation that reads them."""
    _reset()
    x, y = _pairs(config.seed, 96)
    ex, ey = _pairs(config.seed + 1, 24)
    return Task(
        model=Normed(),
        dataset=torch.utils.data.TensorDataset(x, y),
        step=step,
        eval_dataset=torch.utils.data.TensorDataset(ex, ey),
        eval_step=plain_eval_step,
    )


class Lengths(Dataset):
    """Sample i of `samples`: {"id": i, "length": 1 + i % 5 (a sequence of that many tokens, each of value
    i), "x", "y"}."""

    def __init__(self, seed: int, samples: int) -> None:
        self.x, self.y = _pairs(seed, samples)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "length": 1 + i % 5, "x": self.x[i], "y": self.y[i]}


def scaled_collate(items: list[dict]) -> dict:
    """A 0-dim tensor first (a temperature, a scale): no batch dimension to count samples by."""
    return {
        "scale": torch.tensor(1.0),
        "id": torch.tensor([it["id"] for it in items], dtype=torch.float64),
        "length": torch.tensor([it["length"] for it in items], dtype=torch.float64),
        "x": torch.stack([it["x"] for it in items]),
        "y": torch.stack([it["y"] for it in items]),
    }


def dict_step(model: nn.Module, batch: dict) -> torch.Tensor:
    return step(model, (batch["x"], batch["y"]))


def weighted_eval_step(model: nn.Module, batch: dict) -> dict:
    """`id_mean`: a mean over the batch's samples (18 over all 37); `per_token`: the token-weighted mean of
    the ids, as (sum, tokens); `rare`: reported by the first evaluation's batches only."""
    _calls["eval"] += 1
    ids, lengths = batch["id"], batch["length"]
    out = {"id_mean": ids.mean() * batch["scale"], "per_token": ((ids * lengths).sum(), lengths.sum())}
    if _calls["eval"] <= 5:  # 37 samples in batches of 8: the first evaluation's 5 batches
        out["rare"] = 1.0
    return out


def weighted(config):  # type: ignore[no-untyped-def]
    """Dict batches with a 0-dim tensor first; an evaluation of 37 samples weighted three ways."""
    _reset()
    return Task(
        model=_model(),
        dataset=Lengths(config.seed, 32),
        step=dict_step,
        eval_dataset=Lengths(config.seed + 1, 37),
        eval_step=weighted_eval_step,
        collate_fn=scaled_collate,
    )


def _warmup_cosine(optimizer, total):  # type: ignore[no-untyped-def]
    """Warm-up for 2 steps, then cosine to 0 at `total` (the issue's case: total 0 trained at lr 0)."""
    import math

    def factor(s: int) -> float:
        return min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _annealing(optimizer, total):  # type: ignore[no-untyped-def]
    """Fails only at its first step when total is None (its construction does not read it)."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)


def stream_schedule(config):  # type: ignore[no-untyped-def]
    """A stream with a schedule of its own that needs the run's total (SCHEDULE: warmup_cosine|annealing)."""
    _reset()
    make = _warmup_cosine if os.environ.get("SCHEDULE", "warmup_cosine") == "warmup_cosine" else _annealing
    return Task(model=_model(), dataset=DrawingStream(config.seed, 120), step=step, scheduler=make)


def _plateau(optimizer, total):  # type: ignore[no-untyped-def]
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)


def plateau(config):  # type: ignore[no-untyped-def]
    """ReduceLROnPlateau on the evaluation's `draw` (mode max: it halves the rate whenever a draw is not a
    new maximum), with the augmented data and the evaluation that draws."""
    return _drawing(config, Augmented(config.seed, 96), scheduler=_plateau)


def plateau_without_eval(config):  # type: ignore[no-untyped-def]
    _reset()
    return Task(model=_model(), dataset=Augmented(config.seed, 96), step=step, scheduler=_plateau)


def no_grad_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return step(model, batch)


def no_grad_loss(config):  # type: ignore[no-untyped-def]
    _reset()
    return Task(model=_model(), dataset=Augmented(config.seed, 96), step=no_grad_step)
