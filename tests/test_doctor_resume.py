"""`python -m hpc_ddp.doctor resume` (issue 32, build item 10): where the stops go (a pure table), how the first
divergence is found and named (a pure table), and the check on real local runs: an exact task passes (and its
finished run stays finished: tests/test_resume_matrix.py, over many task shapes), a task with state outside the
checkpoint is named, part and step."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp.doctor import divergence, stops
from hpc_ddp.doctor.divergence import Evidence
from hpc_ddp.doctor.probe import Plan, Stop, optimizer_fingerprints

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
    # the run's last step (--stop-seed 0 chooses them; every kind of point is the matrix's, not this test's).
    code, out = check(
        tmp_path, "--task", "resume_tasks:transient_buffer", *LINEAR, "--stops", "2", "--stop-seed", "0"
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


# ----- issue 42: no false alarm, the cause named, nothing vacuous, a check that survives its user -----------------


@pytest.mark.parametrize("seed", range(20))
def test_with_stops_n_the_first_stop_is_mid_run_at_its_kinds_earliest_point(seed: int) -> None:
    for limit in (1, 2, 3):
        chosen, skipped = stops.choose(SHAPE, seed, limit=limit)
        first = chosen[0]
        assert first.what not in (stops.LAST, stops.AFTER_RESUME) and first.step < SHAPE.last
        # The earliest point of its kind: the most steps after it (what a later step only then uses is seen).
        earliest = {
            stops.ACCUM: ("train", 1, 0),
            stops.EVAL: ("eval", 5, 0),
            stops.EPOCH_END: ("train", 8, 0),
            stops.SAVE: ("train", 5, 0),
        }
        assert first.key() == earliest[first.what]
        assert (stops.LAST in [s.what for s in chosen]) == (limit > 1)
        # The kinds not tried are said, each once: those beyond the limit here (the run has every kind).
        untried = [line.split(":")[0] for line in skipped]
        assert sorted(untried + [s.what for s in chosen]) == sorted(
            [stops.LAST, stops.ACCUM, stops.EVAL, stops.EPOCH_END, stops.SAVE, stops.AFTER_RESUME]
        )
        assert all(line.endswith(f"beyond --stops {limit}") for line in skipped)


@pytest.mark.parametrize(
    ("steps", "limit", "refused"),
    [
        (1, 0, True),  # the last step and the first step after a resume: 2 kinds, 1 step
        (2, 0, False),
        (3, 3, False),  # the last step, a plain step (step 2), the first step after a resume
        (1, 2, True),
        (2, 2, False),
        (5, 9, False),  # --stops above the kinds the run has: the kinds it has
    ],
)
def test_a_run_with_fewer_steps_than_kinds_of_stop_is_refused_naming_the_option(
    steps: int, limit: int, refused: bool
) -> None:
    shape = stops.Shape(micro={s: 1 for s in range(1, steps + 1)})
    line = stops.too_short(shape, limit, "--epochs (now 1)")
    assert bool(line) == refused
    if refused:
        assert "\n" not in line and f"the run has {steps} optimizer step(s)" in line
        assert "Fix: make the run longer with --epochs (now 1)" in line
    # Every kind of point in 4 steps: 6 kinds (the last step, an epoch's end, a save in flight, a plain step, an
    # evaluation, the first step after a resume), 4 steps: refused; --stops 4 fits.
    rich = stops.Shape(micro={s: 1 for s in range(1, 5)}, evals={2: 1, 4: 1}, epoch_ends=[2, 4], saves=[1])
    assert stops.kinds_to_try(rich) == 6 and stops.too_short(rich, 0, "--epochs")
    assert stops.too_short(rich, 4, "--epochs") == ""


def test_the_optimizers_settings_and_attributes_are_fingerprinted_apart_from_its_state() -> None:
    import torch

    class Counted(torch.optim.SGD):  # a hand-written optimizer's step count, outside state_dict
        def __init__(self, params, lr):  # type: ignore[no-untyped-def]
            super().__init__(params, lr=lr, momentum=0.9)
            self.steps, self.name, self.table = 0, "mine", {"not": "plain"}

    weight = torch.nn.Parameter(torch.ones(2))
    opt = Counted([weight], lr=0.5)
    weight.grad = torch.ones(2)
    before = optimizer_fingerprints(opt)
    opt.step()
    after = optimizer_fingerprints(opt)
    assert before["groups"]["group 0's lr"] == "0.5" and before["groups"]["group 0's momentum"] == "0.9"
    assert "group 0's params" not in before["groups"]
    # Its plain attributes, not torch's own (some change at the first step of every process: a resume's too).
    assert before["attributes"] == {"attribute steps": "0", "attribute name": "'mine'"}
    assert after["attributes"] == before["attributes"] and after["state"] != before["state"]
    opt.steps, opt.param_groups[0]["lr"] = 7, 0.25
    again = optimizer_fingerprints(opt)
    assert again["attributes"]["attribute steps"] == "7" and again["groups"]["group 0's lr"] == "0.25"


@pytest.mark.parametrize(
    ("fields", "part", "name"),
    [
        # Everything the step starts from differs: the optimizer's settings are named (the cause), then its
        # attributes, then its state, then the parameters and buffers (what they change).
        ({"opt_groups": {"group 0's lr": "0.5"}}, divergence.OPT_GROUPS, "group 0's lr"),
        ({"opt_attributes": {"attribute steps": "3"}}, divergence.OPT_ATTRIBUTES, "attribute steps"),
        ({"optimizer": {"0.momentum": "x"}}, divergence.OPTIMIZER, "0.momentum"),
        ({"params": {"w": "q"}}, divergence.PARAMS, "w"),
        ({"buffers": {"bn.running_mean": "c"}}, divergence.BUFFERS, "bn.running_mean"),
    ],
)
def test_the_optimizer_is_compared_before_the_parameters_and_buffers(
    fields: dict[str, object], part: str, name: str
) -> None:
    start = {
        "opt_groups": {"group 0's lr": "0.1"},
        "opt_attributes": {"attribute steps": "2"},
        "optimizer": {"0.momentum": "o"},
        "params": {"w": "p"},
        "buffers": {"bn.running_mean": "b"},
    }
    straight = [batch("train", 1, 0, **start), batch("train", 2, 0, **start)]
    later = list(start)[list(start).index(next(iter(fields))) :]  # this one and all after it differ
    diverged = {k: {n: "z" for n in start[k]} for k in later} | fields  # type: ignore[union-attr]
    stopped = [straight[0], batch("train", 2, 0, **{**start, **diverged})]
    found = divergence.first_divergence(run(*straight), run(*stopped))
    assert found is not None and (found.part, found.name, found.step) == (part, name, 2)
    lines = divergence.explain(found, [(("train", 1, 0), "a stop")])
    if part in divergence.OPTIMIZER_PARTS:
        assert lines[0].startswith(f"first divergence: the optimizer's {name} differs at step 2: ")
        assert "parameter outside state_dict" not in "\n".join(lines)


def check_in_background(folder: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hpc_ddp.doctor", "resume", "--folder", str(folder), *args]
    return subprocess.Popen(
        cmd,
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )


def ranks_started(folder: Path, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    """Wait until both ranks of the check's first run have built the task (the probe's traces exist)."""
    deadline = time.monotonic() + timeout
    trace = folder / "uninterrupted" / "trace"
    while not ((trace / "rank0.jsonl").is_file() and (trace / "rank1.jsonl").is_file()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)


BATCHNORM = ("--strategy", "fsdp", "--epochs", "2", "--batch-size", "16", "--stops", "2")


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(200)
def test_batchnorm_under_fsdp_passes_through_loss_fn_and_step_and_a_second_check_is_refused(
    tmp_path: Path,
) -> None:
    # fsdp broadcasts rank 0's buffers by a forward hook of its own before every training forward: the probe
    # reads the buffers the forward uses (after that hook), through loss_fn as through Task.step.
    first = check_in_background(tmp_path, "--task", "resume_tasks:batchnorm_loss_fn", *BATCHNORM)
    ranks_started(tmp_path, first)
    # A second check on the same folder, while the first runs: refused in one line, the first unharmed.
    code, out = check(tmp_path, "--task", "resume_tasks:batchnorm_loss_fn", *BATCHNORM)
    assert code == 2, out
    assert (
        f"{tmp_path} is held by another resume check (pid {first.pid}" in out and len(out.splitlines()) == 1
    )
    out = first.communicate(timeout=150)[0]
    assert first.returncode == 0, out
    assert "every stop matched" in out and "kinds not tried: during an evaluation" in out
    assert "stop 1, " in out and "in the run's last step" not in out.split("stop 1, ")[1].split("\n")[0]
    code, out = check(tmp_path / "step", "--task", "resume_tasks:batchnorm_step", *BATCHNORM)
    assert code == 0, out


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(120)
def test_sigterm_ends_every_process_the_check_started(tmp_path: Path) -> None:
    proc = check_in_background(tmp_path, "--task", "resume_tasks:batchnorm_step", *BATCHNORM)
    ranks_started(tmp_path, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 3, tree  # the launcher, its fork server (or not), the ranks
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert time.monotonic() - began < 10, out
    assert proc.returncode == 128 + signal.SIGTERM, out
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1 and "every process the check started has ended" in stopped[0], out
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(120)
def test_a_crashing_task_shows_its_last_lines_and_the_users_command_and_a_file_folder_is_refused(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("mine")
    code, out = check(tmp_path / "file", "--task", "linear")
    assert code == 2 and len(out.splitlines()) == 1 and f"--folder {tmp_path / 'file'} is a file" in out, out
    code, out = check(tmp_path / "crash", "--task", "resume_tasks:crashing", "--epochs", "1", "--stops", "2")
    assert code == 1, out
    assert "the uninterrupted run failed" in out and "the crashing task's third step" in out
    repro = [line for line in out.splitlines() if "to reproduce it with your task alone: " in line]
    assert len(repro) == 1, out
    command = repro[0].split("to reproduce it with your task alone: ", 1)[1]
    assert "-m hpc_ddp.submit --local " in command and "--task=resume_tasks:crashing" in command
    assert "hpc_ddp.doctor.probe" not in command and "--epochs=1" in command


# ----- issue 42: the run the user will run, everything it produces --------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "boundaries"),
    [
        # 4 epochs of 20 steps, an evaluation every 10, a save every 15: every boundary before the last step.
        (
            stops.Shape(
                micro={s: 1 for s in range(1, 81)},
                evals={s: 2 for s in range(10, 81, 10)},
                epoch_ends=[20, 40, 60, 80],
                saves=[15, 30, 45, 60, 75],
            ),
            [20, 40, 60],
        ),
        # 2 epochs of 64 steps (more than the 40 the check once stopped at), plain steps.
        (stops.Shape(micro={s: 1 for s in range(1, 129)}, epoch_ends=[64, 128]), [64]),
        # 1 epoch of 80: no boundary, the run's end and a late stop all the same.
        (stops.Shape(micro={s: 1 for s in range(1, 81)}, epoch_ends=[80]), []),
        # --grad-accum 2, --max-steps 50 inside the third epoch of 20.
        (stops.Shape(micro={s: 2 for s in range(1, 51)}, epoch_ends=[20, 40, 50]), [20, 40]),
    ],
)
@pytest.mark.parametrize("seed", range(10))
def test_the_whole_check_stops_at_every_kind_every_epoch_boundary_late_and_at_the_end(
    shape: stops.Shape, boundaries: list[int], seed: int
) -> None:
    chosen, skipped = stops.choose(shape, seed)
    kinds = {s.what for s in chosen}
    found = {line.split(":")[0] for line in skipped}
    mid = stops.ACCUM if any(n > 1 for n in shape.micro.values()) else stops.STEP
    every = {stops.LAST, mid, stops.AFTER_RESUME, stops.EPOCH_END, stops.EVAL, stops.SAVE}
    assert kinds | found == every and not kinds & found  # each kind tried, or said why not
    assert (stops.EPOCH_END in kinds) == bool(boundaries)
    # Every boundary in the run: a stop there (an epoch's last step, or another kind's stop at that step).
    steps = [s.step for s in chosen]
    assert set(boundaries) <= set(steps), chosen
    assert any(s.what == stops.LAST and s.step == shape.last for s in chosen)  # the run's end
    # A stop late in the run (its last quarter, before the last step: after step 60 of 80) with steps after it.
    assert any(60 * shape.last < 80 * s.step < 80 * shape.last for s in chosen), chosen
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert [s.attempt for s in chosen] == list(range(len(chosen)))
    for save in (s for s in chosen if s.save):  # a save still in flight: no stop at the step it was made at
        assert save.step - 1 in shape.saves and save.step - 1 not in steps
    # --stops N: an epoch's last step is drawn among every boundary, not only the last one.
    if len(boundaries) > 1:
        drawn = {
            s.step for k in range(30) for s in stops.choose(shape, k, limit=6)[0] if s.what == stops.EPOCH_END
        }
        assert drawn - {boundaries[0]}, drawn  # the first stop takes the earliest; later ones others too


@pytest.mark.parametrize(
    ("steps", "cap", "bound", "expected"),
    [
        (
            128,
            40,
            "--epochs (now 2)",
            "the run has 128 optimizer step(s), more than the check's cap, --steps 40",
        ),
        (300, 200, "--max-steps (now 300) or --epochs (now 10)", "Fix: raise --steps to 300"),
        (0, 200, "--epochs (now 10)", "the run has more than 200 optimizer steps (a stream's"),
    ],
)
def test_a_run_longer_than_the_cap_is_refused_in_one_line_like_a_short_one(
    steps: int, cap: int, bound: str, expected: str
) -> None:
    line = stops.too_long(steps, cap, bound)
    assert "\n" not in line and expected in line
    assert line.endswith(f"or make the run shorter with {bound}") and "never shortens it" in line
    short = stops.too_short(stops.Shape(micro={1: 1}), 0, bound)
    assert short.startswith("the run has 1 optimizer step(s), fewer than") and f"longer with {bound}" in short


def test_the_watch_refuses_the_run_once_its_records_pass_the_cap(tmp_path: Path) -> None:
    from hpc_ddp.doctor.resume import Watch

    path = tmp_path / "metrics.jsonl"
    watch = Watch(path, 10, "--epochs (now 2)")
    assert not watch.read()  # nothing written yet
    path.write_text(
        '{"event": "start", "step": 0}\n{"event": "step", "step": 1, "total_steps": 8}\n{"event": "st'
    )
    assert not watch.read() and watch.refusal == ""  # 8 steps in all: within the cap; a cut line waits
    with open(path, "a") as f:
        f.write('ep", "step": 2, "total_steps": 8}\n')
    assert not watch.read()
    stream = Watch(path, 10, "--epochs (now 2)")  # a stream's run: no total, its steps counted
    with open(path, "a") as f:
        f.write("".join(f'{{"event": "step", "step": {s}, "total_steps": 0}}\n' for s in range(3, 12)))
    assert stream.read() and "the run has more than 10 optimizer steps" in stream.refusal
    long = tmp_path / "long.jsonl"
    long.write_text('{"event": "step", "step": 1, "total_steps": 128}\n')
    watch = Watch(long, 40, "--epochs (now 2)")
    assert watch.read() and watch.refusal.startswith("the run has 128 optimizer step(s), more than")


def values(extras: dict[int, dict[str, object]] | None = None, **records: object) -> dict[str, object]:
    """A run's step records beside the loss: grad_norm, lr, epoch (`records` changes one at step 2), extras."""
    table = {s: {"grad_norm": 0.5, "lr": 0.1, "epoch": 0} for s in (1, 2)}
    table[2] = {**table[2], **records}
    return {"records": table, "extras": extras if extras is not None else {1: {"avg": 1.0}, 2: {"avg": 0.75}}}


@pytest.mark.parametrize(
    ("stopped", "part", "name", "step"),
    [
        (run(*STRAIGHT, **values({1: {"avg": 1.0}, 2: {"avg": 0.5}})), divergence.STEP_EXTRA, "avg", 2),
        (run(*STRAIGHT, **values({1: {"avg": 1.0}, 2: {}})), divergence.STEP_EXTRA, "avg", 2),  # left out
        (run(*STRAIGHT, **values({1: {"avg": 1.0, "n": 1}, 2: {"avg": 0.75}})), divergence.STEP_EXTRA, "n", 1),
        (run(*STRAIGHT, **values(grad_norm=0.25)), divergence.STEP_RECORD, "grad_norm", 2),
        # The record's lr is the optimizer's first group's: its setting is named.
        (run(*STRAIGHT, **values(lr=0.05)), divergence.OPT_GROUPS, "group 0's lr", 2),
        # The record's values before the step's own (a symptom of the update), the loss before both.
        (run(*STRAIGHT, **values({1: {"avg": 1.0}, 2: {"avg": 0}}, grad_norm=0.25)), divergence.STEP_RECORD, "grad_norm", 2),
        (run(*STRAIGHT, losses={1: 1.0, 2: 0.25}, **values({1: {"avg": 1.0}, 2: {"avg": 0}})), divergence.LOSS, "", 2),
        # What the step starts from (its parameters) before its records; an earlier step's value before both.
        (run(*changed(2, params={"w": "q"}), **values({1: {"avg": 1.0}, 2: {"avg": 0}})), divergence.PARAMS, "w", 2),
        (run(*changed(2, params={"w": "q"}), **values({1: {"avg": 2.0}, 2: {"avg": 0.75}})), divergence.STEP_EXTRA, "avg", 1),
        (run(*STRAIGHT, **values(), best_checkpoint={"model.w": "z"}), divergence.BEST_CHECKPOINT, "model.w", None),
    ],
)  # fmt: skip
def test_the_step_records_values_and_the_best_checkpoint_are_compared_in_run_order(
    stopped: Evidence, part: str, name: str, step: int | None
) -> None:
    found = divergence.first_divergence(run(*STRAIGHT, **values()), stopped)
    assert found is not None
    assert (found.part, found.name, found.step) == (part, name, step)
    assert divergence.first_divergence(run(*STRAIGHT, **values()), run(*STRAIGHT, **values())) is None
    lines = divergence.explain(found, [(("train", 1, 0), "a stop")])
    if part == divergence.STEP_EXTRA:
        assert lines[0] == (
            f"first divergence: the step's extra value '{name}' differs at step {step}: metrics.jsonl's record of "
            f"step {step}"
        )
        if step > 1:  # after the stop at step 1 (at step 1: before it, two starts already differ)
            assert "running mean" in lines[-2] and "closure" in lines[-2]
    if part == divergence.STEP_RECORD:
        assert lines[0].startswith(f"first divergence: the step's {name} differs at step {step}: ")
    if part == divergence.OPT_GROUPS:
        assert lines[0].startswith(
            "first divergence: the optimizer's group 0's lr differs at step 2: metrics"
        )


TINY = ("--batch-size", "2", "--num-workers", "0")  # 2 samples a step on each of 2 ranks: many cheap steps


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(150)
def test_a_layer_a_python_counter_unfreezes_at_forward_60_of_80_is_caught(tmp_path: Path) -> None:
    # --stops 1: the first stop is mid-run at its kind's earliest point, before the counter's forward 60.
    code, out = check(
        tmp_path, "--task", "resume_tasks:late_unfreeze", "--epochs", "1", *TINY, "--stops", "1"
    )
    assert code == 1, out
    assert "uninterrupted: 80 steps; now stopped" in out
    found = re.search(
        r"first divergence: the step's grad_norm differs at step (\d+): metrics.jsonl's record", out
    )
    assert found is not None and int(found.group(1)) >= 60, out
    assert "a Python counter that unfreezes a layer" in out and "the resume is not exact" in out


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(150)
def test_an_exact_task_passes_on_its_whole_run_and_a_run_past_the_cap_is_refused(tmp_path: Path) -> None:
    # --max-steps past the cap: refused before anything runs.
    code, out = check(tmp_path / "max", "--task", "linear", "--max-steps", "300")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "the run has 300 optimizer step(s), more than the check's cap, --steps 200" in out
    assert "Fix: raise --steps to 300" in out and "--max-steps (now 300)" in out
    # Its epochs past a lower cap: refused at the uninterrupted run's first step record, never shortened.
    exact = (
        "--task",
        "linear",
        "--epochs",
        "2",
        "--batch-size",
        "96",
        "--save-every-steps",
        "2",
    )  # 5 an epoch
    code, out = check(tmp_path / "cap", *exact, "--steps", "9")
    assert code == 2, out
    assert "the run has 10 optimizer step(s), more than the check's cap, --steps 9" in out, out
    assert "make the run shorter with --epochs (now 2)" in out and "now stopped" not in out
    code, out = check(tmp_path / "whole", *exact)
    assert code == 0, out
    assert "every stop matched" in out and "the uninterrupted run of 10 steps" in out
    assert out.rstrip().endswith("s); kinds not tried: during an evaluation"), out  # linear has none
    assert "at an epoch's last step: micro-batch 1 of 1 of step 5" in out
