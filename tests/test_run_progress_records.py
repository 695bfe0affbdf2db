"""What rank 0 records for the report and the supervisors (issue 21 item 5, issue 22 item 11): a "step" record
for every step of a run of up to POINTS steps whatever --log-every-s, a bounded number in a long run (a few MB
for a million steps), the last step trained always recorded, and step.json, which tells the step an attempt
reached even when it died between two records."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_launch_local import finish, start
from test_report import summary

from hpc_ddp.cluster.env import detect
from hpc_ddp.launch import supervisor
from hpc_ddp.ledger import attempts
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.records import metrics, reached
from hpc_ddp.run.records.metrics import Recorder, read_records


def recorder(folder: Path, total: int, log_every_s: float = 30.0) -> Recorder:
    return Recorder(folder, TrainConfig(log_every_s=log_every_s), detect({}), total_steps=total)


def train(rec: Recorder, steps: range, world: int = 0) -> None:
    """`rec` through these steps as the trainer drives it: a step, and every 5 steps the ranks' windows."""
    pos = Position()
    for step in steps:
        pos.step, pos.epoch = step, step // 1000
        rec.step(pos, loss=1.0 / step, samples=64, lr=0.01, data_s=0.001)
        if world and step % 5 == 0:
            rows = [[0.001, 0.01, 0.0, 5.0]] * world
            if step == 1230:  # one slow window of rank 3 in the whole run
                rows = rows[:3] + [[0.001, 0.5, 0.0, 5.0]] + rows[4:]
            rec.ranks(pos, rows)


def by(records: list[dict], event: str) -> list[dict]:
    return [r for r in records if r["event"] == event]


def test_a_short_run_records_every_step_whatever_log_every_s(tmp_path: Path) -> None:
    """The default --log-every-s 30 in a run of seconds: every step has its point (it had none but the
    epochs'), the last one included, and the "end" comes after it."""
    rec = recorder(tmp_path, total=96)
    rec.start(Position(), "7", 0, False, 2, 1.0)
    train(rec, range(1, 97))
    rec.end(Position(epoch=5, step=96))
    rec.close()
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in by(records, "step")] == list(range(1, 97))
    assert records[-1]["event"] == "end" and by(records, "step")[-1]["loss"] == 1.0 / 96


def test_a_long_run_records_a_bounded_number_of_points_and_ranks(tmp_path: Path) -> None:
    """A million-step run: a "step" record every 200 steps and a "ranks" record every 1000 (each rank's slowest
    window since the last: one slow window still shows), so that the whole run writes a few MB. Its first
    20,000 steps are trained here; the size of the rest follows from the cadence."""
    rec = recorder(tmp_path, total=1_000_000)
    assert metrics.point_every(1_000_000, 1) == 200 and metrics.ranks_every(1_000_000) == 1000
    rec.start(Position(), "7", 0, False, 8, 1.0)
    train(rec, range(1, 20_001), world=8)
    records = read_records(tmp_path / "metrics.jsonl")
    steps, ranks = by(records, "step"), by(records, "ranks")
    assert [r["step"] for r in steps] == list(range(200, 20_001, 200))
    assert [r["step"] for r in ranks] == list(range(1000, 20_001, 1000))
    assert [max(r["step_time_s"]) > 0.05 for r in ranks] == [k == 1 for k in range(20)]  # steps 1005-2000
    size = (tmp_path / "metrics.jsonl").stat().st_size
    per_million = size * 1_000_000 / 20_000
    assert per_million < 3_000_000, per_million  # bytes for a million steps


def test_without_a_total_the_cadence_thins_out_as_the_run_grows() -> None:
    every = [metrics.point_every(0, s) for s in (1, 4_999, 5_000, 10_000, 20_000, 40_000, 1_000_000)]
    assert every == [1, 1, 2, 4, 8, 16, 256]


def test_a_process_stopped_between_two_records_records_its_last_step_on_its_way_out(tmp_path: Path) -> None:
    """An error in step 251 of a long run: the trainer closes the recorder, which writes step 250's record
    (the last point was step 200's); step.json said 250 all along."""
    rec = recorder(tmp_path, total=1_000_000)
    rec.start(Position(), "7", 0, False, 2, 1.0)
    began = time.time()
    train(rec, range(1, 251))
    assert reached.read(tmp_path) is not None and reached.read(tmp_path)[0] == 250
    rec.close()
    rec.close()  # idempotent
    assert [r["step"] for r in by(read_records(tmp_path / "metrics.jsonl"), "step")] == [200, 250]
    assert supervisor.step_reached(tmp_path, began) == 250


def test_step_json_is_one_line_rewritten_in_place(tmp_path: Path) -> None:
    rec = recorder(tmp_path, total=1_000_000)
    train(rec, range(1, 5))
    raw = (tmp_path / "step.json").read_bytes()
    assert len(raw) == reached.WIDTH and raw.endswith(b"\n") and json.loads(raw)["step"] == 4
    train(rec, range(100_000, 100_002))  # a longer number: still one line of the same width
    assert (tmp_path / "step.json").stat().st_size == reached.WIDTH
    rec.close()


def test_step_reached_reads_step_json_of_this_attempt_else_the_records(tmp_path: Path) -> None:
    records = [
        {"event": "start", "time": 100.0, "step": 0},
        {"event": "step", "time": 110.0, "step": 200},
        {"event": "start", "time": 200.0, "step": 200},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert supervisor.step_reached(tmp_path, 100) == 200  # no step.json: the records (an older version's run)
    (tmp_path / "step.json").write_text('{"step": 237, "time": 150.0}\n')
    assert supervisor.step_reached(tmp_path, 100) == 237  # the attempt that began at 100 reached 237
    assert (
        supervisor.step_reached(tmp_path, 200) == 200
    )  # the one that began at 200 reached no step of its own
    (tmp_path / "step.json").write_text('{"step": 23')  # caught mid-write: the records
    assert supervisor.step_reached(tmp_path, 100) == 200


@pytest.mark.slow  # a local 1 x 2 run: about 10 s
@pytest.mark.deadline(120)
def test_an_attempt_killed_between_two_records_ends_at_the_step_it_reached(tmp_path: Path) -> None:
    """Rank 0 SIGKILLed in step 38 of a 320,000-step run (a "step" record every 64 steps; the epoch's
    checkpoint at step 32): no record of steps 33-37 exists, and no exit path ran. The launcher's end line
    still says step 37, and 5 steps lost (the records alone said step 32 now, and 35 before, from a "ranks"
    record every 5 steps: 0 or 3 steps lost)."""
    folder = tmp_path / "run"
    proc = start(
        folder,
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--task",
        "progress_tasks:killed_at",
        "--batch-size",
        "8",
        "--epochs",
        "10000",
        "--max-restarts",
        "0",
        SLOW_TASK_SLEEP_S="0.01",
        KILL_AT_STEP="38",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent)]),
    )
    code, out = finish(proc)
    assert code != 0, out
    [attempt] = attempts.read(folder)
    assert (attempt.outcome, attempt.step, attempt.checkpoint, attempt.lost_steps) == ("failed", 37, 32, 5), (
        out
    )
    assert max(r.get("step", 0) for r in read_records(folder / "metrics.jsonl")) == 32
    s = summary(folder)  # the report: the attempt's last step and the steps it lost
    assert (s.steps, s.lost_steps, s.attempts[0].last_step) == (37, 5, 37)


def test_the_end_record_gives_the_kits_own_work_and_the_norms_part_of_it(tmp_path: Path) -> None:
    """kit_us_per_step (the step less its data wait and the task's work) and, apart, grad_norm_us_per_step
    (issue 46's one reduction for the records, part of it): per warm step, the first one left out."""
    rec = recorder(tmp_path, total=3)
    rec.start(Position(), "7", 0, False, 2, 1.0)
    pos = Position()
    for step in (1, 2, 3):
        pos.step = step
        time.sleep(0.01)
        rec.step(pos, loss=1.0, samples=64, lr=0.01, data_s=0.0, task_s=0.0, norm_s=0.004 * step)
    rec.end(pos)
    rec.close()
    end = by(read_records(tmp_path / "metrics.jsonl"), "end")[0]
    assert end["grad_norm_us_per_step"] == pytest.approx(1e6 * (0.008 + 0.012) / 2)
    assert end["kit_us_per_step"] >= 9000  # the whole step is the kit's here: no task time was given
