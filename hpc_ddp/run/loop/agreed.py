"""The one all-reduce of every optimizer step, and what every rank learns from it.

One packet of numbers per step carries [loss sum, micro-batches, requeue votes, stop votes, saving trouble,
exhausted streams, callbacks' stop requests, the task's extra metrics]: the loss is averaged over all ranks for reporting, and a signal
seen by any rank stops every rank at the same step, at no extra collective. It comes before the optimizer
step, so a loss that is NaN or infinite on any rank is non-finite in the sum on every rank at the same step,
and its update is never applied (`--nonfinite-loss`: stop, the default, or skip that step).

Every few steps it also carries the straggler windows (hpc_ddp.run.watch.stragglers): each rank writes its row in its
own slot of zeros, so the sum is every rank's row, an all-gather at no collective of its own (issue 41: the
separate all-gather every 5 steps was a quarter of a millisecond of the kit's own work a step on 2 CPU ranks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hpc_ddp.run.checkpoint.checkpointer import SAVING_OK
from hpc_ddp.run.loop import preemption
from hpc_ddp.run.watch import stragglers


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
    halt: float = 0.0  # ranks whose callback asked to stop (hpc_ddp.run.callbacks): this step is not taken
    # Every rank's straggler window, by rank (hpc_ddp.run.watch.stragglers rows), on the steps that carry them.
    rows: tuple[tuple[float, ...], ...] = ()


class Pending:
    """The step's all-reduce in flight (`launch`): [loss sum, the votes, `rows` straggler numbers, the extras];
    `wait` gives what every rank learned."""

    __slots__ = ("packet", "work", "rows")

    def __init__(self, packet: torch.Tensor, work: Any, rows: int) -> None:
        self.packet, self.work, self.rows = packet, work, rows

    def wait(self) -> Agreed:
        self.work.wait()
        values = self.packet.tolist()
        end, size = 7 + self.rows, stragglers.ROW
        rows = tuple(tuple(values[i : i + size]) for i in range(7, end, size))
        loss, count, requeue, stop, saving, exhausted, halt = values[:7]
        return Agreed(loss, count, requeue, stop, saving, exhausted, tuple(values[end:]), halt, rows)


def launch(
    loss_sum: torch.Tensor,
    count: int,
    saving: float,
    exhausted: float,
    extras: Mapping[str, Any],
    names: Sequence[str] | None,
    halt: float = 0.0,
    rows: Sequence[float] = (),
) -> Pending:
    """A collective, started and not waited for: this rank's step (its loss sum over `count` micro-batches, its
    writer's state `saving`, whether its stream is `exhausted`, its `extras` in the order of `names`) and its
    signal votes, summed over every rank.

    The loop starts it after the step's last forward and waits for it after that micro-batch's backward
    (hpc_ddp.run.loop.trainer): everything it carries is known once the loss is, so its latency hides behind the
    backward instead of adding to the step (on 2 CPU ranks with gloo a small all-reduce right after compute
    took about 2 ms of a 25 ms step, issue 41). Every rank starts it at the same point of the same step, so
    the process group's collectives keep one order everywhere (this one, then the backward's). `rows`: this
    rank's straggler window in its slot of every rank's (StepClock.rows), on the steps that gather them."""
    device = loss_sum.device
    requeue, stop = preemption.pending()
    # One host-to-device copy for the numbers this rank knows on its host, the loss and the extras where they
    # are (on the device: no synchronisation here).
    # The straggler rows: this rank's in its own slot, zeros in the others', so the sum is every rank's.
    host = [float(count), float(requeue), float(stop), saving, exhausted, halt, *rows]
    values = [loss_sum.float().reshape(1), torch.tensor(host, device=device)]
    values += [
        torch.as_tensor(extras[name], dtype=torch.float32, device=device).reshape(1) for name in names or ()
    ]
    packet = torch.cat(values)
    return Pending(packet, dist.all_reduce(packet, async_op=True), len(rows))
