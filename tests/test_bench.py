"""`python -m hpc_ddp.bench`: the short mode runs every section for real and writes valid JSON.

No timing is asserted (the machine is shared and noisy): only that every section ran and reported figures.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_module

from hpc_ddp.bench import hand, report, runs, suite


@pytest.mark.slow  # about a minute: six short real runs (kit, hand loops, torchrun) and two saves
@pytest.mark.deadline(200)  # 40 s measured
def test_quick_bench_runs_every_section_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_module("hpc_ddp.bench", "--quick", "--json", str(out), "--folder", str(tmp_path / "runs"),
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == list(suite.SECTIONS)
    figures = [sections["overhead"]["kit_vs_naive"], sections["overhead"]["kit_vs_tuned"],
               sections["scaling"]["efficiency"], sections["checkpoint"]["kit_vs_raw"],
               sections["checkpoint"]["stall_ms"], sections["launch"]["local_vs_torchrun"]]
    assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in figures), figures
    assert [t["name"] for t in report["targets"]] == [
        "kit / hand loop, default threads", "kit / hand loop, tuned threads", "checkpoint / raw write",
        "launch / torchrun"]
    assert all(isinstance(t["met"], bool) for t in report["targets"])
    assert report["settings"]["quick"] is True
    assert "samples/s" in proc.stdout and "target  launch / torchrun" in proc.stdout  # the table
    assert "[bench] trial 1/1 launch-torchrun:" in proc.stderr  # a progress line per run


def test_help_explains_each_section():
    proc = run_module("hpc_ddp.bench", "--help")
    assert proc.returncode == 0
    assert all(f"\n  {section}" in proc.stdout for section in suite.SECTIONS)


def test_bad_arguments_are_one_line_usage_errors():
    for args, expected in ((["overhed"], "unknown section 'overhed'"),
                           (["--steps", "500"], "Fix: --steps 128 or fewer")):
        proc = run_module("hpc_ddp.bench", *args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and expected in proc.stderr


def test_ratios_pair_trials_and_targets_compare():
    assert runs.ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    assert runs.median(runs.ratios([2.0, 3.0, 8.0], [1.0, 2.0, 2.0])) == 2.0
    assert report.Target("x", 0.9, "<=", 1.0).met and not report.Target("x", 1.1, "<=", 1.0).met
    assert report.Target("x", 1.8, ">=", 1.8).met and not report.Target("x", 0.96, ">=", 0.97).met


def test_hand_loop_rate_counts_steps_after_the_first_like_the_kit():
    # 3 steps of 64 samples ending at 1, 2 and 4 s: two steps measured over 3 s (step 1 is warm-up).
    assert hand.rate([1.0, 2.0, 4.0], 64) == {"samples_per_s": 128 / 3, "median_step_time_s": 2.0}
