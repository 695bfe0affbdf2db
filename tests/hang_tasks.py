"""User tasks that hang or lag on one rank, for the hang watchdog's tests: `--task hang_tasks:NAME`.

Which rank and step come from HANG_RANK (default 1) and HANG_STEP (default 3): the rank stops there for an
hour, after printing `stuck now` (so a test can time the detection from that moment).
"""

from __future__ import annotations

import os
import time

import torch
from slow_tasks import _data
from torch import nn
from torch.utils.data import Dataset

from hpc_ddp import Task

RANK = int(os.environ.get("HANG_RANK", "1"))
STEP = int(os.environ.get("HANG_STEP", "3"))


def _me() -> bool:
    return int(os.environ.get("RANK", "0")) == RANK


def _stuck() -> None:
    print(f"[rank {os.environ.get('RANK', '0')}] stuck now", flush=True)
    time.sleep(3600)


def in_loss(config):  # type: ignore[no-untyped-def]
    """The chosen rank stops in its loss function on its STEP-th call."""
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if _me() and calls[0] == STEP:
            _stuck()
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


class _Slow(Dataset):  # type: ignore[type-arg]
    """A dataset whose __getitem__ stalls for good on the chosen rank (in a DataLoader worker, if any), or
    takes `delay` seconds per sample there."""

    def __init__(self, seed: int, delay: float | None) -> None:
        self.data, self.delay, self.calls = _data(seed), delay, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        self.calls += 1
        if _me():
            if self.delay is None and self.calls == STEP * 32:  # inside the STEP-th batch of 32
                _stuck()
            elif self.delay:
                time.sleep(self.delay)
        return self.data[index]


def in_getitem(config):  # type: ignore[no-untyped-def]
    return Task(model=nn.Linear(10, 1), dataset=_Slow(config.seed, None), loss_fn=nn.functional.mse_loss)


def straggler(config):  # type: ignore[no-untyped-def]
    """Every sample costs 1 ms on every rank, 3 ms on the chosen one: 3x slower data loading."""
    delay = float(os.environ.get("STRAGGLER_DELAY_S", "0.001"))

    class Data(_Slow):
        def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
            time.sleep(delay * (3 if _me() else 1))
            return self.data[index]

    return Task(model=nn.Linear(10, 1), dataset=Data(config.seed, 0.0), loss_fn=nn.functional.mse_loss)


def slow_start_and_save(config):  # type: ignore[no-untyped-def]
    """Healthy, but its first step takes SLOW_S seconds and so does every read of the model's state on rank 0
    (a checkpoint save, the model.pth export), or, with SLOW_SAVES set, its first SLOW_SAVES once training
    has begun."""
    slow = float(os.environ.get("SLOW_S", "3"))
    slow_saves = int(os.environ.get("SLOW_SAVES", "-1"))  # -1: every one
    calls, saves = [0], [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(slow)
        return nn.functional.mse_loss(output, target)

    model = nn.Linear(10, 1)

    def slow_save(*_: object) -> None:
        if os.environ.get("RANK") != "0":
            return
        if slow_saves >= 0:  # counted from the first step on (the kit reads the state before training too)
            if calls[0] == 0 or saves[0] >= slow_saves:
                return
            saves[0] += 1
        time.sleep(slow)

    model.register_state_dict_pre_hook(slow_save)
    return Task(model=model, dataset=_data(config.seed), loss_fn=loss_fn)


def slow_workers(config):  # type: ignore[no-untyped-def]
    """Healthy, but each DataLoader worker takes SLOW_S seconds before its first sample (opening its shards):
    every epoch's first batch is slow when workers start again, as they do without persistent workers."""
    slow = float(os.environ.get("SLOW_S", "3"))

    class Data(_Slow):
        def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
            if not getattr(self, "opened", False):  # per process: a worker's own copy of the dataset
                time.sleep(slow)
                self.opened = True
            return self.data[index]

    return Task(model=nn.Linear(10, 1), dataset=Data(config.seed, 0.0), loss_fn=nn.functional.mse_loss)


def slow_everywhere(config):  # type: ignore[no-untyped-def]
    """Every rank runs long work of its own in the loss function: at call 3 marked with hpc_ddp.long_work
    (LONG_S seconds, within its limit), at call 5 unmarked (then it prints `stuck now` and sleeps an hour)."""
    import hpc_ddp

    calls = [0]

    def periodic_callback(seconds: float) -> None:
        time.sleep(seconds)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            with hpc_ddp.long_work("the periodic callback", limit_s=120):
                periodic_callback(float(os.environ.get("LONG_S", "8")))
        if calls[0] == 5:
            print(f"[rank {os.environ.get('RANK', '0')}] stuck now", flush=True)
            periodic_callback(3600)
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)
