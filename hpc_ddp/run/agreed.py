"""The one all-reduce of every optimizer step, and what every rank learns from it.

One packet of numbers per step carries [loss sum, micro-batches, requeue votes, stop votes, saving trouble,
exhausted streams, the task's extra metrics]: the loss is averaged over all ranks for reporting, and a signal
seen by any rank stops every rank at the same step, at no extra collective. It comes before the optimizer
step, so a loss that is NaN or infinite on any rank is non-finite in the sum on every rank at the same step,
and its update is never applied (`--nonfinite-loss`: stop, the default, or skip that step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hpc_ddp.run import preemption
from hpc_ddp.run.checkpointer import SAVING_OK


class Agreed(NamedTuple):
    """What the per-step all-reduce returns: this step's numbers summed over every rank."""

    loss_sum: float  # the micro-batch losses of the step
    count: float  # the micro-batches
    requeue: float  # ranks that saw SIGUSR1/SIGUSR2 (their votes to stop and requeue)
    stop: float  # ranks that saw SIGTERM (their votes to stop)
    saving: float = SAVING_OK  # some rank's writer gave up (checkpointer.SAVING_*)
    exhausted: float = 0.0  # ranks whose stream has no next step (an IterableDataset): the epoch ends here
    extras: tuple[
        float, ...
    ] = ()  # the step's extra metrics (Task.step), summed over micro-batches and ranks


def agree(
    loss_sum: torch.Tensor,
    count: int,
    saving: float,
    exhausted: float,
    extras: Mapping[str, Any],
    names: Sequence[str],
) -> Agreed:
    """A collective: this rank's step (its loss sum over `count` micro-batches, its writer's state `saving`,
    whether its stream is `exhausted`, its `extras` in the order of `names`) and its signal votes, summed over
    every rank."""
    device = loss_sum.device
    requeue, stop = preemption.pending()
    packet = torch.stack(
        [
            loss_sum.float(),
            torch.tensor(float(count), device=device),
            torch.tensor(float(requeue), device=device),
            torch.tensor(float(stop), device=device),
            torch.tensor(saving, device=device),
            torch.tensor(exhausted, device=device),
            *(torch.as_tensor(extras[name], dtype=torch.float32, device=device) for name in names),
        ]
    )
    dist.all_reduce(packet)
    values = packet.tolist()
    return Agreed(values[0], values[1], values[2], values[3], values[4], values[5], tuple(values[6:]))
