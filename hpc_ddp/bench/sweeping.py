"""The sweep section (issue 44): what submitting a sweep costs, and what following it costs the cluster.

    python -m hpc_ddp.bench sweep

For 4, 64 and 512 trials (`--sweep seed=0,1,...`, 2 nodes x 1 task each):

- submission: the whole `python -m hpc_ddp.submit ... --sweep ...` command, wall-clock, start to exit: every
  trial checked by the run's parser, named, its folder made, the record and each array's file written, and
  the arrays handed to submitit, which writes one pickle per element and runs sbatch once per array. Slurm is
  simulated (no cluster runs 512 two-node trials here): `sbatch`, `scontrol` and `squeue` on the command's PATH
  are scripts that answer as the real ones do (a job id; MaxArraySize 256, so 512 trials are two arrays; an
  empty queue) and count their calls.
- following: `--wait`'s loop (hpc_ddp.launch.sweep.follow) over the same trials for three polls (all pending;
  one running; all ended) against a scripted cluster: the Slurm commands it ran per poll.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp import proc
from hpc_ddp.bench.runs import Runner, Settings, median, progress, run_cmd

SIZES = (4, 64, 512)
MAX_ARRAY_SIZE = 256  # the simulated site's
SUBMITS = "sbatch"  # the simulated command that submits: its calls are the arrays submitted

# The simulated commands: each appends its name to calls.log in its folder.
FAKE = {
    SUBMITS: 'echo "Submitted batch job $((4200 + $(wc -l < "$here/calls.log")))"',
    "scontrol": f'echo "MaxArraySize            = {MAX_ARRAY_SIZE}"',
    "squeue": "true",
    "sacct": "true",
}


def fake_commands(folder: Path) -> Path:
    """A folder of the simulated commands, to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calls.log").touch()
    for name, body in FAKE.items():
        script = folder / name
        script.write_text(f'#!/bin/bash\nhere=$(dirname "$0")\necho {name} >> "$here/calls.log"\n{body}\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def submission(s: Settings, runner: Runner, trials: int) -> dict[str, float]:
    folder = runner.folder(f"sweep-{trials}")
    fake = fake_commands(folder / "bin")
    seeds = ",".join(map(str, range(trials)))
    command = [sys.executable, "-m", "hpc_ddp.submit", "--nodes", "2", "--tasks-per-node", "1"]
    command += ["--folder", str(folder / "sweep"), "--sweep", f"seed={seeds}", "--sweep-parallel", "8"]
    path = f"{fake}:{os.environ.get('PATH', '')}"
    start = run_cmd(command, folder / "output.log", extra_env={"PATH": path})
    seconds = time.time() - start
    calls = (fake / "calls.log").read_text().split()
    arrays = len(list((folder / "sweep" / "arrays").iterdir()))
    return {
        "seconds": seconds,
        "sbatch": sum(call == SUBMITS for call in calls),
        "arrays": arrays,
        "calls": len(calls),
    }


def polls(trials: int) -> dict[str, float]:
    from hpc_ddp.launch.sweep import follow, state
    from hpc_ddp.launch.sweep.trials import Trial
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.scheduler.slurm.client import SlurmClient

    jobs = [f"7_{i}" for i in range(trials)]
    script = [
        {j: "PENDING" for j in jobs},
        {j: "RUNNING" if i == 0 else "PENDING" for i, j in enumerate(jobs)},
        {j: "COMPLETED" for j in jobs},
    ]
    calls: list[str] = []
    asked = {"squeue": 0, "sacct": 0}

    def runner(argv: Sequence[str], timeout_s: float) -> proc.Output:
        calls.append(argv[0])
        now = script[min(asked[argv[0]], len(script) - 1)]
        asked[argv[0]] += 1
        live = argv[0] == "squeue"
        return proc.Output("".join(f"{j}|{w}|None\n" for j, w in now.items() if not live or w != "COMPLETED"))

    nowhere = Path("/nonexistent-hpc-ddp-bench")
    trial = [
        Trial(f"seed={i}", (("seed", str(i)),), (), nowhere / str(i), TrainConfig()) for i in range(trials)
    ]
    decisions = [state.TrialPlan(t, state.TrialState(state.NEW), state.RUN, "new") for t in trial]
    sleeps: list[float] = []
    follow.follow(
        nowhere,
        decisions,
        list(zip(trial, jobs, strict=True)),
        SlurmClient(runner=runner),
        lambda line: None,
        sleeps.append,
    )
    poll_count = len(sleeps) + 1
    return {"polls": poll_count, "calls_per_poll": len(calls) / poll_count}


def sweep_section(s: Settings) -> dict[str, Any]:
    runner = Runner(s)
    sizes = SIZES[:1] if s.quick else SIZES
    figures: dict[str, Any] = {}
    for n in sizes:
        runs = [submission(s, runner, n) for _ in range(1 if s.quick else s.trials)]
        followed = polls(n)
        figures[str(n)] = {
            "submit_s": median([r["seconds"] for r in runs]),
            "trials": [r["seconds"] for r in runs],
            "arrays": runs[0]["arrays"],
            "sbatch_calls": runs[0]["sbatch"],
            "slurm_calls_at_submission": runs[0]["calls"],
            "slurm_calls_per_poll": followed["calls_per_poll"],
        }
        progress(
            f"sweep of {n}: submitted in {figures[str(n)]['submit_s']:.2f} s ({runs[0]['arrays']} array(s), "
            f"{runs[0]['sbatch']} sbatch); following: {followed['calls_per_poll']:g} Slurm calls per poll"
        )
    return {
        "sizes": figures,
        "max_array_size": MAX_ARRAY_SIZE,
        "measured": "submit: wall-clock of the whole `submit --sweep` command (python start-up included) against "
        "simulated sbatch/scontrol/squeue; following: Slurm commands per poll of --wait's loop",
    }


def rows(r: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    out = []
    for n, f in r["sizes"].items():
        out.append(
            (
                "sweep" if not out else "",
                f"{n} trials: submit ({f['arrays']} array(s)); Slurm calls/poll",
                f"{f['submit_s']:.2f} s; {f['slurm_calls_per_poll']:g}",
            )
        )
    return out
