"""The task shapes of the resume check's property test (tests/test_resume_matrix.py): `--task matrix_tasks:build`,
its shape from MATRIX_* variables (the same for every start of a run, as a task's config would be).

    MATRIX_DATA   map (a map-style Dataset) or stream (an IterableDataset with state_dict()/load_state_dict())
    MATRIX_AUG    1: random augmentation while making each sample (torch's generator: in the rank, or in the
                  DataLoader worker that makes it)
    MATRIX_BN     1: a BatchNorm layer (running statistics: buffers)
    MATRIX_EVAL   1: an evaluation set, with an eval_step that draws random numbers (masking)

Workers, --grad-accum, the strategy and --keep-best are the run's options. The model's blocks sit in an
nn.ModuleList (what fsdp shards), with dropout (the training's RNG).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from hpc_ddp import Task
from hpc_ddp.run.data import streams

FEATURES = 8


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


def _samples(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=gen)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(count, 1, generator=gen)


def _augment(x: torch.Tensor) -> torch.Tensor:
    return x + 0.05 * torch.randn(x.shape) if _flag("MATRIX_AUG") else x


class Pairs(Dataset):
    def __init__(self, seed: int, count: int, augment: bool) -> None:
        self.x, self.y = _samples(seed, count)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (_augment(self.x[i]) if self.augment else self.x[i]), self.y[i]


class PairStream(IterableDataset):
    """Each reader's part of the samples, augmented as they are made; its state: how many it has given this
    epoch (so a resume goes on from there)."""

    def __init__(self, seed: int, count: int) -> None:
        self.x, self.y = _samples(seed, count)
        self.given = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        index, count = streams.reader()
        part = list(range(index, len(self.x), count))
        for i in part[self.given :]:
            self.given += 1
            yield _augment(self.x[i]), self.y[i]
        self.given = 0

    def state_dict(self) -> dict:
        return {"given": self.given}

    def load_state_dict(self, state: dict) -> None:
        self.given = int(state["given"])


class Net(nn.Module):
    def __init__(self, batch_norm: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.norm = nn.BatchNorm1d(16) if batch_norm else nn.Identity()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.ReLU()) for _ in range(2)
        )
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.inp(x))
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    x, y = batch
    keep = (torch.rand(x.shape) > 0.2).float()  # masking: an evaluation that draws random numbers
    out = model(x * keep)
    return {"loss": nn.functional.mse_loss(out, y), "mae": (out - y).abs().mean()}


def build(config):  # type: ignore[no-untyped-def]
    stream = os.environ.get("MATRIX_DATA", "map") == "stream"
    data = PairStream(config.seed, 256) if stream else Pairs(config.seed, 256, _flag("MATRIX_AUG"))
    task = Task(
        model=Net(_flag("MATRIX_BN")),
        dataset=data,
        step=step,
        optimizer=lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
    )
    if _flag("MATRIX_EVAL"):
        task.eval_dataset = Pairs(config.seed + 1, 48, augment=False)
        task.eval_step = eval_step
    return task
