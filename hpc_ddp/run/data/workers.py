"""DataLoader workers: what they do at start (`init`), and how a hang diagnosis reads their stacks (`stacks`).

A rank stuck in data loading with `--num-workers > 0` waits in its main thread for a worker: the user line that
hangs (`__getitem__`, a file open, a decoder) is in the worker's stack, not the rank's. So every worker, at
start, asks faulthandler to dump its stacks on STACK_SIGNAL into a file of its own (opened, then unlinked at once:
nothing is left behind, whatever way the worker ends); when the hang watchdog diagnoses, it signals its workers
and reads those files through /proc/<pid>/fd (Linux). faulthandler writes from a C signal handler: a worker stuck
in native code holding the GIL still answers.

STACK_SIGNAL is a real-time signal, never one of the preemption signals (USR1, USR2, TERM), and only workers
that registered it (their file is there) are ever sent it: its default action would end any other process.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from hpc_ddp.run.loop import preemption

STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGURG
_TAG = "hpc_ddp-worker-stacks"
_stack_file: list[Any] = []  # the worker's open file (kept open: faulthandler writes to its descriptor)


def init(worker_id: int = 0) -> None:
    """`worker_init_fn` of the kit's loaders: ignore the preemption signals (the rank handles them; its
    workers die with it) and register the stack dump."""
    preemption.ignore(worker_id)
    try:
        fd, path = tempfile.mkstemp(prefix=f"{_TAG}-{os.getpid()}-")
        os.unlink(path)  # reachable through /proc/<pid>/fd only: nothing to clean up, ever
        stream = os.fdopen(fd, "w")
        faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=False)
        _stack_file[:] = [stream]
    except (
        OSError,
        RuntimeError,
        ValueError,
    ):  # no temp dir, no such signal: no worker stacks, still a worker
        pass


def _stack_fd(pid: int) -> Path | None:
    try:
        for entry in Path(f"/proc/{pid}/fd").iterdir():
            if _TAG in os.readlink(entry):
                return entry
    except OSError:
        return None
    return None


def stacks(pids: list[int], wait_s: float = 1.0) -> dict[int, str]:
    """The stacks of those of `pids` that are kit DataLoader workers: {pid: faulthandler's text}."""
    files = {pid: fd for pid in pids if (fd := _stack_fd(pid)) is not None}
    for pid in files:
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
    deadline = time.monotonic() + wait_s
    texts: dict[int, str] = {}
    while files and time.monotonic() < deadline:
        time.sleep(0.05)
        for pid, fd in list(files.items()):
            try:
                text = fd.read_text(errors="replace")
            except OSError:
                files.pop(pid)
                continue
            if text.rstrip().endswith(("(most recent call first):", "<no Python frame>")) or not text:
                continue  # still being written, or not yet
            texts[pid] = text
            files.pop(pid)
    return texts


def user_line(text: str, is_library: Any) -> dict[str, Any] | None:
    """The innermost frame of user code in faulthandler's text (most recent call first), as
    run/watch/watchdog.user_frame gives it: {"file", "line", "function"}."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith('File "'):
            continue
        name, _, rest = line[len('File "') :].partition('", line ')
        number, _, function = rest.partition(" in ")
        if name and number.isdigit() and not is_library(name):
            return {"file": name, "line": int(number), "function": function.strip()}
    return None
