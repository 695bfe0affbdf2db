"""Sweeps (issue 44): a sweep's trials are grouped in the trackers, for real (wandb offline, an MLflow file
store): one W&B group named as the sweep, one MLflow parent run with every trial a child of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_report_run import offline_trackers

from hpc_ddp.run.sinks import trackers

pytestmark = [pytest.mark.deadline(120)]


def trial_folders(tmp_path: Path, sweep: bool) -> list[Path]:
    top = tmp_path / "lrs"
    top.mkdir()
    if sweep:
        (top / "sweep.json").write_text('{"version": 1, "trials": []}\n')
    folders = [top / "lr=0.1", top / "lr=0.2"]
    for folder in folders:
        folder.mkdir()
    return folders


@pytest.mark.parametrize("sweep", [True, False])
def test_a_sweeps_trials_are_one_wandb_group_and_one_mlflow_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sweep: bool
) -> None:
    from mlflow.tracking import MlflowClient
    from tracker_check import wandb_records

    from hpc_ddp.run.sinks.mlflow_run import MlflowRun
    from hpc_ddp.run.sinks.wandb_run import WandbRun

    for key, value in offline_trackers(tmp_path).items():
        monkeypatch.setenv(key, value)
    folders = trial_folders(tmp_path, sweep)
    for folder in folders:
        for sink in (WandbRun(folder, {"lr": 0.1}), MlflowRun(folder, {"lr": 0.1})):
            sink.close()
    groups = []
    for folder in folders:
        (run_file,) = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
        runs = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
        groups.append(runs[0].run_group)
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    parents = [
        client.get_run(json.loads((f / trackers.IDS).read_text())["mlflow"]["id"]).data.tags.get(
            "mlflow.parentRunId"
        )
        for f in folders
    ]
    if not sweep:
        assert groups == ["", ""] and parents == [None, None] and trackers.sweep_of(folders[0]) is None
        return
    assert groups == ["lrs", "lrs"]
    parent = json.loads((folders[0].parent / "mlflow.json").read_text())["id"]
    assert parents == [parent, parent] and client.get_run(parent).info.run_name == "lrs"


def test_the_first_trial_to_ask_makes_the_shared_entry_the_others_read_it(tmp_path: Path) -> None:
    made: list[int] = []

    def make() -> dict[str, int]:
        made.append(1)
        return {"id": len(made)}

    path = tmp_path / "mlflow.json"
    assert trackers.shared_entry(path, make) == {"id": 1}
    assert trackers.shared_entry(path, make) == {"id": 1} and len(made) == 1
    path.unlink()

    # Another trial wrote it between this one's read and its link: this one reads the other's.
    def racing() -> dict[str, int]:
        path.write_text('{"id": 9}\n')
        return {"id": 2}

    assert trackers.shared_entry(path, racing) == {"id": 9}
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.json"]  # no temporary file left
