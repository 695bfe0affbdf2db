"""A real local run, then its report, opened in headless Chromium: the page shows the plots, and its numbers
are the ones metrics.jsonl holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_module
from hpc_ddp.run.metrics import read_records
from report_check import check_report

pytestmark = [pytest.mark.slow, pytest.mark.deadline(150)]  # 7-8 s (measured)


def local_run(folder: Path, *args: str) -> None:
    """`submit --local` on 1 node x 2 processes, a record for every step; must exit 0."""
    proc = run_module("hpc_ddp.submit", "--local", "--nodes", "1", "--tasks-per-node", "2",
                      "--log-every-s", "0", "--folder", str(folder), *args, cwd=folder.parent, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_local_run_and_its_report_in_chromium(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    local_run(folder, "--epochs", "4", "--max-steps", "50", "--save-every-steps", "20")
    checked = check_report(folder, tmp_path / "screenshot.png")
    steps = [r for r in read_records(folder / "metrics.jsonl") if r.get("event") == "step"]
    s = checked.summary
    assert (len(s.attempts), s.steps, s.lost_steps, s.state) == (1, 50, 0, "finished")
    assert s.final_loss == steps[-1]["loss"] and s.best_loss == min(r["loss"] for r in steps)
    assert 0 < s.goodput <= 1 and s.productive_s > 0
    assert checked.line.startswith(f"report: {folder / 'report.html'} (finished; 1 attempt, step 50, ")
    assert f"final loss {s.final_loss:.4g}" in checked.line
