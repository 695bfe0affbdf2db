"""User tasks for the Slurm tests, loaded as `--task slurm_tasks:NAME` (the time-limit test's first).

Slurm checks time limits every 30 s, so a `--signal` ahead of a 1-minute limit lands anywhere in a 30-s window
of the run. To be sure the signal finds the first run still training, that run must be slow; to finish in
the requeued run before *its* signal, the rest must be fast. So: `slow_tasks.slow` (dropout, momentum, a sleep
per step) on a job's first run, the same model and data without the sleep once Slurm has requeued it.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import slow_tasks
from torch import nn


def slow_until_requeued(config):  # type: ignore[no-untyped-def]
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        os.environ["SLOW_TASK_SLEEP_S"] = "0"
    return slow_tasks.slow(config)


def without_scontrol(config):  # type: ignore[no-untyped-def]
    """`slow_until_requeued` in a task that cannot run scontrol (a container without Slurm's commands): rank 0
    leaves "mode": "exit" in preempted.json, and slurm/ddp.sbatch has to requeue in its place."""
    os.environ["PATH"] = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not os.path.exists(os.path.join(d, "scontrol"))
    )
    return slow_until_requeued(config)


def slow_until_released(config):  # type: ignore[no-untyped-def]
    """`slow_tasks.slow` whose per-step sleep ends once the file $RELEASE_FILE exists: a job that stays busy
    exactly as long as its test needs it (another job's whole life), then finishes at full speed."""
    release = os.environ["RELEASE_FILE"]
    task = slow_tasks.slow(config)
    slow_loss = task.loss_fn

    def loss_fn(output, target):  # type: ignore[no-untyped-def]
        if os.path.exists(release):
            return nn.functional.mse_loss(output, target)
        return slow_loss(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)


def fsdp_bad_node_after_requeue(config):  # type: ignore[no-untyped-def]
    """fsdp_tasks.blocks, slow on the job's first run (a sleep of $STEP_SLEEP_S a step: a preemption signal
    finds it training); on its second (after one requeue), the tasks on $RETRY_BAD_NODE raise a GPU hardware
    error at their third step (the node is blamed and excluded); no sleep from the second run on."""
    import fsdp_tasks
    import torch

    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restart > 0:
        os.environ["STEP_SLEEP_S"] = "0"
    task = fsdp_tasks.blocks(config)
    if restart != 1 or os.environ.get("SLURMD_NODENAME") != os.environ.get("RETRY_BAD_NODE"):
        return task
    calls = [0]
    inner = task.loss_fn

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
        return inner(output, target)

    return dataclasses.replace(task, loss_fn=loss_fn)


def sigkilled_at_start(config):  # type: ignore[no-untyped-def]
    """Rank 1 dies by SIGKILL as its task is built, every time (the OOM killer at start, say): the same death
    twice and no checkpoint in between, a crash loop."""
    if int(os.environ.get("SLURM_PROCID") or 0) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return slow_tasks.slow(config)
