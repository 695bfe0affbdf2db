"""A real local run, then its report, opened in headless Chromium: the page shows the plots, and its numbers
are the ones metrics.jsonl holds."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from conftest import run_module
from report_check import assert_report_matches_records, check_report
from test_launch_local import finish, read_until, start

from hpc_ddp.run.metrics import read_records

pytestmark = [pytest.mark.slow, pytest.mark.deadline(200)]  # 6-8 s and 13-20 s (measured)


def local_run(folder: Path, *args: str) -> None:
    """`submit --local` on 1 node x 2 processes, a record for every step; must exit 0."""
    proc = run_module(
        "hpc_ddp.submit",
        "--local",
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--log-every-s",
        "0",
        "--folder",
        str(folder),
        *args,
        cwd=folder.parent,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_local_run_and_its_report_in_chromium(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    local_run(folder, "--epochs", "4", "--max-steps", "50", "--save-every-steps", "20")
    checked = check_report(folder, tmp_path / "screenshot.png")
    assert_report_matches_records(checked, folder)
    steps = [r for r in read_records(folder / "metrics.jsonl") if r.get("event") == "step"]
    s = checked.summary
    assert (len(s.attempts), s.steps, s.lost_steps, s.state) == (1, 50, 0, "finished")
    assert s.final_loss == steps[-1]["loss"] and s.best_loss == min(r["loss"] for r in steps)
    assert 0 < s.goodput <= 1 and s.productive_s > 0
    assert checked.line.startswith(f"report: {folder / 'report.html'} (finished; 1 attempt, step 50, ")
    assert f"final loss {s.final_loss:.4g}" in checked.line


def test_a_preempted_run_reported_while_it_runs_and_after(tmp_path: Path) -> None:
    """SIGUSR2 to the launcher: an agreed save, a restart. Asked meanwhile, the report says "running"; at the
    end, two attempts, no step lost, and the steps and losses of metrics.jsonl."""
    folder = tmp_path / "run"
    proc = start(
        folder,
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--task",
        "slow_tasks:slow",
        "--epochs",
        "4",
        "--batch-size",
        "8",
        "--log-every-s",
        "0",
        "--save-every-steps",
        "10",
        SLOW_TASK_SLEEP_S="0.03",
    )
    read_until(proc, "Epoch 0,")
    proc.send_signal(signal.SIGUSR2)
    read_until(proc, "restarting all ranks")
    during = run_module("hpc_ddp.report", str(folder), "--no-sacct", "--out", str(tmp_path / "during.html"))
    code, out = finish(proc)
    assert code == 0, out
    assert during.returncode == 0 and "(running; " in during.stdout, during.stdout + during.stderr
    checked = check_report(folder, tmp_path / "screenshot.png")
    assert_report_matches_records(checked, folder)
    steps = [r for r in read_records(folder / "metrics.jsonl") if r.get("event") == "step"]
    s = checked.summary
    assert (len(s.attempts), s.steps, s.lost_steps, s.state) == (2, 4 * 32, 0, "finished")
    assert s.attempts[1].resumed_at == s.attempts[0].last_step > 32
    assert s.final_loss == steps[-1]["loss"] and s.best_loss == min(r["loss"] for r in steps)
    assert s.queue_s >= 0 and 0 < s.goodput <= 1  # 1 before start records (no startup seen)
