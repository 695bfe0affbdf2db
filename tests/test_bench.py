"""`python -m hpc_ddp.bench`: the short mode runs every section for real and writes valid JSON.

No timing is asserted (the machine is shared and noisy): only that every section ran and reported figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import local_checkpoints, run_module

from hpc_ddp.bench import hand, report, runs, suite, watching
from hpc_ddp.bench.runs import Settings
from hpc_ddp.cluster.env import detect
from hpc_ddp.cluster.group import process_group
from hpc_ddp.log import RankLog
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.trainer import Trainer
from hpc_ddp.run.watch.beacon import NullBeacon

SETTINGS = Settings(trials=3, steps=60, world_size=2, batch_size=32, work=Path("/nonexistent"))


@pytest.mark.slow  # about 40 CPU-seconds of runs of one rank each: every section, fsdp and resume too, once, at its least
# beside other pytest-xdist workers on 2 cores, CPU-bound runs take 4-5 times as long: a deadline catches a
# hang, not a slow machine.
@pytest.mark.deadline(600)
@pytest.mark.alone  # CPU-bound runs: never beside a timing-sensitive test (tests/workers.py)
def test_quick_bench_runs_every_section_and_writes_json(tmp_path):
    """Every section, the optional fsdp and resume ones too, in one bench at its smallest (--quick: one trial of a few
    steps; one rank): it measures nothing, it runs every path and writes every figure."""
    out = tmp_path / "bench.json"
    proc = run_module(
        "hpc_ddp.bench", *suite.SECTIONS, *suite.OPTIONAL, "--quick", "--world-size", "1", "--json", str(out),
        "--folder", str(tmp_path / "runs"), timeout=580,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == [*suite.SECTIONS, *suite.OPTIONAL]
    figures = [
        sections["overhead"]["kit_vs_naive"],
        sections["overhead"]["kit_vs_tuned"],
        sections["scaling"]["efficiency"],
        sections["checkpoint"]["kit_vs_raw"],
        sections["checkpoint"]["stall_ms"],
        sections["launch"]["local_vs_torchrun"],
        sections["launch"]["local_vs_torchrun_cpu"],
        sections["launch"]["import_rank_cpu_s"],
        sections["launch"]["import_plain_cpu_s"],
        sections["launch"]["import_rank_vs_plain"],
        sections["watchdog"]["with_vs_without"],
        sections["watchdog"]["with_samples_per_s"],
        sections["watchdog"]["without_samples_per_s"],
        sections["overhead"]["kit_own_us_per_step"],  # the kit's own work per step, from the end record
    ]
    assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in figures), figures
    # The gradient norm for the step records (no --clip-grad): part of the kit's own work, said apart.
    overhead = sections["overhead"]
    assert 0 < overhead["grad_norm_us_per_step"] <= overhead["kit_own_us_per_step"], overhead
    assert [t["name"] for t in report["targets"]] == [
        "kit / hand loop, default threads",
        "kit / hand loop, tuned threads",
        "kit's own work per step, us",
        "checkpoint / raw write",
        "launch / torchrun",
        "launch CPU / torchrun",
        "rank import CPU paused / plain",
        "fsdp / ddp peak memory per rank, freed memory returned",
        "fsdp / ddp peak memory per rank, the kit's settings",
        "fsdp / ddp samples/s",
        "fsdp async / ddp rank-0 save stall",
        "recovery from memory: steps lost (worst)",
        "snapshot stall / step time",
        "recovery from memory / from disk, s",
        "hang watch on / off",
        "resume check / its budget",
    ]
    assert all(isinstance(t["met"], bool) for t in report["targets"])
    assert report["settings"]["quick"] is True
    assert "samples/s" in proc.stdout and "target  launch / torchrun" in proc.stdout  # the table
    assert "[bench] trial 1/1 launch-torchrun:" in proc.stderr  # a progress line per run
    assert "[bench] trial 1/1 watchdog: with" in proc.stderr
    assert "[bench] trial 1/1 import_rank:" in proc.stderr and "paused / plain" in proc.stdout
    assert [len(x) for x in sections["watchdog"]["trials"].values()] == [1, 1]
    # The watchdog section's own figures and target (a test of its own before; the run is the same).
    watch = sections["watchdog"]
    assert watch["ranks"] == 1
    ratio = watch["with_vs_without"]
    [target] = [t for t in report["targets"] if t["name"] == "hang watch on / off"]
    assert {k: target[k] for k in ("name", "value", "op", "threshold", "met")} == {
        "name": "hang watch on / off",
        "value": ratio,
        "op": ">=",
        "threshold": 0.99,
        "met": ratio >= 0.99,
    }
    assert target["trials"] == [ratio] and target["verdict"] in ("met", "missed", "noisy")
    assert "CPU on / off" in proc.stdout and "target  hang watch on / off" in proc.stdout
    assert watch["with_cpu_ms_per_step"] > 0 and watch["cpu_with_vs_without"] > 0
    # The fsdp section: memory measured twice, the target applied to the memory held.
    f = sections["fsdp"]
    assert f["ranks"] == 1 and f["returned_env"] == {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304"}
    for key in ("samples_per_s", "peak_rss_bytes", "held_rss_bytes", "stall_s"):
        ratio = f[f"{key}_ratio"]
        assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0, key
        assert f["trials"][key] == [ratio]
        assert f[f"fsdp_{key}"] / f[f"ddp_{key}"] == pytest.approx(ratio)
    assert f["fsdp_held_rss_bytes"] > 2**20 and f["fsdp_write_s"] > 0 and f["fsdp_interval_s"] > 0
    fsdp_targets = [t for t in report["targets"] if t["name"].startswith("fsdp")]
    assert fsdp_targets[0]["value"] == f["held_rss_bytes_ratio"]
    assert fsdp_targets[1]["value"] == f["peak_rss_bytes_ratio"]
    # --async-save thread against process: each one's stall, write and step times during and between writes.
    for kind in ("fsdp", "fsdp_process"):
        for key in ("stall_s", "write_s", "first_write_s"):
            assert math.isfinite(f[f"{kind}_{key}"]) and f[f"{kind}_{key}"] >= 0, (kind, key)
        # A --quick run of a few steps may have no step during a later write, or none without one: "n/a".
        for key in ("step_s_during_write", "step_s_quiet"):
            value = f[f"{kind}_{key}"]
            assert value is None or (math.isfinite(value) and value >= 0), (kind, key)
    assert f["process_stall_s_ratio"] == pytest.approx(f["fsdp_process_stall_s"] / f["fsdp_stall_s"])
    # Five runs per trial, each in its own folder: the three contenders with the kit's settings, then ddp and
    # fsdp again with freed memory returned.
    [work] = (tmp_path / "runs").iterdir()
    labels = ("ddp", "fsdp", "fsdp-process", "ddp-returned", "fsdp-returned")
    runs = sorted(p.name for p in work.iterdir() if p.is_dir() and p.name[4:] in labels)
    assert [r[4:] for r in runs] == list(labels), runs
    # Every run's checkpoints and model.pth are gone once its figures are read (57 GB for the fsdp section at
    # 3 trials, kept to the end before); its records and logs stay.
    assert not list(work.glob("**/checkpoints")) and not list(work.glob("**/model.pth*"))
    assert all((work / r / "metrics.jsonl").is_file() for r in runs)
    assert "peak RSS fsdp / ddp (the kit's settings)" in proc.stdout
    assert "--async-save thread / process: loop stall per save" in proc.stdout
    assert "trial 1/1 fsdp, freed memory returned:" in proc.stderr
    # The resume section (issue 42): a check of every kind of stop against the plain run of the same options.
    rc = sections["resume"]
    assert (
        rc["ranks"] == 1 and rc["steps"] == 8 and rc["restarts"] >= 7
    )  # 6 kinds of stop + the finished rerun
    for key in ("check_s", "uninterrupted_s", "startup_s", "check_vs_budget"):
        assert isinstance(rc[key], float) and math.isfinite(rc[key]) and rc[key] > 0, key
    assert rc["check_s"] > rc["uninterrupted_s"] > rc["startup_s"]
    budget = 3 * rc["uninterrupted_s"] + rc["restarts"] * rc["startup_s"]
    assert rc["check_vs_budget"] == pytest.approx(rc["check_s"] / budget)
    assert (
        "target  resume check / its budget" in proc.stdout
        and "[bench] trial 1/1 resume-check:" in proc.stderr
    )


def test_a_saves_costs_are_read_from_its_records() -> None:
    """Saves after steps 3 (written in 1.5 s) and 6 (2.5 s), a step a second but 7 (3 s): steps 4 and 5 run
    during the first write (left out: a process-based save starts its processes then), 7 during the second,
    2, 3, 6, 8 and 9 during none (1, warm-up, is not counted); the first save is left out of the medians and
    given on its own; the final save is none of them."""
    from hpc_ddp.bench.sharding import writes

    times = {1: 101, 2: 102, 3: 103, 4: 104, 5: 105, 6: 106, 7: 109, 8: 110, 9: 111}
    records = [
        {"event": "step", "step": n, "time": float(t), "step_time_s": 3.0 if n == 7 else 1.0}
        for n, t in times.items()
    ]
    records += [
        {"event": "save", "step": 3, "stall_s": 0.5, "write_s": 1.5},
        {"event": "save", "step": 6, "stall_s": 0.1, "write_s": 2.5},
        {"event": "save", "step": 9, "stall_s": 0.3, "write_s": 0.2, "final": True},
    ]
    found = writes(records)
    assert found["stall_s"] == 0.1 and found["write_s"] == 2.5 and found["first_write_s"] == 1.5
    assert found["step_s_during_write"] == 3.0 and found["step_s_quiet"] == 1.0


def test_watchdog_baseline_has_no_comm_hook_and_trains_the_same_steps(tmp_path):
    """Neither variant has a comm hook (DDP's built-in all-reduce); the default marks the end of backward for
    the beacon, a NullBeacon's unwatched rank (the section's `without`) does not; the same parameters after the
    same steps."""
    cfg = TrainConfig(epochs=1, batch_size=50, save_every_epochs=0, max_steps=3, folder=str(tmp_path))
    single = detect({})
    params = []
    with process_group(single, torch.device("cpu")):
        for kwargs in ({}, {"beacon": NullBeacon()}):
            torch.manual_seed(cfg.seed)
            with Trainer(
                cfg,
                single,
                torch.device("cpu"),
                tasks.build(cfg),
                RankLog(0),
                local_checkpoints(cfg),
                **kwargs,
            ) as trainer:
                hooks = len(trainer.strategy.wrapped._comm_hooks)
                trainer.run()
                marked = trainer.clock.grads_ready > 0
            assert hooks == 0 and marked == (not kwargs)
            params.append([p.detach().clone() for p in trainer.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params, strict=True))


def test_watchdog_blocks_split_a_trial():
    assert watching.blocks(60) == [10] * 6
    assert watching.blocks(25) == [10, 10, 5] and watching.blocks(4) == [4]


def test_help_explains_each_section():
    proc = run_module("hpc_ddp.bench", "--help")
    assert proc.returncode == 0
    assert all(f"\n  {section}" in proc.stdout for section in suite.SECTIONS)


def test_bad_arguments_are_one_line_usage_errors():
    for args, expected in (
        (["overhed"], "unknown section 'overhed'"),
        (["--steps", "500"], "Fix: --steps 128 or fewer"),
    ):
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


def overhead(kit: list[float], naive: list[float]) -> dict[str, dict[str, object]]:
    """The overhead section's results as the bench reports them, from per-trial samples/s."""
    per_trial = runs.ratios(kit, naive)
    return {
        "overhead": {
            "kit_samples_per_s": runs.median(kit),
            "naive_samples_per_s": runs.median(naive),
            "tuned_samples_per_s": runs.median(kit),
            "kit_vs_naive": runs.median(per_trial),
            "kit_vs_tuned": 1.0,
            "trials": {"kit": kit, "naive": naive, "tuned": kit},
        }
    }


def test_a_target_every_trial_missed_is_missed_even_on_a_busy_machine() -> None:
    """Load 6.3 on 2 CPUs, and every trial 0.80-0.83x against 1.8x: a miss, not noise (issue 41: the bench
    called a kit at 0.80x, every trial below the target, noise). The line gives the trials' range."""
    results = overhead([810.0, 800.0, 830.0], [1000.0, 1000.0, 1000.0])
    table = report.table(results, SETTINGS, load=6.3, cpus=2).splitlines()
    [line] = [x for x in table if x.startswith("target  kit / hand loop, default")]
    assert line.endswith("0.810  >= 1.8   MISSED (every trial: 0.80-0.83x)"), line
    assert report.NOISY not in line


def test_a_miss_whose_trials_straddle_the_target_is_noisy_and_a_clear_one_is_missed() -> None:
    quiet = 1.0
    wide = overhead([1500.0, 1900.0, 1700.0], [1000.0, 1000.0, 1000.0])  # 1.5-1.9x: one trial met 1.8
    [target] = [t for t in report.targets(wide) if "default" in t.name]
    assert target.spread == pytest.approx(0.4 / 1.7) and target.verdict(quiet, 2).startswith(report.NOISY)
    clear = overhead([1000.0, 1010.0, 990.0], [1000.0, 1000.0, 1000.0])  # 1.0x, trials within 2%
    [target] = [t for t in report.targets(clear) if "default" in t.name]
    assert target.verdict(quiet, 2).startswith("MISSED") and target.as_dict(quiet, 2)["verdict"] == "missed"
    assert target.verdict(9.0, 2).startswith("MISSED")  # a busy machine changes nothing
    near = overhead([1750.0, 1790.0, 1700.0], [1000.0, 1000.0, 1000.0])  # within 3 %, but no trial met it
    [target] = [t for t in report.targets(near) if "default" in t.name]
    assert target.verdict(quiet, 2).startswith("MISSED")
    met = overhead([2000.0, 2100.0, 1000.0], [1000.0, 1000.0, 1000.0])  # met stays met, busy or not
    [target] = [t for t in report.targets(met) if "default" in t.name]
    assert target.verdict(9.0, 2) == "met"
    assert report.Target("x", 0.5, ">=", 0.8).verdict(9.0, 2) == "MISSED"  # no trials: the value is the trial
    below = report.Target("us", 620.0, "<=", 500.0, (450.0, 620.0, 700.0), " us")  # lower is better
    assert below.verdict(quiet, 2).startswith(f"{report.NOISY} (trials 450.00-700.00 us,")
    over = report.Target("us", 620.0, "<=", 500.0, (550.0, 620.0, 700.0), " us")
    assert over.verdict(quiet, 2) == "MISSED (every trial: 550.00-700.00 us)"


def test_the_header_names_the_fsdp_sections_own_task_and_batch() -> None:
    header = report.header
    s = Settings(trials=1, steps=6, world_size=4, batch_size=32, work=Path("."), quick=False)
    assert header(s, ["fsdp"]).startswith(
        "hpc_ddp.bench: task hpc_ddp.bench.sharding:wide, 4 ranks x batch 16, 9 steps"  # 3 saves at least
    )
    assert "task mlp, 4 ranks x batch 32" in header(s, ["overhead", "fsdp"])
    assert "fsdp: its own model and batch" in header(s, ["overhead", "fsdp"])
    assert "fsdp" not in header(s, ["overhead"])


def test_the_resume_sections_options_make_the_check_try_every_kind_of_stop() -> None:
    """200 optimizer steps in 2 epochs (an epoch's end inside the run), --grad-accum 2, evaluations and saves
    inside the run; the batch chosen so that the epochs hold them at --world-size ranks; --quick: 8 steps."""
    from hpc_ddp.bench import resuming

    def given(s: Settings) -> dict[str, str]:
        args = resuming.options(s)
        return dict(zip(args[::2], args[1::2], strict=True))

    full = given(SETTINGS)
    assert full["--epochs"] == "2" and full["--max-steps"] == "200" and full["--grad-accum"] == "2"
    batch = int(full["--batch-size"])
    assert resuming.SAMPLES // (SETTINGS.world_size * batch * 2) == 100  # optimizer steps an epoch
    assert 0 < int(full["--eval-every-steps"]) < 200 and 0 < int(full["--save-every-steps"]) < 200
    quick = given(dataclasses.replace(SETTINGS, quick=True, world_size=1))
    assert quick["--max-steps"] == "8" and resuming.SAMPLES // (int(quick["--batch-size"]) * 2) == 4
    with pytest.raises(runs.RunFailed, match="too many ranks"):
        resuming.options(dataclasses.replace(SETTINGS, world_size=1000))


def test_a_figure_no_trial_measured_is_none_and_printed_n_a():
    """The trials that had nothing to measure (NaN: no step ran during a later write) are left out of the
    median; with none left the figure is None, printed "n/a", never a NaN in bench.json."""
    from hpc_ddp.bench.report import _s
    from hpc_ddp.bench.runs import median_of_measured

    nan = float("nan")
    assert median_of_measured([2.0, nan, 4.0]) == 3.0
    assert median_of_measured([nan, 5.0]) == 5.0
    assert median_of_measured([nan, nan]) is None and median_of_measured([]) is None
    assert _s(None) == "n/a" and _s(1.234) == "1.23"
