"""Failing stand-ins for Slurm's commands, first on PATH for every test not marked `slurm`.

A test that is not about the real cluster must give the same answer on a laptop and on a Slurm login node. So
from configure time on (collection included) PATH starts with a folder holding `sinfo`, `scontrol`, `squeue`,
`sacct`, `sbatch` and `srun` stand-ins: each prints one line naming itself and exits 1. A test that needs one
of them brings its own fake earlier on PATH (it wins); a test about the real cluster is marked `slurm`, and
while it runs (setup, call, teardown) the folder is out of PATH; each test's PATH is restored after it. The
subprocesses the tests start inherit this: `conftest.clean_environ()` copies os.environ.

Loaded by tests/conftest.py (`pytest_plugins`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path

import pytest

COMMANDS = ("sinfo", "scontrol", "squeue", "sacct", "sbatch", "srun")
PREFIX = "hpc-ddp-standins-"  # the folder's name starts so
EXIT = 1

_folder: Path | None = None
_saved_path: str | None = None


def script(command: str) -> str:
    line = (
        f"{command}: a stand-in from tests/standins.py (the test is not marked slurm): a test that needs "
        f"{command} brings its own fake first on PATH, or is marked slurm to use the real cluster"
    )
    return f"#!/bin/sh\necho '{line}' >&2\nexit {EXIT}\n"


def folder() -> Path:
    """The stand-ins' folder (for tests that build a PATH of their own)."""
    if _folder is None:
        raise RuntimeError("tests/standins.py is not configured")
    return _folder


def with_standins(path: str) -> str:
    """PATH with the stand-ins' folder first (and only there)."""
    rest = without_standins(path)
    return os.pathsep.join([str(folder()), rest]) if rest else str(folder())


def without_standins(path: str) -> str:
    """PATH without the stand-ins' folder, nor one inherited from an enclosing pytest (a pytest-xdist worker's
    controller made its own before starting the worker)."""
    return os.pathsep.join(
        p for p in path.split(os.pathsep) if p and p != str(_folder) and not Path(p).name.startswith(PREFIX)
    )


def pytest_configure(config: pytest.Config) -> None:
    global _folder, _saved_path
    _folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    for command in COMMANDS:
        (_folder / command).write_text(script(command))
        (_folder / command).chmod(0o755)
    _saved_path = os.environ.get("PATH")
    os.environ["PATH"] = with_standins(_saved_path or "")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _folder
    if _folder is None:
        return
    if _saved_path is None:
        os.environ.pop("PATH", None)
    else:
        os.environ["PATH"] = _saved_path
    shutil.rmtree(_folder, ignore_errors=True)
    _folder = None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if _folder is None:
        yield
        return
    before = os.environ.get("PATH", "")
    slurm = item.get_closest_marker("slurm") is not None
    os.environ["PATH"] = without_standins(before) if slurm else with_standins(before)
    try:
        yield
    finally:
        os.environ["PATH"] = before
