"""`<folder>/step.json`: the last step rank 0 finished, and when, for the supervisor that ends an attempt.

metrics.jsonl has a "step" record for every step of a short run but not of a long one, and an attempt may die
between two of them: by an error, a hang, a kill or a lost node. Its supervisor (the local launcher, the Slurm
batch shell) must still know the step it reached, or the steps it lost after its last checkpoint are
undercounted. So rank 0 rewrites one fixed-width line in place after every step, through a shared mapping of
the file: a copy into memory, no system call (a `pwrite` per step took 50 us on a VM's disk, issue 41). The
file never grows; the page is the file's, so a reader sees the line at once and a killed process leaves it
there (a lost node loses it, as it would an unsynced write). A reader that catches the line being rewritten
reads again. Only the current attempt's
step is there; metrics.jsonl keeps the history. No torch: the supervisors import this.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

from hpc_ddp.run.folder import METRICS, REACHED
from hpc_ddp.run.records.metrics_read import iter_records

WIDTH = 64  # bytes of the line, padded with spaces


class StepFile:
    """Rank 0's writer of step.json: `reach(step)` after each step, `close()` at the end. Advisory: an error
    writing it never stops a run (the supervisor then falls back to metrics.jsonl)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / REACHED
        self.map: mmap.mmap | None = None
        self.failed = False

    def reach(self, step: int) -> None:
        text = f'{{"step": {int(step)}, "time": {time.time():.3f}}}'  # JSON, formatted by hand: every step
        if self.map is None:
            if self.failed:
                return
            try:
                self.map = _mapped(self.path)
            except (OSError, ValueError):  # advisory: the supervisors fall back to metrics.jsonl
                self.failed = True
                return
        self.map[:WIDTH] = (text.ljust(WIDTH - 1) + "\n").encode()

    def close(self) -> None:
        m, self.map = self.map, None
        if m is not None:
            m.close()


def _mapped(path: Path) -> mmap.mmap:
    """step.json, WIDTH bytes long, mapped shared (its writes are the file's)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, WIDTH)
        return mmap.mmap(fd, WIDTH, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file


def read(folder: Path) -> tuple[int, float] | None:
    """step.json's (step, time); None if there is none readable (none yet, or caught being rewritten twice)."""
    for _ in range(2):  # a line caught half rewritten (a copy into the mapping) is read again
        try:
            record = json.loads((Path(folder) / REACHED).read_bytes())
            step, at = record["step"], record["time"]
            break
        except OSError:
            return None
        except (ValueError, TypeError, KeyError):
            continue
    else:
        return None
    if isinstance(step, int) and not isinstance(step, bool) and isinstance(at, (int, float)):
        return step, float(at)
    return None


def step_reached(folder: Path, since: float) -> int | None:
    """The last step rank 0 finished at or after `since` (epoch seconds): where the attempt that began then got
    to. From step.json; in a folder without one (an older version's), the last step of metrics.jsonl's
    records since then."""
    reached = read(folder)
    if reached is not None and reached[1] >= since:
        return reached[0]
    steps = [
        r["step"]
        for r in iter_records(Path(folder) / METRICS)
        if isinstance(r.get("step"), int) and isinstance(r.get("time"), (int, float)) and r["time"] >= since
    ]
    return max(steps, default=None)


def last_seen(folder: Path, since: float) -> float | None:
    """When rank 0 of the attempt that began at `since` was last seen at work: its last step (step.json), else
    its last record in metrics.jsonl; None without either. What a supervisor that closes an attempt after
    the fact (its batch shell died) takes for its end, rather than the moment it looks."""
    reached = read(folder)
    times = [reached[1]] if reached is not None and reached[1] >= since else []
    times += [
        float(r["time"])
        for r in iter_records(Path(folder) / METRICS)
        if isinstance(r.get("time"), (int, float)) and r["time"] >= since
    ]
    return max(times, default=None)
