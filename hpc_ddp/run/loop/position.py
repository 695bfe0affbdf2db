"""Where training stands (`Position`) and how the loop ended (`Outcome`): plain data that the trainer, the
metrics and the session share, kept apart so that none of them imports another just for a dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Position:
    """Where training stands; saved in every checkpoint so a resume continues mid-epoch."""

    epoch: int = 0
    batch: int = 0  # micro-batches of this epoch already consumed (always an optimizer-step boundary)
    step: int = 0  # optimizer steps done since the start of the run
    loss_sum: float = 0.0  # this epoch's reduced loss so far, so a resumed epoch reports the same mean
    loss_count: float = 0.0
    eval_pending: bool = False  # an evaluation at `step` was stopped by a signal: the resume runs it first
    # --max-steps was reached at `step`, inside an epoch, but the run's end (its final evaluation, the epoch's
    # record) was not: a signal came in that last step or during that evaluation. The resume ends the run.
    end_pending: bool = False
    stopped: bool = False  # a callback asked the run to stop (hpc_ddp.run.callbacks): it finished at `step`


def epochs_done(pos: Position, batches_per_epoch: int) -> int:
    """The epoch a position is at, as the run's end counts it (metrics' end record, "ranks ended at epoch 50"):
    a position whose epoch has every batch done is at the next one. A checkpoint saved at an epoch's last
    step holds (49, all batches), the loop's end (50, 0): both are epoch 50, step 400."""
    return pos.epoch + 1 if batches_per_epoch and pos.batch >= batches_per_epoch else pos.epoch


@dataclass(frozen=True)
class Outcome:
    """How the loop ended: finished, or stopped at an agreed step by a signal."""

    finished: bool
    requeue_votes: float = 0.0
    stop_votes: float = 0.0


def trained(pos: Position, epochs: int, max_steps: int) -> bool:
    """No step left to train at `pos` under --epochs and --max-steps (0: no limit), or a callback stopped it."""
    return pos.stopped or pos.epoch >= epochs or bool(max_steps and pos.step >= max_steps)
