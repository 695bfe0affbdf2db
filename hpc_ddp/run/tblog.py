"""`--tensorboard`: rank 0 writes the run's scalars to `<folder>/tb/`, one curve per tag across every start.

The x axis is the optimizer step. A run that restarts (requeue, preemption, a crash and a rerun) resumes from
its last checkpoint, and after a crash it trains again the steps between that checkpoint and the crash, which
the files may already hold. TensorBoard's `purge_step` only hides such duplicates in its UI (they stay in the
files, for every other reader), so a step is never written twice instead: at start, the highest step already
in the files is found, and nothing at or below it is written.

Finding it is cheap: a start that ends cleanly (finished, preempted, stopped by an error it could report)
records in `tb/logged.json` the highest step written and the event files it covers, after flushing them. A
start that was killed outright (SIGKILL, a lost node) left its file out of that record, and only such files
are read back, with TensorBoard's own reader (a record cut by the kill is skipped by it).

The package is optional (`pip install 'hpc-ddp[tensorboard]'`); `missing()` is what every entry point checks,
before torch or the process group, so that its absence is a usage error at once (exit 2).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.run.sinks.base import Sink

RECORD = "logged.json"
FLUSH_S = 10  # how often the writer's thread makes the events readable by a TensorBoard watching the folder
INSTALL = "pip install 'hpc-ddp[tensorboard]' (or: pip install tensorboard)"


def missing() -> str | None:
    """Why --tensorboard cannot work in this Python (the fix included), or None when it can."""
    try:
        import tensorboard  # noqa: F401  (a light import: the package loads its parts lazily)
    except ImportError as e:
        return (
            f"--tensorboard needs the tensorboard package, which this Python cannot import ({e}). Fix: "
            f"{INSTALL}, or drop --tensorboard"
        )
    return None


def steps_in(path: Path) -> int:
    """The highest step of any event in one event file (-1 for none); a record cut by a kill ends it."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    highest = -1
    for event in EventFileLoader(str(path)).Load():
        if event.HasField("summary"):
            highest = max(highest, event.step)
    return highest


def _read_record(directory: Path) -> tuple[int, list[str]]:
    try:
        record = json.loads((directory / RECORD).read_text())
        return int(record["max_step"]), [str(name) for name in record["files"]]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or damaged: read every file back
        return -1, []


class Board(Sink):
    """Rank 0's TensorBoard writer for one start of the run: a sink of every step's scalars (run/sinks)."""

    name = "TensorBoard"

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        from hpc_ddp.run.folder import TENSORBOARD, atomic_write_bytes

        self._atomic = atomic_write_bytes
        self.directory = folder / TENSORBOARD
        self.directory.mkdir(exist_ok=True)
        highest, covered = _read_record(self.directory)
        files = sorted(p.name for p in self.directory.glob("events.out.tfevents.*"))
        for name in files:
            if name not in covered:  # a start killed before it could record its file
                highest = max(highest, steps_in(self.directory / name))
        self.covered = files
        self.after = highest  # steps up to here are in the files already: never written again
        self.last = highest
        suffix = f".{uuid.uuid4().hex[:8]}"
        self.writer = SummaryWriter(log_dir=str(self.directory), flush_secs=FLUSH_S, filename_suffix=suffix)
        self.own = [p.name for p in self.directory.glob(f"events.out.tfevents.*{suffix}")]

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write `values` at `step` unless an earlier start wrote that step already (values that are None or
        not finite are left out)."""
        if step <= self.after or self.writer is None:
            return
        for tag, value in values.items():
            if value is not None and value == value and abs(value) != float("inf"):
                self.writer.add_scalar(tag, value, step)
        self.last = max(self.last, step)

    def close(self) -> None:
        """Flush and close the event file, then record it as covered (see the module docstring). Idempotent."""
        writer, self.writer = self.writer, None
        if writer is None:
            return
        writer.flush()
        writer.close()
        record = {"max_step": self.last, "files": sorted(set(self.covered + self.own))}
        self._atomic(self.directory / RECORD, (json.dumps(record) + "\n").encode())
