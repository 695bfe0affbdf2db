"""The launch section: command start to the first training step, `submit --local` against torchrun, and the CPU
each whole command spends (the local launcher forks its ranks from one process that imported torch once,
launch/local/forkserver.py; torchrun's agent and each of its workers import torch); and the CPU a rank spends
importing torch, as a rank does it (run/startup.py: the collector paused) against plainly."""

from __future__ import annotations

import resource
import sys
from typing import Any

from hpc_ddp.bench.runs import TASK, Runner, Settings, median, ratios, run_cmd, torchrun_cmd

# What every training rank imports (run/startup.py says why torch._dynamo is among them).
PLAIN_IMPORT = "import torch, torch._dynamo, torch.distributed"
RANK_IMPORT = "from hpc_ddp.run.startup import import_torch; import_torch()"


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
    times: dict[str, list[float]] = {
        "local": [],
        "torchrun": [],
        "local_cpu": [],
        "torchrun_cpu": [],
        "import_rank": [],
        "import_plain": [],
    }
    order = [("local", "launch-submit-local", local), ("torchrun", "launch-torchrun", torchrun)]
    imports = [("import_rank", RANK_IMPORT), ("import_plain", PLAIN_IMPORT)]
    for trial in range(s.trials):
        for name, label, cmd in order if trial % 2 == 0 else order[::-1]:
            before = children_cpu()
            times[name].append(runner.first_step(label, cmd, trial))
            times[f"{name}_cpu"].append(children_cpu() - before)
        for name, code in imports if trial % 2 == 0 else imports[::-1]:
            times[name].append(import_cpu(runner, name, code, trial))
    return {
        "local_s": median(times["local"]),
        "torchrun_s": median(times["torchrun"]),
        "local_vs_torchrun": median(ratios(times["local"], times["torchrun"])),
        "local_cpu_s": median(times["local_cpu"]),
        "torchrun_cpu_s": median(times["torchrun_cpu"]),
        "local_vs_torchrun_cpu": median(ratios(times["local_cpu"], times["torchrun_cpu"])),
        "import_rank_cpu_s": median(times["import_rank"]),
        "import_plain_cpu_s": median(times["import_plain"]),
        "import_rank_vs_plain": median(ratios(times["import_rank"], times["import_plain"])),
        "trials": times,
        "first_step": "wall-clock time on rank 0's metrics.jsonl record of step 1 (--log-every-s 0), "
        "minus the time just before the command started",
        "launch_cpu": "user + system CPU seconds of the whole command to its end: the launcher, its fork server "
        "and its ranks; torchrun's agent and its workers",
        "import_cpu": "user + system CPU seconds of a fresh python that imports what a rank imports, as a rank "
        f"does ({RANK_IMPORT}) and plainly ({PLAIN_IMPORT})",
    }


def children_cpu() -> float:
    """User + system CPU seconds of every process this one has waited for (and they for theirs)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def import_cpu(runner: Runner, label: str, code: str, trial: int) -> float:
    """CPU seconds (user + system) of a fresh `python -c code`: the imports alone, no rank around them."""
    before = children_cpu()
    run_cmd([sys.executable, "-c", code], runner.folder(label).with_suffix(".log"))
    seconds = children_cpu() - before
    runner.done(trial, label, f"{seconds:.2f} CPU s")
    return seconds
