"""The whole story of a run in one local 2 x 2 run: training, a preemption (SIGUSR2 to the launcher: every rank
saves at an agreed step and the launcher restarts them), then a rank failing on its own in the second attempt
(the launcher restarts every rank from the latest checkpoint; the steps since it are lost), then a third
attempt that completes. Then what a person looks at: the report's page in headless Chromium (the plots are
there and not blank), its numbers against metrics.jsonl and attempts.jsonl, and the TensorBoard curves, which
go on across both restarts with no step twice.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import ROOT
from report_check import assert_report_matches_records, check_report, page_attempts
from test_launch_local import finish, read_until, start
from test_run_progress_runs import event_steps

from hpc_ddp.ledger import attempts
from hpc_ddp.run.records.metrics import read_records

pytestmark = [pytest.mark.slow, pytest.mark.deadline(180)]  # 24-36 s (measured)

STEPS = 96  # 6 epochs of 512 samples, 4 ranks x --batch-size 8: 16 steps an epoch
FAIL_AT = 44  # rank 1 of the second attempt raises on this step, 3 steps after the checkpoint at step 40
TAGS = {
    "train/loss",
    "train/lr",
    "train/samples_per_s",
    "time/step_s",
    "time/data_s",
    "time/checkpoint_stall_s",
    "time/checkpoint_write_s",
    *(f"rank_step_time/{r}" for r in range(4)),
}


def test_a_preemption_then_a_failure_then_the_report_in_chromium_and_the_tensorboard_curves(
    tmp_path: Path,
) -> None:
    pytest.importorskip(
        "tensorboard", reason="--tensorboard needs the tensorboard package (env/setup.sh --test installs it)"
    )
    import tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    site = str(Path(tensorboard.__file__).resolve().parent.parent)  # this test's tensorboard, for the run too
    folder = tmp_path / "run"
    marker = tmp_path / "failed-once"
    proc = start(
        folder,
        "--task",
        "retry_tasks:fails_once_after_resume",
        "--nodes",
        "2",
        "--tasks-per-node",
        "2",
        "--epochs",
        "6",
        "--batch-size",
        "8",
        "--deterministic",
        "--tensorboard",
        "--log-every-s",
        "0",
        "--save-every-steps",
        "10",
        SLOW_TASK_SLEEP_S="0.03",
        RETRY_FAIL_MARKER=str(marker),
        RETRY_FAIL_AT_STEP=str(FAIL_AT),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), site]),
    )
    lines = read_until(proc, "Epoch 0,")  # training is under way: the preemption lands in epoch 1
    proc.send_signal(signal.SIGUSR2)
    code, rest = finish(proc)
    out = "\n".join(lines) + "\n" + rest
    assert code == 0, out
    assert "[launcher] preempted: restarting all ranks (1 of --max-requeue 3)" in out, out
    assert (
        f"[launcher] attempt 2 failed on node 0 (127.0.0.1): RuntimeError: forced failure at step {FAIL_AT},"
        in out
    ), out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert marker.read_text() == f"failed at step {FAIL_AT}\n"

    # The attempts record: preempted at the agreed step (nothing lost), failed steps after its last checkpoint.
    first, second, third = recorded = attempts.read(folder)
    assert [(a.restart, a.outcome, a.decision) for a in recorded] == [
        (0, "preempted", "restart"),
        (1, "failed", "restart"),
        (2, "completed", "done"),
    ]
    assert first.resumed_from is None and 16 < first.step == first.checkpoint == second.resumed_from < 40
    # The save at step 40 is written in the background: 3 steps later it is durable, unless the machine is
    # very slow; then the failure loses 13 steps, and the records and the report must say that instead.
    saved = second.checkpoint
    assert saved in (40, 30), second
    lost = FAIL_AT - 1 - saved
    assert (second.rank, second.step, second.lost_steps) == (1, FAIL_AT - 1, lost)
    assert f"restarting from the checkpoint at step {saved} (failure 1 of --max-restarts 3)" in out, out
    assert (third.resumed_from, third.step, third.lost_steps) == (saved, STEPS, 0)
    assert (first.lost_steps, third.lost_steps) == (0, 0)
    starts = [r for r in read_records(folder / "metrics.jsonl") if r["event"] == "start"]
    assert [(s["restart"], s["step"]) for s in starts] == [(0, 0), (1, first.step), (2, saved)]

    # The report: the page in Chromium shows the plots; its numbers are the records'.
    checked = check_report(folder, tmp_path / "screenshot.png")
    facts = assert_report_matches_records(checked, folder)  # the attempts table row by row, too
    s = checked.summary
    assert (facts.attempts, facts.steps, facts.lost_steps) == (3, STEPS, lost)
    assert (len(s.attempts), s.steps, s.lost_steps, s.failures, s.state) == (3, STEPS, lost, 1, "finished")
    assert [a.lost_steps for a in s.attempts] == [a.lost_steps for a in recorded] == [0, lost, 0]
    assert [a.resumed_at for a in s.attempts] == [0, first.step, saved]
    assert (
        s.attempts[1].lost_s > 0 and s.lost_s == s.attempts[1].lost_s
    )  # the failure's lost work, in seconds
    assert [row["lost steps"] for row in page_attempts(checked.page)] == ["0", str(lost), "0"]
    assert f"{lost} steps replayed" in checked.page and "<tr><th>failures</th><td>1</td></tr>" in checked.page
    assert checked.line.startswith(f"report: {folder / 'report.html'} (finished; 3 attempts, step {STEPS}, ")
    assert ", smoothed training loss " in checked.line and f", lost {lost} steps, " in checked.line
    assert s.best_interval_s is not None and 0 < s.goodput < 1  # a failure seen: Young/Daly has an answer

    # TensorBoard: one event file per start; every curve goes on across both restarts, no step twice, although
    # the third attempt trained the lost steps again.
    files = event_steps(folder / "tb")
    assert len(files) == 3, files
    for tag in TAGS:
        steps = [step for _, tags in files for step in tags.get(tag, [])]
        assert steps and steps == sorted(set(steps)), (tag, steps)  # strictly increasing: none twice
    losses = [[step for step in tags["train/loss"]] for _, tags in files]
    assert (max(losses[0]), max(losses[1]), min(losses[2]), max(losses[2])) == (
        first.step,
        FAIL_AT - 1,
        FAIL_AT,
        STEPS,
    )
    assert sorted(step for file in losses for step in file) == list(range(1, STEPS + 1))
    board = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})  # TensorBoard's own view
    board.Reload()
    assert TAGS <= set(board.Tags()["scalars"])
    assert [e.step for e in board.Scalars("train/loss")] == list(range(1, STEPS + 1))
