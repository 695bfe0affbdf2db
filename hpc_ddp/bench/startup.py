"""The launch section: command start to the first training step, `submit --local` against torchrun."""

from __future__ import annotations

import sys
from typing import Any

from hpc_ddp.bench.runs import TASK, Runner, Settings, median, ratios, torchrun_cmd


def launch_section(s: Settings) -> dict[str, Any]:
    """Command start to rank 0's first optimizer step: submit --local against torchrun, interleaved."""
    runner = Runner(s)
    train = [
        "--task",
        TASK,
        "--batch-size",
        str(s.batch_size),
        "--max-steps",
        str(s.launch_steps),
        "--save-every-epochs",
        "0",
        "--log-every-s",
        "0",
    ]
    local = [
        sys.executable,
        "-m",
        "hpc_ddp.submit",
        "--local",
        "--nodes",
        "1",
        "--tasks-per-node",
        str(s.world_size),
        *train,
    ]
    torchrun = [
        *torchrun_cmd(),
        "--standalone",
        "--nproc-per-node",
        str(s.world_size),
        "-m",
        "hpc_ddp.train",
        *train,
    ]
    times: dict[str, list[float]] = {"local": [], "torchrun": []}
    order = [("local", "launch-submit-local", local), ("torchrun", "launch-torchrun", torchrun)]
    for trial in range(s.trials):
        for name, label, cmd in order if trial % 2 == 0 else order[::-1]:
            times[name].append(runner.first_step(label, cmd, trial))
    return {
        "local_s": median(times["local"]),
        "torchrun_s": median(times["torchrun"]),
        "local_vs_torchrun": median(ratios(times["local"], times["torchrun"])),
        "trials": times,
        "first_step": "wall-clock time on rank 0's metrics.jsonl record of step 1 (--log-every-s 0), "
        "minus the time just before the command started",
    }
