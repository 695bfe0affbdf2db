"""User tasks for the Task API tests (`--task model_tasks:NAME`, tests/ on PYTHONPATH): dict batches through a
collate_fn, a step of one's own with extra metrics, schedules, evaluation, and the bad inputs of issue 19."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from hpc_ddp import Task
from hpc_ddp.run.data import streams


class Pairs(Dataset):
    """Sample i: {"x": 10 features, "y": their sum (noisy), "id": i}, the same on every rank (seeded)."""

    def __init__(self, seed: int, samples: int = 256) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, 10, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=gen)
        self.epochs: list[int] = []  # set_epoch calls (the loop makes them)

    def __len__(self) -> int:
        return len(self.x)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        if os.environ.get("RANK") == "0" and epoch == 1:
            print(f"set_epoch calls: {self.epochs}", flush=True)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "id": i}


def collate(items: list[dict]) -> dict:
    return {
        "x": torch.stack([it["x"] for it in items]),
        "y": torch.stack([it["y"] for it in items]),
        "id": torch.tensor([it["id"] for it in items]),
    }


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))


def step(model: nn.Module, batch: dict):  # type: ignore[no-untyped-def]
    time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))  # lets a test's signal land mid-run
    out = model(batch["x"])
    loss = nn.functional.mse_loss(out, batch["y"])
    return loss, {"mae": (out - batch["y"]).abs().mean(), "half": 0.5}


def eval_step(model: nn.Module, batch: dict) -> dict:
    mark = os.environ.get("EVAL_MARK")  # a test's signal lands during this evaluation: it waits for the file
    if mark and os.environ.get("RANK") == "0" and not os.path.exists(mark):
        open(mark, "w").close()
    time.sleep(float(os.environ.get("EVAL_SLEEP_S", "0")))
    out = model(batch["x"])
    # `id_mean`: the mean of the evaluated sample ids; over a dataset of n samples, each once, it is (n - 1) / 2
    ids = batch["id"].double()
    # `size`: the batch's size; its mean over samples is sum(size^2) / n, which tells the batches apart
    return {
        "mse": nn.functional.mse_loss(out, batch["y"]),
        "id_mean": ids.mean(),
        "id_sq": (ids**2).mean(),
        "size": float(len(ids)),
    }


def dicts(config):  # type: ignore[no-untyped-def]
    """Dict batches, a step of its own with two extra metrics, momentum, an evaluation set of 37 samples."""
    return Task(
        model=_model(),
        dataset=Pairs(config.seed),
        step=step,
        optimizer=lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
        collate_fn=collate,
        eval_dataset=Pairs(config.seed + 1, int(os.environ.get("EVAL_SAMPLES", "37"))),
        eval_step=eval_step,
    )


def step_with_draws(model: nn.Module, batch: dict):  # type: ignore[no-untyped-def]
    """`step`, plus one draw from Python's `random` and one from NumPy's global generator, recorded: what a
    transform or a step of a user's own would draw (the kit seeds both with --seed and checkpoints both)."""
    loss, metrics = step(model, batch)
    return loss, {**metrics, "py_draw": random.random(), "np_draw": float(np.random.rand())}


def scheduled(config):  # type: ignore[no-untyped-def]
    """The task's own scheduler (warm-up then step decay), dict batches, a step that draws from Python's and
    NumPy's generators."""

    def scheduler(optimizer, total):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** (s // 8))

    task = dicts(config)
    task.scheduler = scheduler
    task.step = step_with_draws
    return task


def bad_batch(config):  # type: ignore[no-untyped-def]
    def with_tags(items: list[dict]) -> dict:
        batch = collate(items)
        batch["tags"] = {"a", "b"}
        return batch

    return Task(model=_model(), dataset=Pairs(config.seed), step=step, collate_fn=with_tags)


def dict_to_loss_fn(config):  # type: ignore[no-untyped-def]
    return Task(
        model=_model(), dataset=Pairs(config.seed), loss_fn=nn.functional.mse_loss, collate_fn=collate
    )


def nonscalar(config):  # type: ignore[no-untyped-def]
    def per_sample(model: nn.Module, batch: dict) -> torch.Tensor:
        return (model(batch["x"]) - batch["y"]) ** 2

    return Task(model=_model(), dataset=Pairs(config.seed), step=per_sample, collate_fn=collate)


def names_differ(config):  # type: ignore[no-untyped-def]
    """Rank 1's step returns another metric name than rank 0's: the values would be summed by position."""

    def uneven(model: nn.Module, batch: dict):  # type: ignore[no-untyped-def]
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        return loss, {"mae" if os.environ.get("RANK") == "0" else "mse": loss.detach()}

    return Task(model=_model(), dataset=Pairs(config.seed), step=uneven, collate_fn=collate)


def both(config):  # type: ignore[no-untyped-def]
    return Task(
        model=_model(),
        dataset=Pairs(config.seed),
        step=step,
        loss_fn=nn.functional.mse_loss,
        collate_fn=collate,
    )


def scheduler_raises(config):  # type: ignore[no-untyped-def]
    def scheduler(optimizer, total):  # type: ignore[no-untyped-def]
        raise ValueError("warm-up longer than the run")

    task = dicts(config)
    task.scheduler = scheduler
    task.step = step_with_draws
    return task


class Stream(torch.utils.data.IterableDataset):
    """Reader r of the stream (streams.reader) yields 40 + 8 r samples: ranks' streams end at different steps."""

    def __init__(self, seed: int) -> None:
        self.pairs = Pairs(seed)

    def __iter__(self):  # type: ignore[no-untyped-def]
        index, count = streams.reader()
        mine = list(streams.take(range(len(self.pairs)), index, count))[: 40 + 8 * index]
        for i in mine:
            yield self.pairs[i]


def iterable(config):  # type: ignore[no-untyped-def]
    return Task(model=_model(), dataset=Stream(config.seed), step=step, collate_fn=collate)


class CountingStream(Stream):
    """A stream that knows where it is: state_dict() is the index of its next sample in this epoch."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.next, self.resume_at = 0, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        index, count = streams.reader()
        mine = list(streams.take(range(len(self.pairs)), index, count))[: 40 + 8 * index]
        start, self.resume_at = self.resume_at, 0  # a new iterator starts the epoch over, unless loaded
        self.next = start
        for k in range(start, len(mine)):
            self.next = k + 1
            yield self.pairs[mine[k]]

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["next"]  # called before the epoch's iterator is made


def stateful_stream(config):  # type: ignore[no-untyped-def]
    return Task(
        model=_model(),
        dataset=CountingStream(config.seed),
        step=step,
        collate_fn=collate,
        optimizer=lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
    )


class EvalStream(torch.utils.data.IterableDataset):
    """An evaluation stream of `samples` Pairs whose readers' parts are uneven on purpose: sample i goes to
    reader min(i // 12, last), where `last` is the last reader but one when there are 3 or more (the last
    reader's part is then empty). 37 samples: 1 reader 37; 2 readers 12 + 25; 3 readers 12 + 25 + 0."""

    def __init__(self, seed: int, samples: int) -> None:
        self.pairs = Pairs(seed, samples)

    def __iter__(self):  # type: ignore[no-untyped-def]
        index, count = streams.reader()
        last = count - 2 if count >= 3 else count - 1
        for i in range(len(self.pairs)):
            if min(i // 12, last) == index:
                yield self.pairs[i]


def stream_eval(config):  # type: ignore[no-untyped-def]
    """The dicts task with its evaluation set as a stream of uneven parts."""
    task = dicts(config)
    task.eval_dataset = EvalStream(config.seed + 1, int(os.environ.get("EVAL_SAMPLES", "37")))
    return task
