"""A real local run, then its report, opened in headless Chromium: the page shows the plots, and its numbers
are the ones metrics.jsonl holds."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import run_module
from report_check import assert_report_matches_records, check_report
from test_launch_local import finish, read_until, start

from hpc_ddp.run.records.metrics import read_records

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
    # The headline: the training loss smoothed over the last steps, labelled so (no evaluation set here).
    assert re.search(r", step 50, smoothed training loss \S+ \(mean of the last 10 steps\), ", checked.line)


def offline_trackers(tmp_path: Path) -> dict[str, str]:
    """wandb offline, MLflow's file store: nothing leaves the machine; wandb's settings stay in tmp_path."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps its file store behind this
    }


def assert_one_tracker_run_each(folder: Path, tmp_path: Path, steps: list[int]) -> None:
    """--tracker wandb,mlflow over a preempted run (issue 37 item 2): one tracker run each, which the second
    start resumed; the options logged once; every step once, in order; the attempts and why they ended."""
    from mlflow.tracking import MlflowClient
    from tracker_check import wandb_run

    ids = json.loads((folder / "trackers.json").read_text())
    # wandb: one offline folder per start, both with the run's id (`wandb sync` makes them one run).
    starts = [wandb_run(f) for f in sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))]
    assert [w["id"] for w in starts] == [ids["wandb"]["id"]] * 2, starts
    assert json.loads(starts[0]["config"]["task"]) == "slow_tasks:slow" and "task" not in starts[1]["config"]
    logged = [int(row["_step"]) for w in starts for row in w["history"] if "train/loss" in row]
    assert logged == sorted(set(steps)) == list(range(1, 4 * 32 + 1))
    assert "attempt 2 on " in json.loads(starts[1]["summary"]["attempts"])[1]
    # MLflow: one run, its status, the options as parameters, each step once, the attempts as an artifact.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the test reads the file store the run wrote
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"]["id"])
    assert run.info.status == "FINISHED" and run.data.params["task"] == "slow_tasks:slow"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 129))
    assert run.data.tags["restarts"] == "1"
    listed = Path(client.download_artifacts(run.info.run_id, "attempts.txt", str(tmp_path))).read_text()
    assert listed.startswith("attempt 1 on ") and "preempted" in listed.splitlines()[0], listed
    assert len(client.search_runs([run.info.experiment_id])) == 1


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
        "--tracker",
        "wandb,mlflow",
        SLOW_TASK_SLEEP_S="0.03",
        **offline_trackers(tmp_path),
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
    assert_one_tracker_run_each(folder, tmp_path, [r["step"] for r in steps])
