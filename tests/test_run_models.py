"""Issue 19 in real runs (local launcher, 1 node x 2 gloo ranks): batches of any structure, a step of one's own
with extra metrics, schedules, evaluation; and the bad inputs, each one line, exit 2, never retried."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from test_launch_local import finish, read_until, start

from hpc_ddp import exitcodes
from hpc_ddp.run.checkpoint import full, store
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.loop import schedules

pytestmark = [pytest.mark.slow, pytest.mark.deadline(120)]

TWO = ("--nodes", "1", "--deterministic")


def records(folder: Path, event: str) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("bad_batch", "error: batch['tags']: set cannot be part of a batch"),
        ("dict_to_loss_fn", "error: Task.loss_fn needs (input, target) batches, but a batch is dict."),
        ("nonscalar", "error: the training step returned a tensor of shape [32, 1] as its loss; expected a "),
        ("both", "Task has both of loss_fn and step; give exactly one"),
        ("scheduler_raises", "error: Task.scheduler(optimizer, 8) raised ValueError: warm-up longer than"),
        (
            "names_differ",
            "Task.step returned the metrics ['mae'] on rank 0 but ['mse'] on rank 1. Fix: return",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_never_retried(tmp_path: Path, task: str, message: str) -> None:
    # One rank where one says it. names_differ needs two ranks to disagree (and there the other rank's end is
    # checked too: one line, no traceback, no retry); scheduler_raises names the run's 8 steps at two ranks.
    two = task in ("names_differ", "scheduler_raises")
    shape = TWO if two else (*TWO, "--tasks-per-node", "1")
    code, out = finish(start(tmp_path, "--task", f"model_tasks:{task}", *shape, "--epochs", "2"), timeout=100)
    assert code == exitcodes.USAGE, out
    assert message in out
    assert "Traceback" not in out
    assert "restarting" not in out and "retry" not in out.lower()


# One run of the scheduled task (dict batches, a step of its own with metrics and draws from Python's and
# NumPy's generators, its own LR scheduler, an evaluation set) serves several tests (same task, same flags):
# dict batches and a step's metrics, the exact evaluation at 2 ranks, and the uninterrupted reference of the
# preemption tests (scheduler, draws, evaluation). --keep-best mse:max there: the first evaluation's error is
# the largest, so the best checkpoint is an early one that every later save would rotate away (--keep 1) and
# that every resume must keep comparing against.
DICTS = (
    "--task",
    "model_tasks:scheduled",
    *TWO,
    "--epochs",
    "3",
    "--batch-size",
    "8",
    "--eval-every-steps",
    "5",
    "--eval-every-epochs",  # both cadences: --eval-every-steps alone evaluates by steps instead
    "1",
    "--log-every-s",
    "0",
    "--keep",
    "1",
    "--keep-best",
    "mse:max",
)


@pytest.fixture(scope="module")
def dicts_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("dicts") / "straight"
    code, out = finish(start(folder, *DICTS), timeout=200)
    assert code == 0, out
    return folder, out


@pytest.mark.deadline(240)
def test_dict_batches_and_a_step_with_metrics_record_them_averaged(dicts_run: tuple[Path, str]) -> None:
    tmp_path, out = dicts_run
    steps = records(tmp_path, "step")
    assert steps and all(set(r["metrics"]) == {"half", "mae", "py_draw", "np_draw"} for r in steps)
    assert all(
        r["metrics"]["half"] == 0.5 for r in steps
    )  # a constant: averaged over ranks and micro-batches
    assert all(r["metrics"]["mae"] > 0 for r in steps)
    # the progress line shows them (one format: run/records/progress.value_text)
    assert " half 0.5000 mae " in out
    assert "set_epoch calls: [0, 1]" in out  # the dataset's set_epoch, once an epoch


def best_of(folder: Path) -> tuple[int, int]:
    """(the step the `best` pointer names, the step of the largest evaluated mse): --keep-best mse:max."""
    evals = records(folder, "eval")
    top = max(evals, key=lambda r: (r["metrics"]["mse"], -r["step"]))
    best = store.read_best(folder, storage=Local())
    assert best is not None and best.is_file(), sorted(p.name for p in (folder / "checkpoints").iterdir())
    return store.ckpt_step(best), top["step"]


def test_keep_best_names_the_best_evaluation_and_survives_rotation(dicts_run: tuple[Path, str]) -> None:
    folder, _ = dicts_run
    named, expected = best_of(folder)
    assert named == expected
    latest = store.read_latest(folder, storage=Local())
    assert latest is not None and store.ckpt_step(latest) == 48 != named  # 3 epochs of 16 steps
    assert [store.ckpt_step(p) for p in store.list_checkpoints(folder, storage=Local())] == [
        48,
        named,
    ]  # --keep 1, plus best
    assert full.load(store.read_best(folder, storage=Local()), storage=Local())["best"] == {  # type: ignore[arg-type]
        "name": "mse",
        "mode": "max",
        "value": max(r["metrics"]["mse"] for r in records(folder, "eval")),
        "step": named,
    }


def lrs(folder: Path) -> list[float]:
    return [r["lr"] for r in records(folder, "step")]


@pytest.mark.deadline(300)  # three runs in a row
def test_lr_schedule_steps_per_optimizer_step_and_a_new_lr_on_resume_scales_it(tmp_path: Path) -> None:
    args = ("--task", "model_tasks:dicts", *TWO, "--log-every-s", "0", "--lr-schedule", "cosine")
    code, out = finish(start(tmp_path, *args, "--warmup-steps", "2", "--epochs", "2"), timeout=100)
    assert code == 0, out
    expected = [0.01 * schedules.factor("cosine", s, 2, 8) for s in range(8)]  # 256 / 2 ranks / 32: 4 a epoch
    assert lrs(tmp_path) == pytest.approx(expected)
    code, out = finish(start(tmp_path, *args, "--warmup-steps", "3", "--epochs", "3"), timeout=100)
    assert code != 0 and "--warmup-steps 2 (now 3)" in out  # must match on resume
    code, out = finish(start(tmp_path, *args, "--warmup-steps", "2", "--epochs", "3", "--lr", "0.005"))
    assert code == 0, out
    assert "the LR schedule goes on from step 8 at the new --lr 0.005 (every rate scaled by 0.5)" in out
    # The longer run's schedule spans its 12 steps, at the new base rate.
    assert lrs(tmp_path)[8:] == pytest.approx(
        [0.005 * schedules.factor("cosine", s, 2, 12) for s in range(8, 12)]
    )


@pytest.mark.deadline(200)  # two runs in a row
def test_epochs_raised_on_a_finished_cosine_run_goes_on_over_the_new_total_and_says_so(
    tmp_path: Path,
) -> None:
    """Issue 42: the "already finished" message suggests raising --epochs; on a cosine schedule that moved the
    rate from its end (0) to the new total's at once, unsaid. It goes on deliberately, said on the console."""
    args = ("--task", "linear", "--nodes", "1", "--tasks-per-node", "1", "--log-every-s", "0")
    code, out = finish(start(tmp_path, *args, "--lr-schedule", "cosine", "--epochs", "2"), timeout=100)
    assert code == 0, out
    assert "Parameters identical on the 1 rank" in out and "on all 1 ranks" not in out  # issue 42, item 5
    old = records(tmp_path, "step")[-1]["total_steps"]
    code, out = finish(start(tmp_path, *args, "--lr-schedule", "cosine", "--epochs", "3"), timeout=100)
    assert code == 0, out
    steps = records(tmp_path, "step")
    new, base = steps[-1]["total_steps"], steps[0]["lr"] / schedules.factor("cosine", 0, 0, old)
    assert new == old * 3 // 2
    after = base * schedules.factor("cosine", old, 0, new)
    assert (
        f"the LR schedule's total changed from {old} to {new} optimizer steps (--epochs 2 -> 3): it goes on "
        f"over the new total, so the learning rate goes from 0 to {after:.4g} at step {old}" in out
    )
    assert lrs(tmp_path)[old:] == pytest.approx(
        [base * schedules.factor("cosine", s, 0, new) for s in range(old, new)]
    )


def final(folder: Path) -> tuple[dict, dict]:
    return torch.load(folder / "model.pth", weights_only=True), full.load(
        store.list_checkpoints(folder, storage=Local())[0], storage=Local()
    )


def assert_bitwise_equal(a: Path, b: Path) -> None:
    (model_a, ckpt_a), (model_b, ckpt_b) = final(a), final(b)
    assert model_a.keys() == model_b.keys() and all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    state_a, state_b = ckpt_a["optimizer"]["state"], ckpt_b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    assert all(torch.equal(state_a[k]["momentum_buffer"], state_b[k]["momentum_buffer"]) for k in state_a)
    assert ckpt_a["optimizer"]["param_groups"] == ckpt_b["optimizer"]["param_groups"]
    assert ckpt_a["scheduler"] == ckpt_b["scheduler"]
    assert ckpt_a["position"] == ckpt_b["position"]


def reached(folder: Path, step: int, timeout: float = 60) -> None:
    """Until metrics.jsonl records a step past `step` (the run's records follow its steps as they train)."""
    deadline = time.monotonic() + timeout
    path = folder / "metrics.jsonl"
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if any(r.get("event") == "step" and r.get("step", 0) > step for r in map(_record, lines)):
            return
        time.sleep(0.05)
    raise AssertionError(f"{path}: no step past {step} within {timeout:g} s")


def _record(line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # the line being written
        return {}


def preempted_twice(
    folder: Path, *args: str, hangs_allowed: bool = False, mid_epoch_after: int = 0, **env: str
) -> str:
    """A run that gets SIGUSR2 (to the launcher) in epoch 0 and again after its first resume; its output.
    `hangs_allowed`: a run whose DataLoader workers are forked may also be restarted once by the hang watchdog
    on a Python with CPython gh-112275 (hpc_ddp.run.data.forkrisk: a worker that never starts); each such restart
    is a third resume, recorded as a hang in attempts.jsonl, and nothing else is."""
    proc = start(folder, *args, **env)
    lines = read_until(proc, "Epoch 0,")
    # `mid_epoch_after`: the first stop inside epoch 1, not at its boundary (where an epoch-end stop is agreed).
    if mid_epoch_after:
        reached(folder, mid_epoch_after)
    proc.send_signal(signal.SIGUSR2)
    lines += read_until(proc, "Resuming from ", timeout=200)
    lines += read_until(proc, "Epoch 1,", timeout=200)
    proc.send_signal(signal.SIGUSR2)
    code, out = finish(proc)
    out = "\n".join(lines) + "\n" + out
    assert code == 0, out
    ended = [
        r
        for r in map(json.loads, (folder / "attempts.jsonl").read_text().splitlines())
        if r["event"] == "end"
    ]
    hangs = [r for r in ended if r["outcome"] == "hang"] if hangs_allowed else []
    preempted = [r["outcome"] for r in ended].count("preempted")
    # A second signal that lands while the ranks hang is the hang's restart's (nothing to save then).
    assert len(hangs) <= 1 and (preempted == 2 or (hangs and preempted == 1)), out
    assert out.count("Resuming from ") == preempted + len(hangs), out
    return out


SLOW = {"STEP_SLEEP_S": "0.03"}


@pytest.mark.deadline(240)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_evaluation_counts_each_sample_exactly_once(
    tmp_path: Path, ranks: int, request: pytest.FixtureRequest
) -> None:
    if ranks == 2:  # the shared run (EVAL_SAMPLES defaults to 37)
        tmp_path, out = request.getfixturevalue("dicts_run")
    else:
        args = [a for a in DICTS if a != "--deterministic"]
        code, out = finish(
            start(tmp_path, *args, "--gpus-per-node", str(ranks), EVAL_SAMPLES="37"), timeout=200
        )
        assert code == 0, out
    evals = records(tmp_path, "eval")
    steps_per_epoch = 256 // ranks // 8
    expected = sorted({*range(5, 3 * steps_per_epoch + 1, 5), *(e * steps_per_epoch for e in (1, 2, 3))})
    assert [r["step"] for r in evals] == expected  # every 5 steps, each epoch's end, once each
    for r in evals:  # 37 samples over 1, 2 or 3 ranks: each id once (its mean and mean square prove it)
        assert r["samples"] == 37
        assert r["metrics"]["id_mean"] == pytest.approx(18.0)
        assert r["metrics"]["id_sq"] == pytest.approx(sum(i * i for i in range(37)) / 37)
    assert evals[-1]["metrics"]["mse"] < evals[0]["metrics"]["mse"]
    assert f"Eval at step {expected[-1]} (epoch 2, 37 samples): id_mean 18.0000" in out


@pytest.mark.deadline(240)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_an_iterable_evaluation_set_counts_each_sample_once_over_uneven_parts(
    tmp_path: Path, ranks: int
) -> None:
    # 37 samples in parts of 12 + 25 (2 ranks: 2 and 4 batches of 8) or 12 + 25 + 0 (3 ranks: one has none);
    # --eval-batch-size 8 under --batch-size 16.
    args = ("--task", "model_tasks:stream_eval", "--nodes", "1", "--gpus-per-node", str(ranks))
    flags = ("--batch-size", "16", "--eval-batch-size", "8", "--max-steps", "4", "--eval-every-steps", "2")
    code, out = finish(start(tmp_path, *args, *flags), timeout=200)
    assert code == 0, out
    evals = records(tmp_path, "eval")
    assert [r["step"] for r in evals] == [2, 4]
    parts = [12, 25] if ranks > 1 else [37]  # the third rank's part is empty
    sizes = [min(8, part - k) for part in parts for k in range(0, part, 8)]  # batches of --eval-batch-size
    for r in evals:
        assert r["samples"] == 37
        assert r["metrics"]["size"] == pytest.approx(sum(b * b for b in sizes) / 37)
        assert r["metrics"]["id_mean"] == pytest.approx(18.0)
        assert r["metrics"]["id_sq"] == pytest.approx(sum(i * i for i in range(37)) / 37)


def evals_of(folder: Path) -> list[tuple]:
    return [(r["step"], r["epoch"], r["samples"], r["metrics"]) for r in records(folder, "eval")]


@pytest.mark.deadline(300)
def test_a_scheduler_draws_and_evaluation_preempted_twice_end_bitwise_equal_with_equal_eval_records(
    tmp_path: Path, dicts_run: tuple[Path, str]
) -> None:
    straight, twice = dicts_run[0], tmp_path / "twice"
    preempted_twice(twice, *DICTS, **SLOW, EVAL_SLEEP_S="0.05")
    assert_bitwise_equal(straight, twice)  # the scheduler's state among the rest
    assert final(twice)[1]["scheduler"]["last_epoch"] == 3 * 16  # the task's own scheduler, once a step
    assert evals_of(twice) == evals_of(straight)
    # --keep-best: the best value survived both resumes (else a later evaluation would have taken its place).
    assert best_of(twice) == best_of(straight)
    # The step's draws from Python's `random` and NumPy's generator (seeded by --seed, restored on resume):
    # each step drew the same numbers in both runs, across both resumes.
    draws = (
        {r["step"]: (r["metrics"]["py_draw"], r["metrics"]["np_draw"]) for r in records(folder, "step")}
        for folder in (straight, twice)
    )
    straight_draws, twice_draws = draws
    assert straight_draws == twice_draws and len(straight_draws) == 3 * 16
    assert len(set(straight_draws.values())) == 3 * 16  # really drawn, not a constant


@pytest.mark.deadline(300)
def test_a_signal_during_an_evaluation_stops_there_and_the_resume_evaluates_again(
    tmp_path: Path, dicts_run: tuple[Path, str]
) -> None:
    straight, _ = dicts_run
    mark = tmp_path / "evaluating"
    proc = start(tmp_path / "signalled", *DICTS, EVAL_SLEEP_S="0.3", EVAL_MARK=str(mark))
    deadline = time.monotonic() + 100
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR2)  # rank 0 is inside the evaluation at step 5 (3 batches of 0.3 s)
    code, out = finish(proc, timeout=200)
    assert code == 0, out
    assert "at epoch 0, step 5" in out
    assert "the evaluation at step 5 was stopped by the signal (or not begun): it runs first" in out
    assert_bitwise_equal(straight, tmp_path / "signalled")
    assert evals_of(tmp_path / "signalled") == evals_of(straight)  # step 5's once, not repeated
    # The checkpoint of step 5 was written before its evaluation ended; as the best it is written again.
    assert best_of(tmp_path / "signalled") == best_of(straight)


CNN = ("--task", "cnn", *TWO, "--epochs", "1", "--eval-every-steps", "8", "--keep", "1", "--keep-best")


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cnn")
    code, out = finish(start(folder, *CNN, "accuracy:max"), timeout=220)
    assert code == 0, out
    return folder


@pytest.mark.deadline(240)
def test_builtin_cnn_trains_to_eval_accuracy_well_above_chance(cnn_run: Path) -> None:
    evals = records(cnn_run, "eval")
    assert [r["step"] for r in evals] == list(range(8, 65, 8))  # 4096 images / 2 ranks / 32: 64 steps
    assert all(r["samples"] == 512 for r in evals)
    assert evals[-1]["metrics"]["accuracy"] > 0.5  # 4 shapes: chance is 0.25


@pytest.mark.deadline(150)
def test_builtin_cnn_keep_best_points_at_the_most_accurate_checkpoint_beside_the_latest(
    cnn_run: Path,
) -> None:
    evals = records(cnn_run, "eval")
    top = max(evals, key=lambda r: (r["metrics"]["accuracy"], -r["step"]))
    best, latest = store.read_best(cnn_run, storage=Local()), store.read_latest(cnn_run, storage=Local())
    assert best is not None and latest is not None
    assert store.ckpt_step(best) == top["step"]
    assert store.ckpt_step(latest) == 64
    # --keep 1: the latest, and the best beside it (here an earlier one, which every later save left alone).
    assert [store.ckpt_step(p) for p in store.list_checkpoints(cnn_run, storage=Local())] == sorted(
        {64, top["step"]}, reverse=True
    )
    assert full.load(best, storage=Local())["best"]["value"] == top["metrics"]["accuracy"]
    # Visible (issue 37 item 5): each new best is a "best" record and a console line, the last one the kept.
    bests = records(cnn_run, "best")
    improving = []
    for r in evals:
        if not improving or r["metrics"]["accuracy"] > improving[-1][1]:
            improving.append((r["step"], r["metrics"]["accuracy"]))
    assert [(r["step"], r["value"]) for r in bests] == improving and bests[-1]["step"] == top["step"]
    assert all(r["metric"] == "accuracy" and r["mode"] == "max" for r in bests)
    log = (cnn_run / "logs" / "rank0.log").read_text()
    assert log.count("New best accuracy ") == len(bests)
    assert (
        f"New best accuracy {top['metrics']['accuracy']:.4f} (max) at step {top['step']}: its checkpoint"
        in log
    )


@pytest.mark.deadline(150)
def test_keep_best_of_a_name_the_evaluation_lacks_is_one_line_exit_2(tmp_path: Path) -> None:
    one = ("--tasks-per-node", "1")  # both refusals are a rank's own: one rank says them
    # The names are known at the first evaluation: at step 1 (the later --eval-every-steps counts), not 8.
    code, out = finish(start(tmp_path, *one, *CNN, "f1:max", "--eval-every-steps", "1"), timeout=120)
    assert code == exitcodes.USAGE, out
    assert "--keep-best f1:max: the evaluation reports accuracy, loss, not 'f1'." in out
    assert "Traceback" not in out and not store.list_checkpoints(tmp_path, storage=Local())
    code, out = finish(start(tmp_path / "noeval", *one, "--task", "linear", *TWO, "--keep-best", "loss:min"))
    assert code == exitcodes.USAGE, out
    assert "--keep-best loss:min: the task has no evaluation (no Task.eval_dataset)" in out


@pytest.mark.deadline(150)
def test_builtin_gpt_loss_goes_down_and_accuracy_beats_chance(tmp_path: Path) -> None:
    """Under fsdp, as a user copying it for a big model would run it: its weight-decay groups by name (issue 37
    item 1), and no warning (FSDP2's on a module returning a view, before its head lost its bias)."""
    args = ("--task", "gpt", *TWO, "--epochs", "1", "--clip-grad", "1.0", "--eval-every-steps", "8")
    code, out = finish(start(tmp_path, *args, "--log-every-s", "0", "--strategy", "fsdp"))
    assert code == 0, out
    assert "Warning" not in out and "warning" not in out, out
    evals = records(tmp_path, "eval")
    assert evals[-1]["metrics"]["loss"] < evals[0]["metrics"]["loss"]
    assert evals[-1]["metrics"]["accuracy"] > 3 / 24  # next-token accuracy over a 24-word vocabulary
    assert all("accuracy" in r["metrics"] for r in records(tmp_path, "step"))


def test_uneven_streams_end_the_epoch_together_and_a_resume_restarts_the_epoch(tmp_path: Path) -> None:
    # 2 ranks, batch 8: rank 0's stream has 5 batches, rank 1's 6; every epoch ends after 5 steps on both.
    args = (
        "--task",
        "model_tasks:iterable",
        *TWO,
        "--batch-size",
        "8",
        "--log-every-s",
        "0",
        "--epochs",
        "3",
    )
    code, out = finish(start(tmp_path, *args, "--max-steps", "8"))  # stops at step 8: 3 steps into epoch 1
    assert code == 0, out
    # Said at start, and in run.json (issue 32, build item 11): this stream cannot resume mid-epoch exactly.
    assert "not bitwise resumable: the IterableDataset has no state_dict()/load_state_dict()" in out
    assert json.loads((tmp_path / "run.json").read_text())["exact"] is False
    assert [r["step"] for r in records(tmp_path, "epoch")] == [5, 8]
    assert "Parameters identical on all 2 ranks" in out
    code, out = finish(start(tmp_path, *args))
    assert code == 0, out
    message = (
        "the IterableDataset cannot be resumed mid-epoch: epoch 1 restarts from its beginning (at step 8"
    )
    assert out.count(message) == 1
    assert [r["step"] for r in records(tmp_path, "epoch")] == [5, 8, 13, 18]  # epoch 1 whole again, then 2


@pytest.mark.deadline(240)
def test_a_stream_with_state_preempted_twice_ends_bitwise_equal(tmp_path: Path) -> None:
    args = ("--task", "model_tasks:stateful_stream", *TWO, "--epochs", "3", "--batch-size", "8")
    slow = {"STEP_SLEEP_S": "0.4"}  # the signals' room to land mid-epoch; the uninterrupted run needs none
    code, out = finish(start(tmp_path / "straight", *args))
    assert code == 0, out
    out = preempted_twice(tmp_path / "twice", *args, **slow)
    assert "cannot be resumed mid-epoch" not in out
    first = int(out.split("Resuming from ")[1].split(", step ")[1].split()[0])
    assert first % 5 != 0, "the first signal should land mid-epoch"  # the stream's state is what resumes
    assert_bitwise_equal(tmp_path / "straight", tmp_path / "twice")
    assert [r["step"] for r in records(tmp_path / "twice", "epoch")] == [5, 10, 15]


@pytest.mark.deadline(300)
def test_a_stream_with_state_read_by_two_workers_preempted_twice_ends_bitwise_equal(tmp_path: Path) -> None:
    # torchdata's StatefulDataLoader holds every worker's state. 4 readers (2 ranks x 2 workers) of 40, 48, 56
    # and 64 samples: rank 0 has 5 + 6 batches of 8, rank 1 more; every epoch ends after 11 steps.
    args = ("--task", "model_tasks:stateful_stream", *TWO, "--epochs", "3", "--batch-size", "8")
    args += ("--num-workers", "2")
    slow = {"STEP_SLEEP_S": "0.3"}  # the signals' room to land mid-epoch; the uninterrupted run needs none
    code, out = finish(start(tmp_path / "straight", *args), timeout=200)
    assert code == 0, out
    # Each rank runs on 1 CPU here: one line of the kit's says so, instead of torch's warning for every loader
    # of every rank (issue 37 item 4).
    assert "suggested max number of worker" not in out, out
    assert out.count("--num-workers 2: each rank runs on 1 CPU, which its 2 DataLoader workers share") == 1, (
        out
    )
    # --timeout-s 120: a worker that never starts (hpc_ddp.run.data.forkrisk) is named after 60 s, within the
    # test's deadline, and the run resumes from its checkpoint.
    out = preempted_twice(
        tmp_path / "twice", *args, "--timeout-s", "120", hangs_allowed=True, mid_epoch_after=11, **slow
    )
    assert "cannot be resumed mid-epoch" not in out
    first = int(out.split("Resuming from ")[1].split(", step ")[1].split()[0])
    assert first % 11 != 0, "the first signal should land mid-epoch"  # the workers' states are what resume
    assert_bitwise_equal(tmp_path / "straight", tmp_path / "twice")
    assert [r["step"] for r in records(tmp_path / "twice", "epoch")] == [11, 22, 33]
