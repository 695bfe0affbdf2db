"""The whole bench: run the chosen sections in order, print the table, write the JSON report."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from hpc_ddp.bench import recovery, resuming, saving, sharding, startup, sweeping, throughput, watching
from hpc_ddp.bench.report import header, table, targets
from hpc_ddp.bench.runs import TASK, RunFailed, Settings, load_average, progress

PROG = "python -m hpc_ddp.bench"
SECTIONS = ("overhead", "scaling", "checkpoint", "launch", "watchdog")  # the default run
# Asked for by name only: fsdp takes minutes and gigabytes; recovery a Slurm cluster whose nodes it takes away;
# resume a check of a 200-step run (minutes on a loaded machine); sweep submits sweeps of up to 512 trials to a
# simulated Slurm (issue 44).
OPTIONAL = ("fsdp", "recovery", "resume", "sweep")


def run_sections(s: Settings, sections: Sequence[str]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if "overhead" in sections or "scaling" in sections:
        results.update(throughput.throughput(s, sections))
    if "checkpoint" in sections:
        results["checkpoint"] = saving.checkpoint_section(s)
    if "launch" in sections:
        results["launch"] = startup.launch_section(s)
    if "watchdog" in sections:
        results["watchdog"] = watching.watchdog_section(s)
    if "fsdp" in sections:
        results["fsdp"] = sharding.fsdp_section(s)
    if "recovery" in sections:
        results["recovery"] = recovery.recovery_section(s)
    if "resume" in sections:
        results["resume"] = resuming.resume_section(s)
    if "sweep" in sections:
        results["sweep"] = sweeping.sweep_section(s)
    return {name: results[name] for name in SECTIONS + OPTIONAL if name in results}


def run(
    sections: Sequence[str],
    trials: int,
    steps: int,
    world_size: int,
    batch_size: int,
    quick: bool,
    json_path: str | None,
    keep_in: str | None,
) -> int:
    """Run `sections` in a fresh work folder (under `keep_in`, kept; else a temporary one, removed), print the
    table, write the JSON report to `json_path`; returns the exit code (1 if a measured run failed)."""
    if keep_in:
        # A fresh folder inside it every time: a kit run that found an earlier run's checkpoints would resume.
        Path(keep_in).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hpc_ddp-bench-", dir=keep_in or None))
    s = Settings(
        trials=trials, steps=steps, world_size=world_size, batch_size=batch_size, work=work, quick=quick
    )
    load_before = load_average()
    progress(f"{header(s, sections)}; load {load_before:.1f}; runs in {work}")
    started = time.monotonic()
    try:
        results = run_sections(s, sections)
    except RunFailed as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if not keep_in:
            shutil.rmtree(work, ignore_errors=True)
    print(header(s, sections), flush=True)
    cpus = len(os.sched_getaffinity(0))
    print(table(results, s, load_before, cpus), flush=True)
    if json_path:
        report = {
            "settings": {
                "task": TASK,
                "trials": s.trials,
                "steps": s.steps,
                "world_size": s.world_size,
                "batch_size": s.batch_size,
                "quick": s.quick,
                "cpus": cpus,
                "torch": version("torch"),
                "load_before": load_before,
                "load_after": load_average(),
                "seconds": round(time.monotonic() - started, 1),
            },
            "sections": results,
            "targets": [t.as_dict(load_before, cpus) for t in targets(results)],
        }
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0
