"""Exact distributed evaluation: every sample counted once, means weighted by samples, the same on every rank.

`DistributedSampler` pads a dataset whose size does not divide the world size by repeating samples (so every
rank gets as many), and `drop_last=True` drops them instead: either way a naive distributed evaluation is not
the evaluation of the dataset. Here rank r takes samples r, r + world, r + 2 world, ... (`shard`): uneven parts,
each sample exactly once, and a rank may get none.

A synchronised model (DDP's buffer broadcast on the first forward after training; FSDP's all-gather on every
forward) needs every rank to call forward the same number of times. So the ranks agree on the largest number of
batches (`agreed_batches`, one all-reduce of one number), and a rank that runs out evaluates a padding batch
(one of its own, or the dataset's first) whose results are dropped (`Means.add(..., weight=0)`).

Means: each `eval_step` returns per-batch means; `Means` keeps sum(value x samples) and sum(samples) per name,
and one all-reduce of those sums gives every rank the same means over all evaluated samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def shard(size: int, rank: int, world: int) -> range:
    """The indices rank `rank` evaluates: every `world`-th from `rank`. Together, each index exactly once."""
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return range(rank, size, world)


def batches_of(count: int, batch_size: int) -> int:
    """Batches of `count` samples, the last one possibly smaller (nothing dropped)."""
    return -(-count // batch_size)


class Means:
    """Weighted sums of named values over batches; `totals(names)` for the all-reduce, `result` after it."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.samples = 0.0

    def add(self, values: Mapping[str, Any], weight: float) -> None:
        """One batch's means (`values`, as eval_step returned them), counted `weight` times (its samples; 0
        for a padding batch)."""
        if weight <= 0:
            return
        self.samples += weight
        for name, value in values.items():
            number = float(value.item() if hasattr(value, "item") else value)
            self.sums[name] = self.sums.get(name, 0.0) + number * weight

    def totals(self, names: list[str]) -> list[float]:
        """[samples, sum of each name...] in the order of `names` (the same order on every rank)."""
        return [self.samples, *(self.sums.get(n, 0.0) for n in names)]

    @staticmethod
    def result(names: list[str], totals: list[float]) -> tuple[int, dict[str, float]]:
        """(samples, {name: mean over all samples}) from totals summed over every rank."""
        samples = totals[0]
        means = {n: (t / samples if samples else math.nan) for n, t in zip(names, totals[1:], strict=True)}
        return int(round(samples)), means
