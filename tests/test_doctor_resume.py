"""`python -m hpc_ddp.doctor resume` (issue 32, build item 10): where the stops go (a pure table), how the first
divergence is found and named (a pure table), and the check on real local runs: an exact task passes (and its
finished run stays finished: tests/test_resume_matrix.py, over many task shapes), a task with state outside the
checkpoint is named, part and step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp.doctor import divergence, stops
from hpc_ddp.doctor.divergence import Evidence
from hpc_ddp.doctor.probe import Plan, Stop

# ----- where the stops go ------------------------------------------------------------------------------------

SHAPE = stops.Shape(
    micro={s: 2 for s in range(1, 17)},  # 16 steps of 2 micro-batches (--grad-accum 2)
    evals={5: 3, 8: 3, 10: 3, 15: 3, 16: 3},
    epoch_ends=[8, 16],
    saves=[4, 8, 12],
)


@pytest.mark.parametrize("seed", range(20))
def test_stops_cover_every_kind_of_point_once_in_run_order_one_per_attempt(seed: int) -> None:
    chosen, skipped = stops.choose(SHAPE, seed)
    assert skipped == []
    assert sorted(s.what for s in chosen) == sorted(
        [stops.LAST, stops.ACCUM, stops.EVAL, stops.EPOCH_END, stops.SAVE, stops.AFTER_RESUME]
    )
    assert [s.attempt for s in chosen] == list(range(len(chosen)))
    steps = [s.step for s in chosen]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # two stops never share a step
    by = {s.what: s for s in chosen}
    # The run's last step (a micro-batch of it, or of its final evaluation): stop there, then only its end to do.
    assert by[stops.LAST].key() in [("train", 16, 0), ("train", 16, 1)] + [("eval", 16, b) for b in range(3)]
    assert by[stops.EPOCH_END].key() == ("train", 8, 0)  # an epoch's last step, the next epoch after it
    assert by[stops.ACCUM].index < 1 and by[stops.ACCUM].step < 16  # a micro-batch before the step's last
    assert by[stops.SAVE].step - 1 in SHAPE.saves and by[stops.SAVE].save
    assert by[stops.SAVE].step - 1 not in steps  # else that save is the other stop's, and none is in flight
    assert by[stops.EVAL].kind == "eval" and by[stops.EVAL].index in range(3)
    after = by[stops.AFTER_RESUME]
    assert after.step - 1 in steps and after.key() == ("train", after.step, 0)


def test_stops_are_seeded_and_say_what_the_run_cannot_try() -> None:
    assert stops.choose(SHAPE, 7) == stops.choose(SHAPE, 7)
    assert len({tuple(stops.choose(SHAPE, seed)[0]) for seed in range(10)}) > 1
    plain = stops.Shape(micro={s: 1 for s in range(1, 41)})  # 40 plain steps, no epoch end, no eval, no save
    chosen, skipped = stops.choose(plain, 0)
    assert sorted(s.what for s in chosen) == sorted([stops.LAST, stops.STEP, stops.AFTER_RESUME])
    assert next(s for s in chosen if s.what == stops.LAST).key() == ("train", 40, 0)
    assert [line.split(":")[0] for line in skipped] == [stops.EPOCH_END, stops.EVAL, stops.SAVE]
    assert "raise --steps" in skipped[0] and "--save-every-steps" in skipped[2]
    # The run's last step: its training or its final evaluation at even odds, however many batches that has.
    wide = stops.Shape(micro={s: 1 for s in range(1, 9)}, evals={8: 4})
    picks = [next(s for s in stops.choose(wide, seed)[0] if s.what == stops.LAST) for seed in range(200)]
    assert 70 <= sum(s.kind == "train" for s in picks) <= 130  # 1 of 5 points: 40 of 200 without the odds
    # Ended by --max-steps inside an epoch: its epoch record is at the last step, which is no epoch's end.
    cut = stops.Shape(micro={s: 1 for s in range(1, 8)}, epoch_ends=[4, 7])
    by = {s.what: s for s in stops.choose(cut, 0)[0]}
    assert by[stops.LAST].key() == ("train", 7, 0) and by[stops.EPOCH_END].key() == ("train", 4, 0)
    one = stops.describe(Stop(0, "eval", 10, 1, stops.EVAL), {}, {10: 3})
    assert one == "during an evaluation: batch 2 of 3 of the evaluation at step 10"


# ----- the first divergence ------------------------------------------------------------------------------------


def batch(kind: str, step: int, index: int, attempt: int = 0, **fields: object) -> dict[str, object]:
    record: dict[str, object] = {
        "a": attempt,
        "k": kind,
        "s": step,
        "i": index,
        "data": "d",
        "rng": {"torch": "t"},
    }
    if kind == "train" and index == 0:
        record.update(params={"w": "p"}, buffers={"bn.running_mean": "b"}, optimizer={"0.momentum": "o"})
    record.update(fields)
    return record


def run(*records: dict[str, object], **kw: object) -> Evidence:
    trace = {(r["k"], r["s"], r["i"], 0): r for r in records}  # type: ignore[misc]
    base: dict[str, object] = {
        "losses": {1: 1.0, 2: 0.5},
        "evals": {2: (8, {"loss": 0.25})},
        "epochs": {2: [(0, 0.75)]},
        "best": 2,
    }
    return Evidence(trace=trace, **{**base, **kw})  # type: ignore[arg-type]


STRAIGHT = [batch("train", 1, 0), batch("train", 1, 1), batch("train", 2, 0), batch("eval", 2, 0)]


def changed(position: int, **fields: object) -> list[dict[str, object]]:
    records = [dict(r) for r in STRAIGHT]
    records[position].update(fields)
    return records


@pytest.mark.parametrize(
    ("stopped", "part", "name", "step"),
    [
        (run(*changed(1, data="x")), divergence.DATA, "", 1),
        (run(*changed(1, rng={"torch": "t", "numpy": "n"})), divergence.RNG, "numpy", 1),
        (run(*changed(2, params={"w": "q"})), divergence.PARAMS, "w", 2),
        (run(*changed(2, buffers={"bn.running_mean": "c"})), divergence.BUFFERS, "bn.running_mean", 2),
        (run(*changed(2, optimizer={})), divergence.OPTIMIZER, "0.momentum", 2),
        (run(*STRAIGHT, losses={1: 1.0, 2: 0.25}), divergence.LOSS, "", 2),
        (run(*changed(3, data="x")), divergence.EVAL_DATA, "", 2),
        (run(*STRAIGHT, evals={2: (8, {"loss": 0.5})}), divergence.EVALS, "loss", 2),
        (run(*STRAIGHT[:3]), divergence.LOST, "", 2),  # the evaluation's batch never came
        (run(*STRAIGHT, evals={}), divergence.LOST, "the evaluation", 2),
        (run(*STRAIGHT, batch("train", 3, 0)), divergence.EXTRA, "", 3),
        # The run's end lost (a stop in its last step taken for a finished run), or done twice; another mean.
        (run(*STRAIGHT, epochs={}), divergence.LOST, "the epoch's record", 2),
        (run(*STRAIGHT, epochs={2: [(0, 0.75)] * 2}), divergence.EXTRA, "the epoch's record", 2),
        (run(*STRAIGHT, epochs={2: [(0, 0.5)]}), divergence.EPOCHS, "", 2),
        (run(*STRAIGHT, model={"w": "z"}), divergence.MODEL, "w", None),
        (run(*STRAIGHT, best=1), divergence.BEST, "", None),
    ],
)
def test_the_first_divergence_is_the_first_thing_that_differs_in_run_order(
    stopped: Evidence, part: str, name: str, step: int | None
) -> None:
    found = divergence.first_divergence(run(*STRAIGHT), stopped)
    assert found is not None
    assert (found.part, found.name, found.step) == (part, name, step)


def test_equal_runs_have_no_divergence_and_data_comes_before_what_it_feeds() -> None:
    assert divergence.first_divergence(run(*STRAIGHT), run(*STRAIGHT)) is None
    # Both the batch and the generators differ at micro-batch 1 of step 1: the data is named (it comes first),
    # though a later parameter differs too.
    both = changed(1, data="x", rng={"torch": "u"})
    both[2] = {**both[2], "params": {"w": "q"}}
    found = divergence.first_divergence(run(*STRAIGHT), run(*both))
    assert found is not None and (found.part, found.where) == (
        divergence.DATA,
        "micro-batch 1 of step 1 on rank 0",
    )


def test_the_explanation_names_the_stop_it_followed_the_cause_and_the_fix() -> None:
    stopped_at = [(("train", 1, 1), "within gradient accumulation: micro-batch 2 of 2 of step 1")]
    found = divergence.first_divergence(run(*STRAIGHT), run(*changed(2, buffers={"bn.running_mean": "c"})))
    assert found is not None
    lines = divergence.explain(found, stopped_at)
    assert (
        lines[0]
        == "first divergence: a buffer (bn.running_mean) at step 2: micro-batch 0 of step 2 on rank 0"
    )
    assert (
        lines[1]
        == "  after stop 1 (within gradient accumulation: micro-batch 2 of 2 of step 1), which the run resumed from"
    )
    assert lines[2] == "  uninterrupted: 'b'; stopped: 'c'"
    assert lines[3].startswith("  likely cause: a buffer differs") and lines[4].startswith("  fix: ")
    # Before any stop: the two runs are not even deterministic.
    found = divergence.first_divergence(run(*STRAIGHT), run(*changed(0, rng={"torch": "u"})))
    assert found is not None
    assert "two starts of the same command already differ" in "\n".join(divergence.explain(found, stopped_at))
    # A lost evaluation says so.
    found = divergence.first_divergence(run(*STRAIGHT), run(*STRAIGHT[:3]))
    assert found is not None
    assert "a stop in the step at which an evaluation was due" in "\n".join(
        divergence.explain(found, stopped_at)
    )
    # So does a lost end of an epoch (after the evaluation: its record comes last in the step).
    found = divergence.first_divergence(run(*STRAIGHT), run(*STRAIGHT, epochs={}))
    assert found is not None
    assert "a stop in that last step, or during its evaluation, lost the end of it" in "\n".join(
        divergence.explain(found, stopped_at)
    )


def test_a_plan_travels_to_the_ranks_as_json() -> None:
    plan = Plan(
        "mytask:build", "/tmp/trace", (Stop(0, "train", 5, 1, stops.ACCUM), Stop(1, "eval", 8, 0, "", True))
    )
    assert Plan.from_json(plan.to_json()) == plan


# ----- real runs -------------------------------------------------------------------------------------------------


def check(folder: Path, *args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "hpc_ddp.doctor", "resume", "--folder", str(folder), *args]
    proc = subprocess.run(
        cmd, env=clean_environ(), capture_output=True, text=True, timeout=150, preexec_fn=die_with_test
    )
    return proc.returncode, proc.stdout + proc.stderr


LINEAR = ("--epochs", "2", "--batch-size", "64", "--save-every-steps", "3")  # 4 steps an epoch on 2 ranks


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(150)
def test_a_buffer_kept_out_of_the_checkpoint_is_named_with_its_step_and_stop(tmp_path: Path) -> None:
    # Two stops (each one more start of the ranks): a save in flight at step 4, the first that diverges, and
    # the run's last step (--stop-seed 4 chooses them; every kind of point is the matrix's, not this test's).
    code, out = check(
        tmp_path, "--task", "resume_tasks:transient_buffer", *LINEAR, "--stops", "2", "--stop-seed", "4"
    )
    assert code == 1, out
    assert "first divergence: a buffer (seen) at step 5: micro-batch 0 of step 5 on rank 0" in out
    assert "after stop 1 (while a save is in flight: micro-batch 1 of 1 of step 4)" in out
    assert "persistent=False" in out and "the resume is not exact" in out


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(90)
def test_a_task_refused_at_start_is_its_own_line_and_exit_2(tmp_path: Path) -> None:
    code, out = check(tmp_path, "--task", "nosuchmodule:build", "--steps", "4")
    assert code == 2, out
    assert "the uninterrupted run was refused at start: --task 'nosuchmodule:build': module" in out
    code, out = check(tmp_path / "x", "--task", "linear", "--steps", "1")
    assert code == 2 and "--steps 1: the check needs at least 2 steps" in out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    code, out = check(tmp_path / "mine", "--task", "linear")
    assert code == 2 and "is not a resume check's folder" in out


@pytest.mark.parametrize("seed", range(10))
def test_stops_limits_the_kinds_and_a_resume_stop_always_follows_another(seed: int) -> None:
    chosen, _ = stops.choose(SHAPE, seed, limit=2)
    kinds = [s.what for s in chosen]
    assert len(kinds) == 2 and len(set(kinds)) == 2 and stops.LAST in kinds  # the run's last step always
    if stops.AFTER_RESUME in kinds:
        after = next(s for s in chosen if s.what == stops.AFTER_RESUME)
        assert any(s.step == after.step - 1 for s in chosen if s is not after)
    assert [s.attempt for s in chosen] == [0, 1]
