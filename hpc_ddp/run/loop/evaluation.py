"""Exact distributed evaluation: every sample counted once, means weighted by samples, the same on every rank.

`DistributedSampler` pads a dataset whose size does not divide the world size by repeating samples (so every
rank gets as many), and `drop_last=True` drops them instead: either way a naive distributed evaluation is not
the evaluation of the dataset. Here rank r takes samples r, r + world, r + 2 world, ... (`shard`): uneven parts,
each sample exactly once, and a rank may get none.

A synchronised model (DDP's buffer broadcast on the first forward after training; FSDP's all-gather on every
forward) needs every rank to call forward the same number of times. So the ranks agree on the largest number of
batches (`agreed_batches`, one all-reduce of one number), and a rank that runs out evaluates a padding batch
(one of its own, or the dataset's first) whose results are dropped (`Means.add(..., samples=0)`).

Weighting, the one rule: an evaluation's value of NAME is sum(total) / sum(weight) over every batch of every
rank that reported NAME, where a batch's `{"NAME": value}` counts as total = value x samples, weight = samples
(a mean over the batch's samples; `samples` is how many items the loader collated into it, whatever the
batch's structure), and `{"NAME": (total, weight)}` brings its own: `(loss_sum, tokens)` gives a token-weighted
mean, exact across ranks and uneven batches. A name no batch reported (or only with weight 0) is missing from
that evaluation: absent from its record, never 0.0. `Means` keeps both sums per name, one all-reduce of them
gives every rank the same result.
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
    """Per name, the sums of totals and of weights over batches; `totals(names)` for the all-reduce, `result`
    after it (see the module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.samples = 0.0

    def add(self, values: Mapping[str, Any], samples: float) -> None:
        """One batch's values, as eval_step returned them, from a batch of `samples` samples (0 for a padding
        batch: nothing of it counts). A ValueError names a value that is not a number or a (total, weight)
        pair, or a weight that is negative or not finite."""
        if samples <= 0:
            return
        self.samples += samples
        for name, value in values.items():
            total, weight = weighed(name, value, samples)
            self.sums[name] = self.sums.get(name, 0.0) + total
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def names(self) -> list[str]:
        return sorted(self.sums)

    def totals(self, names: list[str]) -> list[float]:
        """[samples, then each name's total and weight] in the order of `names` (the same on every rank)."""
        out = [self.samples]
        for n in names:
            out += [self.sums.get(n, 0.0), self.weights.get(n, 0.0)]
        return out

    @staticmethod
    def result(names: list[str], totals: list[float]) -> tuple[int, dict[str, float]]:
        """(samples, {name: sum of totals / sum of weights}) from totals summed over every rank; a name whose
        weights sum to 0 is missing."""
        means = {}
        for i, name in enumerate(names):
            total, weight = totals[1 + 2 * i], totals[2 + 2 * i]
            if weight > 0:
                means[name] = total / weight
        return int(round(totals[0])), means


def _number(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def weighed(name: str, value: Any, samples: float) -> tuple[float, float]:
    """(total, weight) of one batch's `value` of `name` (pure; see the module docstring)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name!r} is a sequence of {len(value)}; a pair is (total, weight)")
        total, weight = _number(value[0]), _number(value[1])
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"{name!r} has the weight {weight}; a weight is a finite number >= 0")
        return total, weight
    return _number(value) * samples, samples


# ----- when the loop evaluates: pure, so every rank decides the same way ------------------------------------
def due_after_step(every_steps: int, step: int, mid_epoch: bool, last: bool, finished: bool) -> bool:
    """After optimizer step `step`: at a step of --eval-every-steps inside an epoch (`mid_epoch`), but not at a
    stream's last step of the epoch (`last`) nor at the run's last step (`finished`): the evaluations after
    the epoch's end and at the end of training come then (`due_after_epoch`)."""
    return bool(every_steps and step % every_steps == 0 and mid_epoch and not last and not finished)


def due_after_epoch(every_epochs: int, every_steps: int, epoch: int, step: int, last: bool) -> bool:
    """At the end of epoch `epoch` (at step `step`): at the end of training (`last`), every `every_epochs`
    (--eval-every-epochs resolved; 0: not by epochs), and at a step of --eval-every-steps (the epoch's last step
    is evaluated here, after the epoch's end)."""
    every_epoch = every_epochs and (epoch + 1) % every_epochs == 0
    every_step = every_steps and step % every_steps == 0
    return bool(last or every_epoch or every_step)
