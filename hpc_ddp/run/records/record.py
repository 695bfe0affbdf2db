"""`run.json`: what ran, with which settings and versions, so a result can be traced to its code.

Written by global rank 0 at every start that really trains, once every check has passed (a start refused
for any reason, or a rerun of a finished run, writes nothing). A restart appends its start time to `starts`;
a start with another command, config, code or versions keeps the record it replaces in `earlier`, oldest
first, so that the file describes the run as it is now and every way it was started before.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp import proc, scheduler
from hpc_ddp.run.folder import RUN_RECORD, atomic_write_bytes


def _command_output(argv: list[str], cwd: str | None = None) -> str | None:
    """What a version query printed, or None: run.json records what it can find and nothing else."""
    out = proc.run(argv, timeout_s=5, cwd=cwd)
    return (out.stdout.strip() or None) if out.ok else None


def scheduler_version() -> str | None:
    """The cluster scheduler's version on this machine (the registry's default, Slurm: "22.05.8", run.json's
    "slurm"), or None: recorded whoever started the run."""
    return scheduler.default().version()


def git_commit(cwd: str) -> str | None:
    """The user's code version: HEAD of the git repository the run was started from, '+dirty' if modified."""
    head = _command_output(["git", "rev-parse", "HEAD"], cwd=cwd)
    if head is None:
        return None
    dirty = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd)
    return head + ("+dirty" if dirty else "")


_DESCRIBES = ("command", "cwd", "config", "dist", "versions", "git_commit")  # a start that differs: kept


def read_config(folder: Path) -> dict[str, Any] | None:
    """The config the run in `folder` last started with (run.json), or None when there is none to read."""
    try:
        loaded = json.loads((folder / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    config = loaded.get("config") if isinstance(loaded, dict) else None
    return config if isinstance(config, dict) else None


def write(
    folder: Path, config: dict[str, Any], env: dict[str, Any], cwd: str, not_exact: list[str] | None = None
) -> None:
    """run.json for this start. `not_exact`: why this run cannot resume bit for bit (hpc_ddp.run.checkpoint.exact):
    `"exact"` says whether it can, `"not_exact"` lists why not."""
    import torch

    from hpc_ddp._version import __version__

    path = folder / RUN_RECORD
    old: dict[str, Any] = {}
    if path.is_file():
        try:
            loaded = json.loads(path.read_text())
            old = loaded if isinstance(loaded, dict) else {}
        except (ValueError, OSError):
            old = {}
    starts = list(old.get("starts", []))
    earlier = list(old.get("earlier", []))
    info: dict[str, Any] = {
        "command": [sys.executable, *sys.argv],
        "cwd": cwd,
        "config": config,
        "dist": env,
        "versions": {
            "hpc_ddp": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "slurm": scheduler_version(),
        },
        "git_commit": git_commit(cwd),
        "exact": not not_exact,
        **({"not_exact": list(not_exact)} if not_exact else {}),
        "starts": starts + [round(time.time(), 3)],
    }
    previous = {k: v for k, v in old.items() if k not in ("starts", "earlier")}
    if previous and any(
        json.dumps(previous.get(k), default=str) != json.dumps(info[k], default=str) for k in _DESCRIBES
    ):
        earlier.append({**previous, "starts": starts})
    if earlier:
        info["earlier"] = earlier
    atomic_write_bytes(path, (json.dumps(info, indent=2, default=str) + "\n").encode())
