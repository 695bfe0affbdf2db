"""The resume section: what `python -m hpc_ddp.doctor resume` costs against one uninterrupted run of the same
options (issue 42, item 8).

Its task is this module's `task`: a linear layer on the built-in synthetic regression data, with an evaluation
set, so that the check's options make it try every kind of stop point: 2 epochs (an epoch's last step), the run
ending at --max-steps (its last step), --grad-accum 2 (within accumulation), --eval-every-steps (during an
evaluation), --save-every-steps (a save in flight), and the first step after a resume. 200 optimizer steps on
--world-size ranks (--quick: 8).

Interleaved, A B B A ...: the check (the whole command: its uninterrupted run, its stopped run with one restart
per stop, its rerun of the finished run, its comparisons), and the plain run of the same options
(`python -m hpc_ddp.submit --local`, --deterministic as the check runs it). The start-up of one restart is the
plain run's own time from its command's start to rank 0's first optimizer step (a restart is a new start of
the ranks: imports, rendezvous, the task built, the checkpoint loaded). The target (issue 42): the check costs
at most 3x the uninterrupted run plus the start-ups of its restarts: its stops, and its rerun of the finished
run (one more start):

    check_s / (3 x uninterrupted_s + restarts x startup_s) <= 1.0
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from hpc_ddp.bench.runs import RunFailed, Runner, Settings, drop_weights, first_step_time, median, run_cmd
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.tasks import Task, _synthetic_regression

SAMPLES = 1600  # the task's training set
ACCUM = 2
TASK_SPEC = "hpc_ddp.bench.resuming:task"


def task(config: TrainConfig) -> Task:
    """The article's linear model with an evaluation set (the check tries a stop during an evaluation)."""
    from torch import nn

    return Task(
        model=nn.Linear(10, 1),
        dataset=_synthetic_regression(SAMPLES, 10, 1, config.seed),
        loss_fn=nn.functional.mse_loss,
        eval_dataset=_synthetic_regression(64, 10, 1, config.seed + 1),
    )


def steps(s: Settings) -> int:
    return 8 if s.quick else 200


def options(s: Settings) -> list[str]:
    """The run's options: 2 epochs of steps(s) / 2 optimizer steps each, every kind of stop point in them."""
    total = steps(s)
    batch = SAMPLES // (s.world_size * ACCUM * (total // 2))
    if batch < 1:
        raise RunFailed(f"--world-size {s.world_size}: too many ranks for {SAMPLES} samples in {total} steps")
    return [
        "--task", TASK_SPEC, "--epochs", "2", "--max-steps", str(total), "--batch-size", str(batch),
        "--grad-accum", str(ACCUM), "--eval-every-steps", str(max(2, total // 4)),
        "--save-every-steps", str(max(3, total // 8)), "--log-every-s", "0",
    ]  # fmt: skip


def shape(s: Settings) -> list[str]:
    return ["--nodes", "1", "--tasks-per-node", str(s.world_size)]


def resume_section(s: Settings) -> dict[str, Any]:
    runner = Runner(s)
    times: dict[str, list[float]] = {"check": [], "uninterrupted": [], "startup": [], "restarts": []}
    for trial in range(s.trials):
        for name in ("check", "uninterrupted") if trial % 2 == 0 else ("uninterrupted", "check"):
            if name == "check":
                seconds, restarts = check_run(runner, s, trial)
                times["check"].append(seconds)
                times["restarts"].append(float(restarts))
            else:
                seconds, startup = plain_run(runner, s, trial)
                times["uninterrupted"].append(seconds)
                times["startup"].append(startup)
    per_trial = [
        c / (3 * u + r * st)
        for c, u, r, st in zip(
            times["check"], times["uninterrupted"], times["restarts"], times["startup"], strict=True
        )
    ]
    return {
        "steps": steps(s),
        "ranks": s.world_size,
        "check_s": median(times["check"]),
        "uninterrupted_s": median(times["uninterrupted"]),
        "restarts": median(times["restarts"]),
        "startup_s": median(times["startup"]),
        "check_vs_budget": median(per_trial),
        "trials": {**times, "check_vs_budget": per_trial},
        "options": " ".join(options(s)),
        "budget": "3 x the uninterrupted run + restarts x the start-up of one (the stops, and the rerun of the "
        "finished run); start-up: the plain run's command start to rank 0's record of step 1",
    }


def check_run(runner: Runner, s: Settings, trial: int) -> tuple[float, int]:
    """The whole check, timed; and its restarts: one per stop, one for its rerun of the finished run."""
    folder = runner.folder("resume-check")
    log = folder.with_suffix(".log")
    cmd = [sys.executable, "-m", "hpc_ddp.doctor", "resume", *shape(s), *options(s), "--folder", str(folder)]
    start = run_cmd(cmd, log, timeout=1200)
    seconds = time.time() - start
    out = log.read_text(errors="replace")
    found = re.search(r"now stopped (\d+) times", out)
    if found is None or "every stop matched" not in out:
        raise RunFailed(
            f"the resume check did not pass; last lines of {log}:\n" + "\n".join(out.splitlines()[-8:])
        )
    restarts = int(found.group(1)) + 1
    for name in ("uninterrupted", "stopped"):
        drop_weights(folder / name)
    runner.done(trial, "resume-check", f"{seconds:.1f} s, {restarts} restarts")
    return seconds, restarts


def plain_run(runner: Runner, s: Settings, trial: int) -> tuple[float, float]:
    """One uninterrupted run of the same options, timed; and its start-up (command start to its first step)."""
    folder = runner.folder("uninterrupted")
    cmd = [
        sys.executable, "-m", "hpc_ddp.submit", "--local", *shape(s), *options(s), "--deterministic",
        "--folder", str(folder),
    ]  # fmt: skip
    start = run_cmd(cmd, folder.with_suffix(".log"))
    seconds = time.time() - start
    startup = first_step_time(folder) - start
    drop_weights(folder)
    runner.done(trial, "uninterrupted", f"{seconds:.1f} s, {startup:.1f} s to its first step")
    return seconds, startup
