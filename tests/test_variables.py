"""The registry of HPC_DDP_* variables (hpc_ddp.variables): every one used anywhere is listed once, with its
meaning; and a job started from inside a kit job inherits none of the kit's channels."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import ROOT

from hpc_ddp import variables
from hpc_ddp.cluster.env import without_launcher
from hpc_ddp.launch.local import LocalJob, child_environ
from hpc_ddp.scheduler.slurm.request import submit_environ

# An HPC_DDP_ name on its own: not the tail of a longer identifier (SLURM_HPC_DDP_CANARY is a test's Slurm one).
NAME = re.compile(r"(?<![A-Za-z0-9_])HPC_DDP_[A-Z0-9_]*[A-Z0-9]")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): every file there is
        return [
            p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts
        ]


def names_in_the_tree() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in tracked_files():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for name in NAME.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_hpc_ddp_variable_in_the_tree_is_registered() -> None:
    found = names_in_the_tree()
    assert "HPC_DDP_BATCH" in found and "HPC_DDP_LIVE_PROGRESS" in found  # the scan sees what is there
    missing = {name: sorted(where) for name, where in found.items() if name not in variables.BY_NAME}
    assert missing == {}, f"add these to hpc_ddp/variables.py, with their meaning: {missing}"


def test_each_variable_is_listed_once_with_its_meaning() -> None:
    names = [v.name for v in variables.VARIABLES]
    assert len(names) == len(set(names))
    for v in variables.VARIABLES:
        assert v.kind in ("user", "channel", "test") and len(v.meaning) > 20, v
        assert NAME.fullmatch(v.name), v
    assert variables.CHANNELS == {
        "HPC_DDP_BATCH",
        "HPC_DDP_FOLDER_FILE",
        "HPC_DDP_FOLDER_LOCK",
        "HPC_DDP_LIVE_PROGRESS",
        "HPC_DDP_IN_PLACE",
        "HPC_DDP_STEP_ARGS",
        "HPC_DDP_LOCAL_JOB_ID",
    }


def test_no_registered_variable_is_stale() -> None:
    found = names_in_the_tree()
    stale = [v.name for v in variables.VARIABLES if set(found.get(v.name, ())) <= {"hpc_ddp/variables.py"}]
    assert stale == []


# A kit job's task: what slurm/ddp.sbatch and the local launcher leave in the environment of what runs inside.
INSIDE_A_KIT_JOB = {
    "HPC_DDP_BATCH": "1",
    "HPC_DDP_FOLDER_FILE": "/tmp/hpc_ddp-12.abc",
    "HPC_DDP_FOLDER_LOCK": "0123abcd",
    "HPC_DDP_LIVE_PROGRESS": "1",
    "HPC_DDP_SAVE_BACKOFF_S": "2",  # a user's setting: it stays
    "SLURM_JOB_ID": "12",
    "PATH": "/usr/bin",
}


def test_a_job_submitted_from_inside_a_kit_job_inherits_no_channel() -> None:
    """Before: HPC_DDP_BATCH=1 reached the inner job, whose tasks then never requeued themselves."""
    env = submit_environ(INSIDE_A_KIT_JOB)
    assert not variables.CHANNELS & set(env), env
    assert env == {"HPC_DDP_SAVE_BACKOFF_S": "2", "PATH": "/usr/bin"}
    assert without_launcher(INSIDE_A_KIT_JOB) == env


def test_a_local_run_started_from_inside_a_kit_job_gives_its_ranks_only_its_own_channels() -> None:
    job = LocalJob(
        nodes=1,
        tasks_per_node=2,
        folder=Path("."),
        train_argv=[],
        max_requeue=0,
        checkpoint_storage="local",
        job_id="77",
    )
    env = child_environ(dict(INSIDE_A_KIT_JOB), job, 1, 0)
    assert not variables.CHANNELS & set(env), sorted(variables.CHANNELS & set(env))
    assert env["SLURM_JOB_ID"] == "77" and env["HPC_DDP_SAVE_BACKOFF_S"] == "2"
    mine = LocalJob(**{**job.__dict__, "extra_env": {variables.LIVE_PROGRESS: "0"}})
    assert child_environ(dict(INSIDE_A_KIT_JOB), mine, 1, 0)[variables.LIVE_PROGRESS] == "0"
