"""The preemption rules without a run: what rank 0 decides after the agreed save, and who restarts the run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_ddp.run.loop import preemption


@pytest.mark.parametrize(
    "requeue, stop, preempted, max_requeue, expected",
    [
        (1, 0, 0, 3, True),
        (2, 0, 2, 3, True),
        (1, 0, 3, 3, False),  # the budget is spent
        (1, 1, 0, 3, False),  # SIGTERM wins: a cancelled job stays cancelled
        (0, 1, 0, 3, False),
    ],
)
def test_decide(requeue: float, stop: float, preempted: int, max_requeue: int, expected: bool) -> None:
    """The preemption budget counts earlier preemptions of the job (attempts.jsonl), nothing else."""
    assert preemption.decide(requeue, stop, preempted, max_requeue).requeue is expected


@pytest.fixture
def scontrol_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "scontrol"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.parametrize(
    "requeue_by, launcher, mode",
    [
        ("auto", "slurm", "scontrol"),  # a real srun step: rank 0 requeues the job
        ("auto", "torchrun", "exit"),
        ("auto", "single", "exit"),
        (
            "launcher",
            "slurm",
            "exit",
        ),  # submit --local: the fake job id is no Slurm job; the launcher restarts
        ("scontrol", "single", "scontrol"),
    ],
)
def test_who_restarts_a_preempted_run(
    scontrol_on_path: None, requeue_by: str, launcher: str, mode: str
) -> None:
    assert preemption.requeue_mode(requeue_by, launcher) == mode


def test_auto_without_scontrol_leaves_it_to_the_batch_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a container without Slurm's commands
    assert preemption.requeue_mode("auto", "slurm") == "exit"
