"""The training step's hot path keeps the kit's own work small (issue 41): a steady-state step does no file I/O,
captures no process-wide RNG and allocates nothing that grows with the run; what rank 0 records per step goes
out in batches (metrics.jsonl) or into a shared mapping (step.json). Measured on the real loop, in-process, on a
real one-rank gloo group, by a profile of every call a step makes; and the rules' unit tables."""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import local_checkpoints

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.log import RankLog
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.loop.trainer import Trainer
from hpc_ddp.run.records import metrics, reached
from hpc_ddp.run.sinks import jsonl

# What a steady-state step must not call: file I/O and the process-wide RNG's capture (a checkpoint's work).
FILE_IO = {"open", "write", "pwrite", "fsync", "fdatasync", "writelines", "flush"}
RNG_CAPTURE = {"get_rng_state", "getstate", "get_state", "get_rng_state_all"}


PROFILED = (10, 30)  # steps whose calls are profiled (warmed up)
HEAP = (300, 700)  # steps over which the Python heap is measured (no profile then)


def steady_run(tmp_path: Path) -> tuple[dict[int, set[str]], int, list[tracemalloc.Snapshot]]:
    """A real Trainer's run: the names of every function each step of PROFILED called, the run's record
    cadence, and the Python heap at each end of HEAP."""
    cfg = TrainConfig(epochs=10, batch_size=1, max_steps=6000, save_every_epochs=0, log_every_s=1e9)
    cfg = cfg.with_folder(str(tmp_path))
    env = dist_env.detect({})
    calls: dict[int, set[str]] = {}
    heap: list[tracemalloc.Snapshot] = []

    with process_group(env, torch.device("cpu")):
        torch.manual_seed(cfg.seed)
        with Trainer(
            cfg, env, torch.device("cpu"), tasks.build(cfg), RankLog(0), local_checkpoints(cfg)
        ) as trainer:
            pos = trainer.pos

            def profile(frame: Any, event: str, arg: Any) -> None:
                name = arg.__name__ if event == "c_call" else frame.f_code.co_name
                calls.setdefault(pos.step, set()).add(name)

            original = trainer._count

            def count(agreed: Any, size: int) -> None:
                original(agreed, size)
                if pos.step == PROFILED[0]:
                    sys.setprofile(profile)
                elif pos.step == PROFILED[1]:
                    sys.setprofile(None)
                    tracemalloc.start(16)
                if pos.step in HEAP:
                    gc.collect()  # what only waits for the cycle collector is not kept
                    heap.append(tracemalloc.take_snapshot())
                if pos.step >= HEAP[1]:
                    raise StopIteration  # enough: out of run() (the Trainer closes as on any error)

            trainer._count = count  # type: ignore[method-assign]
            try:
                trainer.run()
            except StopIteration:
                pass
            finally:
                sys.setprofile(None)
                tracemalloc.stop()
            every = metrics.point_every(trainer.metrics.total_steps, HEAP[1])
    return calls, every, heap


def test_a_steady_state_step_does_no_file_io_no_rng_capture_and_keeps_no_growing_state(
    tmp_path: Path,
) -> None:
    calls, every, heap = steady_run(tmp_path)
    assert every == 2  # 6000 steps, 5000 points: a "step" record every other step, held and written by time
    # A step's counting ends it (pos.step moves on there): its records are under the next number.
    assert sorted(calls) == list(range(PROFILED[0], PROFILED[1] + 1))
    for step, names in calls.items():
        assert not names & FILE_IO, f"step {step} did file I/O: {sorted(names & FILE_IO)}"
        assert not names & RNG_CAPTURE, f"step {step} captured an RNG: {sorted(names & RNG_CAPTURE)}"
    assert calls[20] >= {"forward", "backward", "step", "launch", "wait"}  # the profile sees the step itself
    # What the kit's frames allocated and kept over HEAP's steps (after warm-up: torch's small caches are full
    # by then): a float and a list slot a step for the step times (bounded: the next test), about 33 bytes; a
    # record kept per step would be hundreds. metrics.jsonl's held step records are bounded by time (a test
    # below), not by steps: left out.
    kept = [
        tracemalloc.Filter(True, "*/hpc_ddp/*", all_frames=True),
        tracemalloc.Filter(False, jsonl.__file__, all_frames=True),
    ]
    before, after = (snap.filter_traces(kept) for snap in heap)
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    steps = HEAP[1] - HEAP[0]
    assert grown < steps * 64, f"the kit kept {grown} bytes more in {steps} steps: " + "; ".join(
        str(stat) for stat in after.compare_to(before, "traceback")[:3]
    )


def test_the_step_times_kept_are_bounded_whatever_the_run_length(tmp_path: Path) -> None:
    env = dist_env.detect({})
    recorder = metrics.Recorder(None, TrainConfig(), env)  # not rank 0: times only
    pos = Position()
    for step in range(5 * metrics.STEP_TIMES_KEPT):
        pos.step = step + 1
        recorder.step(pos, 1.0, 1, task_s=0.0)
        assert len(recorder.step_times) < 2 * metrics.STEP_TIMES_KEPT
    assert len(recorder.step_times) >= metrics.STEP_TIMES_KEPT  # the recent ones stay (watchdog, ETA)


def test_step_records_are_held_and_written_together_and_other_records_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(jsonl.time, "monotonic", lambda: clock[0])
    path = tmp_path / "metrics.jsonl"
    sink = jsonl.JsonLines(path)
    written = lambda: [json.loads(line)["step"] for line in path.read_text().splitlines()]  # noqa: E731
    sink.record({"event": "step", "step": 1})
    sink.record({"event": "step", "step": 2})
    assert written() == []  # held
    clock[0] += jsonl.STEP_EVERY_S
    sink.record({"event": "step", "step": 3})  # the first held has waited its second: all three go
    assert written() == [1, 2, 3]
    sink.record({"event": "step", "step": 4})
    sink.record({"event": "save", "step": 4})  # any other record goes at once, with what is held before it
    assert written() == [1, 2, 3, 4, 4]
    sink.record({"event": "step", "step": 5})
    sink.close()  # nothing held is lost at the end
    assert written() == [1, 2, 3, 4, 4, 5]


def test_step_json_is_rewritten_in_a_shared_mapping_that_readers_see_at_once(tmp_path: Path) -> None:
    writer = reached.StepFile(tmp_path)
    writer.reach(7)
    assert reached.read(tmp_path)[0] == 7  # type: ignore[index]
    writer.reach(12345)
    assert reached.read(tmp_path)[0] == 12345  # type: ignore[index]
    assert (tmp_path / "step.json").stat().st_size == reached.WIDTH
    writer.close()
    assert reached.read(tmp_path)[0] == 12345  # type: ignore[index]  # the file keeps the last line
    (tmp_path / "step.json").write_bytes(b'{"step": 9, "ti')  # a reader that finds a cut line: None
    assert reached.read(tmp_path) is None
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    blocked = reached.StepFile(readonly / "sub")  # a folder that cannot hold it: advisory, never an error
    blocked.reach(1)
    blocked.reach(2)
    assert blocked.failed


def test_the_straggler_rows_ride_in_the_steps_packet_between_the_votes_and_the_extras() -> None:
    """One all-reduce a step carries the straggler rows too (issue 41): on a real one-rank gloo group, the
    packet's rows come back by rank, and the loss, votes and extras around them keep their values."""
    from hpc_ddp.run.loop import agreed

    env = dist_env.detect({})
    with process_group(env, torch.device("cpu")):
        loss, extras = torch.tensor(1.5), {"acc": torch.tensor(0.25), "n": 3.0}
        plain = agreed.launch(loss, 2, 0.0, 0.0, extras, ["acc", "n"], 1.0).wait()
        rows = [0.5, 2.0, 0.25, 5.0]
        both = agreed.launch(loss, 2, 0.0, 0.0, extras, ["acc", "n"], 1.0, rows).wait()
    assert plain.rows == () and both.rows == (tuple(rows),)
    assert both._replace(rows=()) == plain == (1.5, 2.0, 0.0, 0.0, 0.0, 0.0, (0.25, 3.0), 1.0, ())
