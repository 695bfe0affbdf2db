"""A loss that becomes NaN or infinite, in real runs: every rank learns it at the same step (through the
per-step all-reduce, before the update), the run stops with exit code 65 and one line on every rank, and
nothing written before it is replaced: no model.pth, no checkpoint after the last finite step, and a
metrics.jsonl that stays valid JSON. `--nonfinite-loss skip` drops such a step instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_launch_local import finish, start
from test_run_folder_rules import snapshot, train

from hpc_ddp import exitcodes
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.storage import Local

pytestmark = pytest.mark.slow


def strict_json(line: str) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON: {line}")

    return json.loads(line, parse_constant=refuse)  # type: ignore[arg-type]


@pytest.mark.deadline(50)  # 7.5-10 s (measured)
def test_a_nan_on_one_rank_stops_every_rank_at_that_step_and_replaces_nothing(tmp_path: Path) -> None:
    task = ("--task", "robust_tasks:nan_loss", "--nodes", "1")  # 2 ranks, 8 steps per epoch
    code, out = finish(start(tmp_path, *task, "--epochs", "1"), timeout=60)
    assert code == 0, out
    good = snapshot(tmp_path)
    code, out = finish(start(tmp_path, *task, "--epochs", "3", NAN_STEPS="5", NAN_RANK="1"), timeout=60)
    assert code == exitcodes.NONFINITE, out
    message = "error: step 13 (epoch 1): the loss averaged over all 2 ranks is NaN"
    for rank in (0, 1):  # both ranks, at the same step, although only rank 1's loss was NaN
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert message in log and "exits with code 65 (non-finite loss)" in log, log
    assert "The run stopped before applying that update" in out and "parameters differ" not in out
    after = snapshot(tmp_path)
    for name in ("model.pth", "checkpoints/ckpt-00000008.pt", "checkpoints/latest"):
        assert after[name] == good[name], name
    assert store.list_checkpoints(tmp_path, storage=Local()) == [
        tmp_path / "checkpoints" / "ckpt-00000008.pt"
    ]
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "nonfinite" and records[-1]["step"] == 13 and records[-1]["loss"] is None


@pytest.mark.deadline(30)  # ~3-4 s
def test_an_exploding_learning_rate_stops_with_exit_65_and_writes_no_weights(tmp_path: Path) -> None:
    code, out = train(tmp_path, "--lr", "1e30", "--epochs", "2")
    assert code == exitcodes.NONFINITE, out
    assert "error: step 2 (epoch 0): the loss averaged over all 1 ranks is" in out
    assert "exits with code 65 (non-finite loss)" in out and "Traceback" not in out
    assert not (tmp_path / "model.pth").exists() and store.list_checkpoints(tmp_path, storage=Local()) == []


@pytest.mark.deadline(30)  # ~3-4 s
def test_skip_drops_the_nonfinite_step_and_training_goes_on(tmp_path: Path) -> None:
    code, out = train(
        tmp_path,
        "--task",
        "robust_tasks:nan_loss",
        "--nonfinite-loss",
        "skip",
        "--epochs",
        "1",
        NAN_STEPS="3",
    )
    assert code == 0, out
    assert (
        "step 3 (epoch 0): the loss averaged over all ranks is NaN; that step's update was skipped "
        "(--nonfinite-loss skip; 1 in a row"
    ) in out
    model = torch.load(tmp_path / "model.pth", weights_only=True)
    assert all(torch.isfinite(t).all() for t in model.values())
    epoch = [
        strict_json(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if '"epoch"' in line and '"event": "epoch"' in line
    ]
    assert math.isfinite(epoch[0]["loss"])


@pytest.mark.deadline(40)  # ~5 s
def test_the_stop_names_the_checkpoint_whose_write_was_still_in_flight(tmp_path: Path) -> None:
    """The step-3 checkpoint becomes durable while step 4's loss is NaN: the stop waits for it before saying
    which checkpoint is kept (before, it read `latest` too early and said "no checkpoint was written")."""
    code, out = train(
        tmp_path,
        "--task",
        "robust_tasks:nan_after_slow_save",
        "--save-every-steps",
        "3",
        "--save-every-epochs",
        "0",
        NAN_STEPS="4",
        SLOW_SAVE_S="1.5",
    )
    assert code == exitcodes.NONFINITE, out
    assert "error: step 4 (epoch 0): the loss averaged over all 1 ranks is NaN" in out, out
    assert (
        "(the last checkpoint, ckpt-00000003.pt, is kept)" in out and "no checkpoint was written" not in out
    )
    assert store.list_checkpoints(tmp_path, storage=Local()) == [
        tmp_path / "checkpoints" / "ckpt-00000003.pt"
    ]
    # The stop's record is the run's last, after that save's (before, the save was recorded at close, after it)
    events = [strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saves = [i for i, r in enumerate(events) if r["event"] == "save" and r["step"] == 3]
    assert events[-1]["event"] == "nonfinite" and events[-1]["action"] == "stop", events[-1]
    assert len(saves) == 1 and saves[0] < len(events) - 1, events


@pytest.fixture(scope="module")
def streak(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """11 non-finite losses in a row (steps 3-13) under --nonfinite-loss skip, saving every 2 steps: the run
    stops at step 13. No such update was applied, so the weights are still finite."""
    folder = tmp_path_factory.mktemp("streak")
    code, out = train(
        folder,
        "--task",
        "robust_tasks:nan_loss",
        "--nonfinite-loss",
        "skip",
        "--save-every-steps",
        "2",
        NAN_STEPS=",".join(str(s) for s in range(3, 14)),
    )
    return folder, code, out


def _stop_line(out: str) -> str:
    return next(x for x in out.splitlines() if "error: step 13 (epoch 0)" in x)


@pytest.mark.deadline(40)  # ~4 s (the shared run)
def test_skip_stops_after_a_streak_saying_the_weights_are_finite(streak: tuple[Path, int, str]) -> None:
    _, code, out = streak
    assert code == exitcodes.NONFINITE, out
    line = _stop_line(out)
    assert "not finite in 11 steps in a row (NaN now)" in line, line
    assert "the weights are finite" in line and "probably not finite" not in line, line


@pytest.mark.deadline(40)
def test_the_last_record_of_a_skip_streak_that_stopped_the_run_says_stop(
    streak: tuple[Path, int, str],
) -> None:
    folder, _, _ = streak
    records = [strict_json(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "nonfinite" and records[-1]["action"] == "stop", records[-1]


@pytest.mark.deadline(40)
def test_no_checkpoint_is_written_during_a_skipped_streak(streak: tuple[Path, int, str]) -> None:
    """The stop says "saved nothing after the last finite step": true, step 2's checkpoint is the last."""
    folder, _, out = streak
    assert "(the last checkpoint, ckpt-00000002.pt, is kept)" in _stop_line(out)
    assert store.list_checkpoints(folder, storage=Local()) == [folder / "checkpoints" / "ckpt-00000002.pt"]


@pytest.mark.deadline(40)  # ~4 s
def test_a_save_due_during_a_skipped_streak_comes_at_the_next_finite_step(tmp_path: Path) -> None:
    code, out = train(
        tmp_path,
        "--task",
        "robust_tasks:nan_loss",
        "--nonfinite-loss",
        "skip",
        "--save-every-steps",
        "4",
        "--max-steps",
        "6",
        "--keep",
        "5",
        NAN_STEPS="3,4",
    )
    assert code == 0, out
    # Step 4's save (its update and step 3's skipped) waits for step 5, the next finite one; 6 is the last.
    assert [p.name for p in store.list_checkpoints(tmp_path, storage=Local())] == [
        "ckpt-00000006.pt",
        "ckpt-00000005.pt",
    ]
