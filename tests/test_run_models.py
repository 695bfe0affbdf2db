"""Issue 19 in real runs (local launcher, 1 node x 2 gloo ranks): batches of any structure, a step of one's own
with extra metrics, schedules, evaluation; and the bad inputs, each one line, exit 2, never retried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_launch_local import finish, start

from hpc_ddp import exitcodes

pytestmark = [pytest.mark.slow, pytest.mark.deadline(120)]

TWO = ("--nodes", "1", "--deterministic")


def records(folder: Path, event: str) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("bad_batch", "error: batch['tags']: set cannot be part of a batch"),
        ("dict_to_loss_fn", "error: Task.loss_fn needs (input, target) batches, but a batch is dict."),
        ("nonscalar", "error: the training step returned a tensor of shape [32, 1] as its loss; expected a "),
        ("both", "Task has both of loss_fn and step; give exactly one"),
        ("scheduler_raises", "error: Task.scheduler(optimizer, 16) raised ValueError: warm-up longer than"),
    ],
)
def test_bad_input_is_one_line_exit_2_never_retried(tmp_path: Path, task: str, message: str) -> None:
    code, out = finish(start(tmp_path, "--task", f"model_tasks:{task}", *TWO, "--epochs", "2"), timeout=100)
    assert code == exitcodes.USAGE, out
    assert message in out
    assert "Traceback" not in out
    assert "restarting" not in out and "retry" not in out.lower()


def test_dict_batches_and_a_step_with_metrics_record_them_averaged(tmp_path: Path) -> None:
    code, out = finish(
        start(tmp_path, "--task", "model_tasks:dicts", *TWO, "--epochs", "2", "--log-every-s", "0"),
        timeout=100,
    )
    assert code == 0, out
    steps = records(tmp_path, "step")
    assert steps and all(set(r["metrics"]) == {"half", "mae"} for r in steps)
    assert all(
        r["metrics"]["half"] == 0.5 for r in steps
    )  # a constant: averaged over ranks and micro-batches
    assert all(r["metrics"]["mae"] > 0 for r in steps)
    assert " half 0.5 mae " in out  # the progress line shows them
