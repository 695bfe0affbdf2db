"""A preemption signal that reaches a task while it starts (issue 23 item 3): blocked from the first
instruction the kit controls, and honoured once the task's handler exists, never a death by SIGUSR2.

Each case sends the signal from inside the process at the last moment before the handler is installed (no
race with the clock): before the fix, the default action of SIGUSR2 ended the process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp.launch.slurm import submitter
from hpc_ddp.scheduler.slurm import request

pytestmark = [pytest.mark.process, pytest.mark.deadline(60)]

# Before the handler: USR2 to itself; then the kit's install() (which unblocks); then what it noted.
LATE_INSTALL = """
import os, signal
from hpc_ddp.run.loop import preemption

real = preemption.install

def install(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGUSR2)  # arrives while the task starts: no handler yet
    print("alive after USR2", flush=True)
    real(*args, **kwargs)
    print("noted", preemption.pending(), flush=True)
    raise SystemExit(0)

preemption.install = install
"""


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=50,
        preexec_fn=die_with_test,
    )


def test_python_m_hpc_ddp_train_holds_a_usr2_that_comes_before_its_handler(tmp_path: Path) -> None:
    code = (
        LATE_INSTALL
        + "import runpy; runpy.run_module('hpc_ddp.train', run_name='__main__', alter_sys=True)\n"
    )
    out = run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, (out.returncode, out.stderr)  # before: -SIGUSR2
    assert out.stdout.splitlines() == ["alive after USR2", "noted (1, 0)"]


def test_the_task_starter_blocks_before_submitit_and_the_task_entry(tmp_path: Path) -> None:
    """`python -m hpc_ddp.launch.slurm.start -u -m MODULE`, as every task of a `submit` job starts."""
    (tmp_path / "late_task.py").write_text(
        LATE_INSTALL + "from hpc_ddp.run.loop import preemption\npreemption.install()\n"
    )
    out = run([sys.executable, "-u", "-m", "hpc_ddp.launch.slurm.start", "-u", "-m", "late_task"], tmp_path)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert out.stdout.splitlines() == ["alive after USR2", "noted (1, 0)"]
    bare = run([sys.executable, "-u", "-m", "late_task"], tmp_path)  # without the starter: killed
    assert bare.returncode == -signal.SIGUSR2


def test_the_starter_refuses_anything_but_a_module_with_one_line(tmp_path: Path) -> None:
    out = run([sys.executable, "-m", "hpc_ddp.launch.slurm.start", "script.py"], tmp_path)
    assert out.returncode == 2 and "usage: python -m hpc_ddp.launch.slurm.start" in out.stderr


def test_every_task_of_a_submit_job_starts_through_the_starter(tmp_path: Path) -> None:
    req = request.SlurmRequest(2, 2, gpus_per_node=0, minutes=10, signal_delay_s=120, job_name="hpc_ddp")
    text = submitter.sbatch_text(req, tmp_path, "hpc_ddp.train")
    assert "-u -m hpc_ddp.launch.slurm.start -u -m submitit.core._submit" in text, text
    assert "USR1 USR2" in text  # the batch shell notes a signal meant for the tasks instead of dying of it
