"""The resume check against a defect zoo (issue 42, item 7): each task of tests/zoo_tasks.py with one thing a
resume cannot restore must be called "not exact" (exit 1) with its named cause; each exact task must pass
(exit 0). One `python -m hpc_ddp.doctor resume` per case, each its own test (pytest-xdist spreads them).

What keeps it cheap: the smallest runs that still hold the defect (1 node x 2 CPU ranks, a linear layer or two
small blocks, 3 to 6 steps an epoch) and `--stops 1` (one stop, always mid-run at its kind's earliest point:
the most steps after it) or 2 where a second kind is the case's point; only the cases about long runs (a
set_epoch past 40 steps, a counter threshold at forward 60) run longer, and try every kind. --stop-seed 0
everywhere: the same points in every run. Measured (2026-12-07, the 2-core VM, lightly loaded, -n 0): the file
165 s wall, 142 CPU-s, 7-14 s a case.

The last three defects (a step's extra value, a set_epoch past 40 steps, a counter threshold late in the run)
need issue 42 items 1 and 2 (the whole run checked, a step's extra values compared): before those, the check
passed all three with exit 0 ("uninterrupted: 40 steps", the run cut short; extra values not compared)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test

NOT_EXACT, EXACT = 1, 0
SHORT = ("--epochs", "1", "--batch-size", "16", "--stops", "1")  # 3 steps on 2 ranks (96 samples)

# name: (task, options, exit code, substrings of the output: the first divergence and its named cause)
CASES: dict[str, tuple[str, tuple[str, ...], int, tuple[str, ...]]] = {
    # ----- defects --------------------------------------------------------------------------------------------
    "private-generator": (
        "private_generator",
        SHORT,
        NOT_EXACT,
        (
            "first divergence: the loss at step 3",
            "after stop 1",
            "the step depends on something outside the checkpoint",
        ),
    ),
    "model-counter": (
        "model_counter",
        SHORT,
        NOT_EXACT,
        ("first divergence: the loss at step 3", "after stop 1", "a Python counter"),
    ),
    "stream-without-state": (
        "stream_without_state",
        SHORT,
        NOT_EXACT,
        ("first divergence: data order at step 3", "after stop 1", "a stream's own state"),
    ),
    "lr-outside-the-kit": (
        "lr_outside_the_kit",
        # 2 epochs (6 steps): the lr a step sets is seen where the next step starts. In a 3-step run stopped in
        # step 2, only the last step's update differs, and the check names model.pth (the symptom).
        ("--epochs", "2", *SHORT[2:]),
        NOT_EXACT,
        (
            "first divergence: the optimizer's group 0's lr differs at step ",
            "after stop 1",
            "likely cause: the optimizer's settings",
            "set the learning rate with Task.scheduler",
        ),
    ),
    "optimizer-attribute": (
        "optimizer_attribute",
        SHORT,
        NOT_EXACT,
        (
            "first divergence: the optimizer's attribute steps differs at step 3",
            "after stop 1",
            "a hand-written optimizer's step count",
        ),
    ),
    "workers-numpy-generator": (
        "workers_numpy_generator",
        (*SHORT, "--num-workers", "2"),  # 6 steps: the second batch a resumed worker draws is another's
        NOT_EXACT,
        ("first divergence: data order at step", "augmentation drawn in DataLoader workers"),
    ),
    "clock-order": (
        "clock_order",
        SHORT,
        NOT_EXACT,
        (
            "first divergence: data order at step 1",
            "two starts of the same command already differ",
            "the clock",
        ),
    ),
    "hash-order": (
        "hash_order",
        SHORT,
        NOT_EXACT,
        (
            "first divergence: data order at step 1",
            "two starts of the same command already differ",
            "unseeded",
        ),
    ),
    "ema-outside-the-model": (
        "ema_outside_the_model",
        (*SHORT, "--eval-every-steps", "2"),
        NOT_EXACT,
        (
            "first divergence: evaluation records (ema_mse) at step 2",
            "depends on state outside the checkpoint",
        ),
    ),
    "step-extra": (
        "step_extra",
        SHORT,
        NOT_EXACT,
        (
            "first divergence: the step's extra value 'running_loss' differs at step 3: "
            "metrics.jsonl's record of step 3",
            "a running mean",
            "the resume is not exact",
        ),
    ),
    "set-epoch-private-generator-past-40-steps": (
        "set_epoch_private_generator",
        ("--epochs", "2", "--batch-size", "8"),  # 2 epochs of 64 steps; every kind of stop
        NOT_EXACT,
        # In epoch 2 (steps 65-128), past the check's old 40-step cut: which stop of epoch 2 sees it first
        # depends on where the stops fall (a resume at the boundary itself calls set_epoch again, and matches).
        (
            "first divergence: data order at step ",
            "uninterrupted: 128 steps; now stopped",
            "stop 1, at an epoch's last step: ",
            "the resume is not exact",
        ),
    ),
    "counter-threshold-late-in-the-run": (
        "late_counter_threshold",
        ("--epochs", "2", "--batch-size", "8", "--stops", "1"),  # 2 epochs of 40 steps; the threshold at 60
        NOT_EXACT,
        ("first divergence: the loss at step 61", "a Python counter"),
    ),
    # ----- exact ----------------------------------------------------------------------------------------------
    "dropout": ("dropout", (*SHORT[:-1], "2"), EXACT, ("every stop matched",)),
    "global-rngs-in-workers": (
        "global_rngs_in_workers",
        (*SHORT, "--num-workers", "2", "--eval-every-steps", "2"),
        EXACT,
        ("every stop matched",),
    ),
    "stream-with-state": ("stream_with_state", (*SHORT[:-1], "2"), EXACT, ("every stop matched",)),
    "batchnorm-ddp": ("batchnorm", (*SHORT[:-1], "2", "--strategy", "ddp"), EXACT, ("every stop matched",)),
    "batchnorm-fsdp": ("batchnorm", (*SHORT[:-1], "2", "--strategy", "fsdp"), EXACT, ("every stop matched",)),
    "fsdp-factory-keep-best": (
        "fsdp_factory",
        (*SHORT[:-1], "2", "--strategy", "fsdp", "--eval-every-steps", "1", "--keep-best", "loss:min"),
        EXACT,
        ("every stop matched",),
    ),
}


def check(folder: Path, task: str, options: tuple[str, ...]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "hpc_ddp.doctor", "resume", "--task", f"zoo_tasks:{task}", *options]
    cmd += ["--stop-seed", "0", "--folder", str(folder)]
    env = clean_environ()
    env.pop(
        "PYTHONHASHSEED", None
    )  # the hash-seeded order is a defect only where the seed differs per process
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, preexec_fn=die_with_test)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(240)
@pytest.mark.parametrize("case", list(CASES))
def test_the_check_names_each_defect_and_passes_each_exact_task(tmp_path: Path, case: str) -> None:
    task, options, code, said = CASES[case]
    got, out = check(tmp_path, task, options)
    assert got == code, f"{case}: exit {got}, expected {code}:\n{out}"
    for words in said:
        assert words in out, f"{case}: {words!r} not in the check's output:\n{out}"
    if (
        "the optimizer's" in said[0] or case == "step-extra"
    ):  # the cause named, not what it changed (issue 42)
        assert "parameter outside state_dict" not in out and "non-deterministic" not in out, out
    if case == "set-epoch-private-generator-past-40-steps":
        step = int(out.split("first divergence: data order at step ")[1].split(":")[0])
        assert step > 64, f"{case}: the divergence at step {step}, not in epoch 2:\n{out}"
    if code == NOT_EXACT:
        assert (
            "the resume is not exact" in out
            and len([ln for ln in out.splitlines() if "first divergence" in ln]) <= 1
        )
    # The rerun on the finished run happens only while the verdict may still be exact: one start saved.
    assert (tmp_path / "finished.log").exists() == (code == EXACT), sorted(p.name for p in tmp_path.iterdir())


def test_the_zoo_has_twelve_defects_and_six_exact_tasks() -> None:
    codes = [code for _, _, code, _ in CASES.values()]
    assert codes.count(NOT_EXACT) >= 12 and codes.count(EXACT) >= 6
    assert len({task for task, _, code, _ in CASES.values() if code == NOT_EXACT}) == codes.count(NOT_EXACT)
