"""The loop's pure rules, each beside the code that owns it: when to evaluate (hpc_ddp.run.loop.evaluation), what a
non-finite step does and says (hpc_ddp.run.loop.nonfinite), when nothing is left to train (hpc_ddp.run.loop.position),
and each part of the training options checked on its own (hpc_ddp.run.config's parts)."""

from __future__ import annotations

import pytest

from hpc_ddp.errors import UsageError
from hpc_ddp.run.checkpoint.options import CheckpointOptions
from hpc_ddp.run.config import RestartOptions, RunOptions, TrainConfig
from hpc_ddp.run.data.options import DataOptions
from hpc_ddp.run.loop import evaluation, nonfinite
from hpc_ddp.run.loop.options import EvalOptions, ScheduleOptions
from hpc_ddp.run.loop.position import Position, trained
from hpc_ddp.run.sinks.options import LoggingOptions
from hpc_ddp.run.snapshot.options import SnapshotOptions
from hpc_ddp.run.strategy.options import StrategyOptions
from hpc_ddp.run.watch.options import GroupOptions


@pytest.mark.parametrize(
    "every, step, mid_epoch, last, finished, due",
    [
        (5, 10, True, False, False, True),
        (5, 11, True, False, False, False),
        (0, 10, True, False, False, False),  # off
        (5, 10, False, False, False, False),  # the epoch's last step: evaluated after the epoch's end
        (5, 10, True, True, False, False),  # a stream's last step of the epoch: the same
        (5, 10, True, False, True, False),  # the run's last step: evaluated at the end
    ],
)
def test_an_evaluation_after_a_step(
    every: int, step: int, mid_epoch: bool, last: bool, finished: bool, due: bool
) -> None:
    assert evaluation.due_after_step(every, step, mid_epoch, last, finished) is due


@pytest.mark.parametrize(
    "every_epochs, every_steps, epoch, step, last, due",
    [
        (1, 0, 0, 8, False, True),
        (2, 0, 0, 8, False, False),
        (2, 0, 1, 16, False, True),
        (0, 0, 3, 32, False, False),  # only at the end
        (0, 0, 3, 32, True, True),
        (0, 8, 0, 8, False, True),  # the epoch's last step is a step of --eval-every-steps
        (0, 3, 0, 8, False, False),
    ],
)
def test_an_evaluation_at_an_epochs_end(
    every_epochs: int, every_steps: int, epoch: int, step: int, last: bool, due: bool
) -> None:
    assert evaluation.due_after_epoch(every_epochs, every_steps, epoch, step, last) is due


def test_skip_goes_on_until_the_limit_and_stop_never_does() -> None:
    assert [nonfinite.skips("skip", n) for n in (0, nonfinite.MAX_SKIPPED - 1, nonfinite.MAX_SKIPPED)] == [
        True,
        True,
        False,
    ]
    assert not nonfinite.skips("stop", 0)
    assert [nonfinite.shown(v) for v in (float("nan"), float("inf"), float("-inf"))] == [
        "NaN",
        "+inf",
        "-inf",
    ]


def test_the_stop_line_says_what_was_found_and_what_is_left() -> None:
    where = "step 7 (epoch 0)"
    first = nonfinite.stop_message(where, "NaN", 0, 4, [], "no checkpoint was written")
    assert first.startswith("step 7 (epoch 0): the loss averaged over all 4 ranks is NaN (a rank's loss")
    assert "saved nothing after the last finite step (no checkpoint was written)" in first
    broken = nonfinite.stop_message(where, "+inf", 10, 4, ["a.w", "b.w", "c.w", "d.w"], "kept")
    assert (
        "not finite in 11 steps in a row (+inf now); the weights themselves are not finite (a.w, b.w, c.w, ...)"
        in broken
    )
    clean = nonfinite.stop_message(where, "NaN", 2, 4, [], "kept")
    assert "the weights are finite (none of those updates was applied)" in clean


def test_nothing_left_to_train() -> None:
    assert trained(Position(epoch=3), epochs=3, max_steps=0)
    assert not trained(Position(epoch=2, step=99), epochs=3, max_steps=0)
    assert trained(Position(epoch=0, step=10), epochs=3, max_steps=10)
    assert not trained(Position(epoch=0, step=9), epochs=3, max_steps=10)


@pytest.mark.parametrize(
    "part, changes, match",
    [
        (RunOptions, {"epochs": 0}, r"^--epochs 0: must be at least 1$"),
        (RunOptions, {"lr": float("nan")}, r"^--lr nan: must be a finite number"),
        (
            ScheduleOptions,
            {"lr_schedule": "step"},
            r"^--lr-schedule step: choose one of constant, linear, cosine$",
        ),
        (
            DataOptions,
            {"prefetch_factor": 2, "num_workers": 0},
            r"^--prefetch-factor 2 needs DataLoader workers",
        ),
        (EvalOptions, {"keep_best": "accuracy"}, r"^--keep-best 'accuracy': expected NAME:min or NAME:max"),
        (StrategyOptions, {"strategy": "fsdp", "amp": "fp16"}, r"^--amp fp16 with --strategy fsdp"),
        (CheckpointOptions, {"keep": 0}, r"^--keep 0: must be at least 1$"),
        (CheckpointOptions, {"overwrite": True}, r"^--overwrite only applies with --resume never"),
        (LoggingOptions, {"log_every_s": -1.0}, r"^--log-every-s -1.0: must be 0 or more$"),
        (RestartOptions, {"requeue_by": "me"}, r"^--requeue-by me: choose one of auto, scontrol, launcher$"),
        (
            GroupOptions,
            {"timeout_s": 60.0, "hang_timeout_s": "90"},
            r"^--hang-timeout-s 90 is not below --timeout-s 60",
        ),
    ],
)
def test_each_part_of_the_options_is_checked_on_its_own(
    part: type, changes: dict[str, object], match: str
) -> None:
    """Built alone, a part runs its own checks, with the words TrainConfig says them in."""
    with pytest.raises(UsageError, match=match):
        part(**changes)
    with pytest.raises(UsageError, match=match):
        TrainConfig(**changes)  # type: ignore[arg-type]


def test_the_options_are_the_union_of_their_parts() -> None:
    """Every field belongs to exactly one part, and a function that needs one concern can take its part."""
    import dataclasses

    parts = [RunOptions, ScheduleOptions, DataOptions, EvalOptions, StrategyOptions, CheckpointOptions]
    parts += [LoggingOptions, RestartOptions, GroupOptions, SnapshotOptions]
    owned = [f.name for part in parts for f in dataclasses.fields(part)]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert len(owned) == len(set(owned))
    assert all(isinstance(TrainConfig(), part) for part in parts)
    assert CheckpointOptions(async_save="auto").async_save_kind() == TrainConfig().async_save_kind()
