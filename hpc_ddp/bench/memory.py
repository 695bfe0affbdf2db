"""The recovery section's memory path (issue 45): a rank lost with its node's memory, recovered from the disk's
checkpoint (`--save-every-steps 50`) and from snapshots in memory (`--snapshot-every-steps 1`), interleaved,
`--trials` times each, on the local launcher (2 emulated nodes x 1 rank: no cluster needed).

Each trial trains the gpt example (`--task gpt`) for `--steps` steps (at least LEAST_STEPS); once rank 0 has
finished half of them, the bench deletes the second node's snapshot folder (as losing a machine loses its
memory) and SIGKILLs its rank. The launcher restarts every rank; the snapshot path resumes rank 1 from its buddy's replica on node 1.

Figures: the steps lost per failure (the attempt's last step minus the one it resumed from), the seconds from
the kill to the next committed step, and the loop's stall per snapshot (the copy out of the tensors) as a
fraction of the median step time. Targets: at most 1 step lost from memory, a stall of at most 1 % of a step,
and recovery from memory no slower than from disk.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.bench.runs import (
    RunFailed,
    Settings,
    child_env,
    drop_weights,
    median,
    progress,
    ratios,
    read_records,
)
from hpc_ddp.ledger import attempts
from hpc_ddp.run.records import reached
from hpc_ddp.variables import SNAPSHOT_DIR

TASK = "gpt"
TIMEOUT_S = 600.0  # one trial, against a hung run only
# The rank is killed halfway through a run of at least this many steps: enough steps after the kill that a
# loaded machine cannot finish the run before the kill lands (a --quick run of 4 steps, killed at step 3,
# sometimes ended whole first: no restart, nothing to measure).
LEAST_STEPS = 24
PATHS = {
    "disk": ("--save-every-steps", "50"),
    "memory": ("--save-every-steps", "50", "--snapshot-every-steps", "1"),
}


def _rank(launcher: int, rank: int) -> Any:
    """The launcher's rank process: a rank forked by the launcher's server names itself for its rank."""
    import psutil

    from hpc_ddp.launch.local import forkserver

    for child in psutil.Process(launcher).children():
        if child.name() == forkserver.name(str(rank)):
            return child
    raise RunFailed(
        f"rank {rank} of the local run (launcher pid {launcher}) not found among its forked ranks"
    )


def _wait_step(run: Path, step: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (reached.read(run) or (0, 0.0))[0] < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RunFailed(f"the run in {run} never reached step {step} (see its logs)")
        time.sleep(0.02)


def _after_restart(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    if len(starts) < 2:
        raise RunFailed("the run was not restarted after the kill")
    return records[starts[1] :]


def trial(s: Settings, label: str, number: int) -> dict[str, float]:
    """One local run, one rank lost with its node's memory: its figures."""
    folder = s.work / f"memory-{label}-{number}"
    folder.mkdir(parents=True)
    run, shm = folder / "run", folder / "shm"
    argv = [sys.executable, "-m", "hpc_ddp.submit", "--local", "--nodes", "2", "--tasks-per-node", "1"]
    steps = max(s.steps, LEAST_STEPS)
    argv += ["--folder", str(run), "--task", TASK, "--epochs", "100", "--max-steps", str(steps)]
    argv += ["--batch-size", str(s.batch_size), "--deterministic", *PATHS[label]]
    with open(folder / "launcher.log", "w") as log:
        env = {**child_env(), SNAPSHOT_DIR: str(shm)}
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_step(run, steps // 2, proc)
        job = next(r["job"] for r in read_records(run / "metrics.jsonl") if r.get("event") == "start")
        shutil.rmtree(shm / job / "127.0.0.2", ignore_errors=True)  # a lost machine loses its memory
        killed_at = time.time()
        _rank(proc.pid, 1).kill()
        if proc.wait(timeout=TIMEOUT_S) != 0:
            raise RunFailed(f"the run in {run} did not finish after the kill (see {folder}/launcher.log)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    after = _after_restart(read_records(run / "metrics.jsonl"))
    steps = [r for r in after if r.get("event") == "step"]
    failed = attempts.read(run)[0]
    resumed = next((r for r in after if r.get("event") == "resume"), None)
    lost = resumed["lost_steps"] if resumed and resumed.get("from") == "memory" else failed.lost_steps
    figures = {"lost_steps": float(lost), "to_next_step_s": float(steps[0]["time"]) - killed_at}
    summary = next((r for r in after if r.get("event") == "snapshots"), None)
    if summary and summary.get("stall_s") is not None:
        figures["stall_fraction"] = summary["stall_s"] / median(
            [r["step_time_s"] for r in steps[1:] or steps]
        )
    drop_weights(run)  # its checkpoints and model.pth: the bench reads records, never weights
    progress(f"recovery memory, {label} trial {number + 1}: {figures}")
    return figures


def memory_section(s: Settings) -> dict[str, Any]:
    """Both paths, interleaved; the medians, and the trials."""
    trials: dict[str, list[dict[str, float]]] = {"disk": [], "memory": []}
    for number in range(s.trials):
        for label in PATHS:
            trials[label].append(trial(s, label, number))
    disk, memory = trials["disk"], trials["memory"]
    to_disk, to_memory = [t["to_next_step_s"] for t in disk], [t["to_next_step_s"] for t in memory]
    return {
        "task": TASK,
        "disk_lost_steps": median([t["lost_steps"] for t in disk]),
        "memory_lost_steps": max(t["lost_steps"] for t in memory),
        "disk_to_next_step_s": median(to_disk),
        "memory_to_next_step_s": median(to_memory),
        "memory_vs_disk": median(ratios(to_memory, to_disk)),
        "stall_fraction": median([t["stall_fraction"] for t in memory if "stall_fraction" in t]),
        "trials": trials,
    }
