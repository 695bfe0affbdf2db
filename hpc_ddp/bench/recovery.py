"""The recovery section (`python -m hpc_ddp.bench recovery`, not in the default run: it needs a Slurm
cluster whose nodes it may take away, such as the local one of env/slurm/cluster.sh, and about a minute a
trial): the same node failure recovered two ways, interleaved, `--trials` times each. First, without a
cluster, a rank lost with its node's memory recovered from disk and from snapshots (hpc_ddp.bench.memory).

- requeue: a 2-node x 1-task job (`submit --wait`); once it has saved its first checkpoint, the last node of its
  step is set DOWN (then DRAIN: a bare DOWN returns at once on the local cluster). The batch shell requeues the
  job away from that node; it waits in the queue, starts again on a new allocation, resumes.
- in place: the same job with `--spare-nodes 1`; the batch shell starts a new step in the allocation it holds,
  the spare in place of the lost node (hpc_ddp.launch.slurm.inplace).

Figure: seconds from the failure (the moment the node is set DOWN) to the next committed step (the first
"step" record of the attempt that follows, in metrics.jsonl). Targets: in place at most 15 s (median), and at
most 0.3x the requeue path. Each job is cancelled once it has committed that step, and the node resumed.
Never the batch shell's node: its loss ends the job whatever runs there (Slurm's requeue, `submit --wait`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.bench.runs import RunFailed, Settings, child_env, median, progress, ratios
from hpc_ddp.ledger import attempts

TASK = "hpc_ddp.bench.recovery:sleepy"
STEP_SLEEP_S = 0.2
TIMEOUT_S = 300.0  # one trial's job, start to the step after the failure: against a hung cluster only


def sleepy(config: Any) -> Any:
    """A small model that sleeps STEP_SLEEP_S a step: the failure lands mid-run, whatever the machine."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from hpc_ddp.run.tasks import Task

    gen = torch.Generator().manual_seed(config.seed)
    x = torch.randn(2048, 16, generator=gen)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SLEEP_S)
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(16, 1), dataset=TensorDataset(x, x.sum(1, keepdim=True)), loss_fn=loss_fn)


def _client() -> Any:
    from hpc_ddp.scheduler.slurm.client import SlurmClient

    return SlurmClient()


def _wait_idle(client: Any, timeout_s: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = client.nodes()
        if states and all(s == "idle" for s in states.values()):
            return sorted(states)
        if time.monotonic() > deadline:
            raise RunFailed(f"the cluster's nodes are not idle after {timeout_s:g} s: {states}")
        time.sleep(0.5)


def _first_attempt(folder: Path, proc: subprocess.Popen[str]) -> attempts.Attempt:
    """The job's first attempt, once it has saved a checkpoint (its nodes are then known)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        started = [a for a in attempts.read(folder) if a.started is not None]
        if started and (folder / "checkpoints" / "latest").is_file():
            return started[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RunFailed(f"the job in {folder} saved no checkpoint (see {folder}/submit.log)")
        time.sleep(0.1)


def _next_step_time(folder: Path, proc: subprocess.Popen[str]) -> float:
    """The time of the first step record after the run's second start record (the first step the attempt
    after the failure committed)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            lines = (folder / "metrics.jsonl").read_text().splitlines()
        except OSError:
            lines = []
        starts = 0
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            starts += record.get("event") == "start"
            if starts >= 2 and record.get("event") == "step":
                return float(record["time"])
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RunFailed(
                f"the job in {folder} committed no step after the failure (see {folder}/submit.log)"
            )
        time.sleep(0.1)


def trial(s: Settings, label: str, spares: int, number: int) -> float:
    """One job, one node failure: the seconds from it to the next committed step."""
    client = _client()
    _wait_idle(client)
    folder = s.work / f"recovery-{label}-{number}"
    folder.mkdir(parents=True)
    argv = [sys.executable, "-m", "hpc_ddp.submit", "--nodes", "2", "--tasks-per-node", "1"]
    argv += ["--gpus-per-node", "0", "--time", "15", "--folder", str(folder / "run"), "--task", TASK]
    argv += ["--epochs", "4", "--batch-size", "16", "--save-every-steps", "4", "--wait"]
    argv += ["--spare-nodes", str(spares)] if spares else []
    with open(folder / "submit.log", "w") as log:
        proc = subprocess.Popen(argv, env=child_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    taken = ""
    try:
        first = _first_attempt(folder / "run", proc)
        taken = first.nodes[-1]  # the step's last node: never the batch shell's (the first of the job)
        failed_at = time.time()
        for state in ("DOWN", "DRAIN"):
            client.set_node(taken, state, "hpc_ddp bench recovery")
        seconds = _next_step_time(folder / "run", proc) - failed_at
    finally:
        if proc.poll() is None:
            job = next((a.job for a in attempts.read(folder / "run")), "")
            if job:
                client.cancel(job)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if taken:
            client.set_node(taken, "RESUME")
    progress(f"recovery {label} trial {number + 1}: {seconds:.1f} s from the failure to the next step")
    return seconds


def recovery_section(s: Settings) -> dict[str, Any]:
    """The memory path first, locally (hpc_ddp.bench.memory); then both Slurm paths, interleaved, skipped
    (with the reason) where no Slurm cluster answers."""
    from hpc_ddp.bench.memory import memory_section

    memory = memory_section(s)
    nodes = _client().nodes()
    if len(nodes) < 3:
        why = "no Slurm cluster answers (sinfo)" if not nodes else f"{len(nodes)} node(s): it needs 3"
        progress(f"recovery: skipped: {why}")
        return {"skipped": why, "memory": memory}
    requeue: list[float] = []
    in_place: list[float] = []
    for number in range(s.trials):
        requeue.append(trial(s, "requeue", 0, number))
        in_place.append(trial(s, "in-place", 1, number))
    return {
        "requeue_s": median(requeue),
        "in_place_s": median(in_place),
        "in_place_vs_requeue": median(ratios(in_place, requeue)),
        "trials": {"requeue": requeue, "in_place": in_place},
        "memory": memory,
    }
