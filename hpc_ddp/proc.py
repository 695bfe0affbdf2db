"""Run a short command (sacct, scontrol, nvidia-smi, git) and get its output or why there is none.

The kit asks other programs small questions all the time, and none of them may hang a task or crash it:
a missing program, a timeout, or a non-zero exit all come back as an error text the caller can print or
ignore, never as an exception.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Output:
    """What a command printed, and "" for `error` when it ran and exited 0 (else why it did not)."""

    stdout: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def run(argv: Sequence[str], timeout_s: float = 60.0, cwd: str | None = None) -> Output:
    """Run `argv` with its output captured, for at most `timeout_s` seconds."""
    if shutil.which(argv[0]) is None:
        return Output("", f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, cwd=cwd, check=False
        )
    except subprocess.TimeoutExpired:
        return Output("", f"`{' '.join(argv)}` did not answer within {timeout_s:g} s")
    except OSError as e:
        return Output("", str(e))
    if proc.returncode != 0:
        return Output(proc.stdout, proc.stderr.strip() or f"exit code {proc.returncode}")
    return Output(proc.stdout)
