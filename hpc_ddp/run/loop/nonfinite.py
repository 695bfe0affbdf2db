"""A step whose loss, averaged over all ranks, is NaN or infinite (every rank sees the same value): its update
is never applied (hpc_ddp.run.loop.agreed). `--nonfinite-loss stop` (the default) ends the run there, with one line
that says what is left; `skip` goes on without that update, and still stops after MAX_SKIPPED in a row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import NonFinite
from hpc_ddp.log import RankLog
from hpc_ddp.run.folder import MODEL
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.watch import beacon as phase
from hpc_ddp.run.watch.beacon import Beacon

MAX_SKIPPED = 10  # --nonfinite-loss skip: this many non-finite steps in a row stop the run anyway


def shown(loss: float) -> str:
    return "NaN" if math.isnan(loss) else ("+inf" if loss > 0 else "-inf")


def skips(policy: str, skipped: int) -> bool:
    """Whether the run goes on without this step's update, after `skipped` such steps in a row."""
    return policy == "skip" and skipped < MAX_SKIPPED


def skipped_line(where: str, value: str, skipped: int) -> str:
    return (
        f"{where}: the loss averaged over all ranks is {value}; that step's update was skipped "
        f"(--nonfinite-loss skip; {skipped} in a row, the run stops at {MAX_SKIPPED + 1})"
    )


def stop_message(where: str, value: str, skipped: int, world_size: int, broken: list[str], kept: str) -> str:
    """Why the run stops here: the step (`where`), the loss (`value`), the steps skipped before it in a row and
    the parameters that are not finite (`broken`, asked only after skipped steps), and what is left (`kept`)."""
    if skipped:
        names = ", ".join(broken[:3]) + (", ..." if len(broken) > 3 else "")
        weights = (
            f"the weights themselves are not finite ({names})"
            if broken
            else "the weights are finite (none of those updates was applied): the data or the loss "
            "function gives it"
        )
        cause = (
            f"{where}: the loss averaged over all ranks was not finite in {skipped + 1} steps in a "
            f"row ({value} now); {weights}"
        )
    else:
        cause = (
            f"{where}: the loss averaged over all {world_size} ranks is {value} (a rank's loss "
            "or data became NaN/inf, or the learning rate is too high)"
        )
    return (
        f"{cause}. The run stopped before applying that update and saved nothing after the last "
        f"finite step ({kept}). Fix: check the data, a smaller --lr or --clip-grad; "
        "--nonfinite-loss skip drops such steps instead"
    )


class Guard:
    """What a step whose agreed loss is not finite does (`nonfinite`: stop, or skip under --nonfinite-loss skip),
    and how many such steps came in a row (`skipped`; a finite step sets it back to 0: `finite`)."""

    def __init__(
        self, policy: str, env: DistEnv, log: RankLog, metrics: Any, strategy: Any, checkpointer: Any
    ) -> None:
        self.policy, self.env, self.log = policy, env, log
        self.metrics, self.strategy, self.checkpointer = metrics, strategy, checkpointer
        self.skipped = 0

    def finite(self) -> None:
        self.skipped = 0

    def nonfinite(self, loss: float, step: int, pos: Position, folder: Path, beacon: Beacon) -> None:
        """Every rank alike, the loss of `step` not finite: go on without its update (skip), or stop (raise
        NonFinite), having said what is left (the save in flight waited for) and recorded the stop."""
        value, where = shown(loss), f"step {step} (epoch {pos.epoch})"
        if skips(self.policy, self.skipped):
            self.skipped += 1
            if self.env.is_main:
                self.log.warn(skipped_line(where, value, self.skipped))
            return
        left = kept(self.checkpointer, folder, self.env, beacon)  # the same words on every rank
        # The run stops here, whatever --nonfinite-loss says: the run's last record, after that save's.
        self.metrics.nonfinite(pos, step, "stop")
        broken = self.strategy.nonfinite_parameters() if self.skipped else []  # every rank is here
        raise NonFinite(stop_message(where, value, self.skipped, self.env.world_size, broken, left))


def kept(checkpointer: Any, folder: Path, env: DistEnv, beacon: Beacon) -> str:
    """What the stop leaves, in the same words on every rank (a collective): rank 0 first waits for the
    write in flight, so that the checkpoint it names is durable (and one that just became so is named)."""
    import torch.distributed as dist

    beacon.set(phase.CHECKPOINT)  # the others wait for rank 0's write: no hang
    words: list[Any] = [None]
    if env.is_main:
        last = checkpointer.last_durable()
        text = f"the last checkpoint, {last.name}, is kept" if last else "no checkpoint was written"
        if (folder / MODEL).is_file():
            text += ", model.pth is untouched"
        words[0] = text
    if env.world_size > 1:
        dist.broadcast_object_list(words, src=0)
    return str(words[0])
