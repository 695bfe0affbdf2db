"""Where rank 0's metrics go (hpc_ddp.run.sinks): one interface, metrics.jsonl and TensorBoard two of its sinks
(issue 37 item 2, the seam of issue 34): every sink gets the same records; one that fails is dropped with one
warning while metrics.jsonl goes on; metrics.jsonl's own failure still ends the run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.cluster.env import detect
from hpc_ddp.run import sinks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.records.metrics import Recorder, read_records


class Kept(sinks.Sink):
    name = "kept"

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.curves: list[tuple[int, dict[str, float | None]]] = []
        self.closed = 0

    def record(self, record: Mapping[str, Any]) -> None:
        self.records.append(dict(record))

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        self.curves.append((step, dict(values)))

    def close(self) -> None:
        self.closed += 1


class Broken(Kept):
    name = "broken tracker"

    def record(self, record: Mapping[str, Any]) -> None:
        if record["event"] == "step":
            raise ConnectionError("the server went away")
        super().record(record)


def run(rec: Recorder, steps: int) -> None:
    pos = Position()
    rec.start(pos, "7", 0, False, 2, 1.0)
    for step in range(1, steps + 1):
        pos.step = step
        rec.step(pos, loss=1.0 / step, samples=8, lr=0.1, data_s=0.0, extras={"accuracy": 0.5})
    rec.eval(pos, 16, {"loss": 0.25})
    rec.save(0, steps, 0.01, 0.02, final=True)
    rec.end(pos)
    rec.close()


def test_every_sink_gets_the_records_of_metrics_jsonl_and_every_steps_scalars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = Kept()
    monkeypatch.setattr(sinks, "optional", lambda folder, cfg, params=None: [kept])
    rec = Recorder(tmp_path, TrainConfig(), detect({}), total_steps=3)
    run(rec, 3)
    assert kept.records == read_records(tmp_path / "metrics.jsonl")
    assert [r["event"] for r in kept.records] == ["start", "step", "step", "step", "eval", "save", "end"]
    by_step = {step: values for step, values in kept.curves if "train/loss" in values}
    assert sorted(by_step) == [1, 2, 3] and by_step[2]["train/loss"] == 0.5
    assert by_step[3]["train/accuracy"] == 0.5 and by_step[3]["train/lr"] == 0.1
    assert (3, {"eval/loss": 0.25}) in kept.curves
    assert (3, {"time/checkpoint_stall_s": 0.01, "time/checkpoint_write_s": 0.02}) in kept.curves
    assert kept.closed == 1


def test_a_failing_optional_sink_is_dropped_with_one_warning_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken, kept = Broken(), Kept()
    monkeypatch.setattr(sinks, "optional", lambda folder, cfg, params=None: [broken, kept])
    said: list[str] = []
    rec = Recorder(tmp_path, TrainConfig(), detect({}), total_steps=3, warn=said.append)
    run(rec, 3)
    assert len(said) == 1 and said[0].startswith("broken tracker: ConnectionError: the server went away;"), (
        said
    )
    assert [r["event"] for r in broken.records] == ["start"] and broken.closed == 1
    assert [r["event"] for r in kept.records] == [
        r["event"] for r in read_records(tmp_path / "metrics.jsonl")
    ]
    assert len([r for r in kept.records if r["event"] == "step"]) == 3


def test_metrics_jsonl_failing_still_ends_the_run(tmp_path: Path) -> None:
    """The supervisors and the report read metrics.jsonl: its error is not swallowed like a tracker's."""
    folder = tmp_path / "gone"
    rec = Recorder(folder, TrainConfig(), detect({}), total_steps=3, warn=pytest.fail)
    with pytest.raises(OSError):
        rec.start(Position(), "7", 0, False, 2, 1.0)


def test_tracker_names_and_missing_packages_are_usage_errors_before_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpc_ddp.errors import UsageError
    from hpc_ddp.run.sinks import trackers

    assert trackers.names("wandb, mlflow") == ["wandb", "mlflow"] and trackers.names("none") == []
    assert (
        trackers.problem("neptune")
        == "--tracker neptune: no tracker 'neptune'; choose from wandb, mlflow (comma-separated)"
    )
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    assert trackers.problem("mlflow") == (
        "--tracker mlflow needs the mlflow package, which this Python cannot import. Fix: pip install "
        "mlflow-skinny (or mlflow), or drop --tracker"
    )
    with pytest.raises(UsageError, match="--tracker wandb needs the wandb package"):
        TrainConfig(tracker="wandb")


def test_a_tracker_gets_the_tags_tensorboard_uses() -> None:
    from hpc_ddp.run.sinks.trackers import scalars_of

    step = {"event": "step", "step": 3, "loss": 0.5, "lr": 0.1, "samples_per_s": None, "metrics": {"acc": 1}}
    assert scalars_of(step) == {"train/loss": 0.5, "train/lr": 0.1, "train/acc": 1.0}
    assert scalars_of({"event": "eval", "step": 4, "metrics": {"loss": 0.25}}) == {"eval/loss": 0.25}
    best = {"event": "best", "step": 4, "metric": "accuracy", "value": 0.9, "mode": "max"}
    assert scalars_of(best) == {"best/accuracy": 0.9} and scalars_of({"event": "start", "step": 0}) == {}
