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

A full disk (or quota) loses no point for the retry window (hpc_ddp.ledger.files.window_s): the writer flushes
every FLUSH_S, and the values since its last flush are held; when a write fails on a full disk, that event file
is left as it is (its last record may be cut, which TensorBoard's reader skips), and once there is space a new
one (tried every second) gets the held values past the highest step the old file holds whole. A disk full for
longer drops TensorBoard for the rest of the start, with one warning (run/sinks), as any failing sink.

The package is optional (`pip install 'hpc-ddp[tensorboard]'`); `missing()` is what every entry point checks,
before torch or the process group, so that its absence is a usage error at once (exit 2).
"""

from __future__ import annotations

import contextlib
import errno
import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.ledger import files
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


def _quiet_full_writer_threads() -> None:
    """TensorBoard's writer thread re-raises its write error, so Python prints its traceback; a full disk is the
    board's to handle (it says so through the sinks), so that one traceback is left out of the rank's log."""
    import threading

    hook = threading.excepthook
    if getattr(hook, "hpc_ddp_board", False):
        return

    def quiet(args: threading.ExceptHookArgs) -> None:
        thread = type(args.thread).__name__ if args.thread is not None else ""
        if thread == "_AsyncWriterThread" and args.exc_value is not None and files.is_full(args.exc_value):
            return
        hook(args)

    quiet.hpc_ddp_board = True  # type: ignore[attr-defined]
    threading.excepthook = quiet


class Board(Sink):
    """Rank 0's TensorBoard writer for one start of the run: a sink of every step's scalars (run/sinks)."""

    name = "TensorBoard"

    def __init__(self, folder: Path) -> None:
        from hpc_ddp.run.folder import TENSORBOARD, atomic_write_bytes

        self._atomic = atomic_write_bytes
        self.directory = folder / TENSORBOARD
        self.directory.mkdir(exist_ok=True)
        highest, covered = _read_record(self.directory)
        found = sorted(p.name for p in self.directory.glob("events.out.tfevents.*"))
        for name in found:
            if name not in covered:  # a start killed before it could record its file
                highest = max(highest, steps_in(self.directory / name))
        self.covered = found
        self.after = highest  # steps up to here are in the files already: never written again
        self.last = highest
        self.suffix = f".{uuid.uuid4().hex[:8]}"  # every event file of this start ends with it
        self.held: list[tuple[int, list[tuple[str, float]]]] = []  # values since the last flush, by step
        self.flushed = time.monotonic()
        self.full_since: float | None = None  # a full disk broke the writer: a new one is tried
        self.tried = 0.0
        self.writer: Any = None
        self._open()

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_full_writer_threads()
        self.writer = SummaryWriter(
            log_dir=str(self.directory), flush_secs=FLUSH_S, filename_suffix=self.suffix
        )

    @property
    def own(self) -> list[str]:
        return sorted(p.name for p in self.directory.glob(f"events.out.tfevents.*{self.suffix}"))

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write `values` at `step` unless an earlier start wrote that step already (values that are None or
        not finite are left out)."""
        if step <= self.after:
            return
        kept = [
            (tag, value)
            for tag, value in values.items()
            if value is not None and value == value and abs(value) != float("inf")
        ]
        self.held.append((step, kept))
        self.last = max(self.last, step)
        try:
            if self.full_since is not None:
                self._reopen()
            elif self.writer is not None:
                for tag, value in kept:
                    self.writer.add_scalar(tag, value, step)
                if time.monotonic() - self.flushed >= FLUSH_S:
                    self._flush()
        except OSError as e:
            self._broken(e)

    def _flush(self) -> None:
        self.writer.flush()
        self.held.clear()
        self.flushed = time.monotonic()

    def _broken(self, error: OSError) -> None:
        """A write failed: on a full disk, leave that file and hold the values (OSError after the window)."""
        now = time.monotonic()
        if not files.is_full(error) or (
            self.full_since is not None and now - self.full_since >= files.window_s()
        ):
            raise error
        if self.writer is not None:
            with contextlib.suppress(Exception):  # it failed already: its thread is gone, its file cut
                self.writer.close()
            self.writer = None
        if self.full_since is None:
            self.full_since = now
        self.tried = now

    def _reopen(self, now: bool = False) -> None:
        """Once a second while the disk is full (`now`: at once): a new event file with the held values the old
        ones lack. OSError while the disk is still full."""
        from hpc_ddp.run.folder import write_test

        if not now and time.monotonic() - self.tried < 1.0:
            return
        self.tried = time.monotonic()
        still = write_test(
            self.directory, f".space-probe{self.suffix}"
        )  # no writer (file, thread) for nothing
        if still:
            raise OSError(errno.ENOSPC, still, str(self.directory))
        done = max((steps_in(self.directory / name) for name in self.own), default=-1)
        self.held = [(step, kept) for step, kept in self.held if step > done]
        self._open()
        for step, kept in self.held:
            for tag, value in kept:
                self.writer.add_scalar(tag, value, step)
        self._flush()
        self.full_since = None

    def close(self) -> None:
        """Flush and close the event file, then record it as covered (see the module docstring). Idempotent."""
        if self.writer is None and self.full_since is None:
            return
        if self.full_since is not None:  # what the full disk held: waited out for the retry window
            files.patiently(lambda: self._reopen(now=True), str(self.directory))
        writer, self.writer = self.writer, None
        self.full_since = None
        writer.flush()
        writer.close()
        record = {"max_step": self.last, "files": sorted(set(self.covered + self.own))}
        self._atomic(self.directory / RECORD, (json.dumps(record) + "\n").encode())
