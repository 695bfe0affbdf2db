"""`run.json`: what ran, with which settings and versions, so a result can be traced to its code.

Written by global rank 0 at every start (a restart appends its start time to `starts`).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp import proc
from hpc_ddp.run.folder import RUN_RECORD, atomic_write_bytes


def _command_output(argv: list[str], cwd: str | None = None) -> str | None:
    """What a version query printed, or None: run.json records what it can find and nothing else."""
    out = proc.run(argv, timeout_s=5, cwd=cwd)
    return (out.stdout.strip() or None) if out.ok else None


def slurm_version() -> str | None:
    out = _command_output(["scontrol", "--version"])  # "slurm 22.05.8"
    return out.split()[-1] if out else None


def git_commit(cwd: str) -> str | None:
    """The user's code version: HEAD of the git repository the run was started from, '+dirty' if modified."""
    head = _command_output(["git", "rev-parse", "HEAD"], cwd=cwd)
    if head is None:
        return None
    dirty = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd)
    return head + ("+dirty" if dirty else "")


def write(folder: Path, config: dict[str, Any], env: dict[str, Any], cwd: str) -> None:
    import torch

    from hpc_ddp._version import __version__

    path = folder / RUN_RECORD
    starts: list[float] = []
    if path.is_file():
        try:
            starts = list(json.loads(path.read_text()).get("starts", []))
        except (ValueError, OSError):
            starts = []
    info = {
        "command": [sys.executable, *sys.argv],
        "cwd": cwd,
        "config": config,
        "dist": env,
        "versions": {"hpc_ddp": __version__, "torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda, "slurm": slurm_version()},
        "git_commit": git_commit(cwd),
        "starts": starts + [round(time.time(), 3)],
    }
    atomic_write_bytes(path, (json.dumps(info, indent=2, default=str) + "\n").encode())
