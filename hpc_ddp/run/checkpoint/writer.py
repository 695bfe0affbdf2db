"""The background writer: a checkpoint is made durable off the training thread, and a failed write is retried
for as long as the README promises.

The caller snapshots the state (a copy, so training can keep changing its tensors) and hands the writer a job
that makes it durable. A write that fails with an OSError (full disk, quota, a file server hiccup) is reported
at the caller's next `check()` and retried after 1, 2, 4, 8 and 16 s (BACKOFF_VAR sets the first delay; it is
read when a writer is made, not at import). The promise is about time: the run gives up only once writes have
been failing for 1+2+4+8+16 = 31 s, whatever their number. A newer save that replaces a pending retry is one
more write, not one more retry: it does not double the next delay, nor bring the end closer.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpc_ddp.ledger import files
from hpc_ddp.variables import SAVE_BACKOFF_S, SAVE_DELAY_S

SAVE_RETRIES = (
    files.RETRIES
)  # retries of a failed checkpoint write, at 1, 2, 4, 8 and 16 s (doubling from the backoff)
BACKOFF_VAR = SAVE_BACKOFF_S  # the first delay in seconds (tests shorten it); default 1
DELAY_VAR = SAVE_DELAY_S  # every write starts this late (the resume check's save in flight); default 0

Job = Callable[[], tuple[Path, int]]  # makes one checkpoint durable; returns its path and size


def save_backoff_s(environ: Mapping[str, str] | None = None) -> float:
    """The first retry delay: $HPC_DDP_SAVE_BACKOFF_S, read now (default 1 s). The one reading of it, shared
    with every other write that waits out a full disk (hpc_ddp.ledger.files.window_s)."""
    return files.backoff_s(environ)


def save_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """$HPC_DDP_SAVE_DELAY_S, read now: how late every write starts (0: at once)."""
    text = (os.environ if environ is None else environ).get(DELAY_VAR) or ""
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0


def retriable(error: BaseException) -> bool:
    """A write error that may go away by itself: a full disk or quota, a file server's hiccup (OSError), but
    not a path that is a file where a folder must be, nor a permission denied."""
    return isinstance(error, OSError) and not isinstance(
        error, (FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
    )


def describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    return f"{type(error).__name__}: {error}"


class AsyncWriter:
    """One background thread that makes checkpoints durable while training continues.

    At most one write is in flight: `submit` first waits for the previous one, so a slow filesystem applies
    back-pressure instead of queueing copies of the model in memory.

    A failed write is not left for the next save to find: `check()`, called by the training loop every step,
    books it, says so through `warn`, and retries it on the schedule (see the module docstring) while training
    goes on. Once writes have failed for the whole schedule, or at once for an error that no retry cures,
    `check()` returns the error: the run must stop. `clock` is a seam for tests."""

    def __init__(
        self,
        warn: Callable[[str], None] | None = None,
        retries: int = SAVE_RETRIES,
        backoff_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: tuple[Path, int] | None = None
        self.warn = warn or _warn_stderr
        self.retries = retries
        self.backoff_s = save_backoff_s() if backoff_s is None else backoff_s
        self.clock = clock
        self.delay_s = save_delay_s()  # a slow file system on demand (the resume check; DELAY_VAR)
        self.failures = 0  # failed writes in the current streak (retries and newer saves alike)
        self.retried = 0  # retries of the schedule started in the current streak
        self.failing_since: float | None = None  # when the streak's first failure was booked
        self.fatal: BaseException | None = None  # saving keeps failing: whoever checks must stop
        self._job: Job | None = None  # the newest state's write, until it is durable
        self._failed: BaseException | None = None  # the last failure, while a retry of it is pending
        self._retry_at: float | None = None

    @property
    def budget_s(self) -> float:
        """How long writes may keep failing before the run stops: the sum of the retry delays."""
        return self.backoff_s * (2**self.retries - 1)

    def failing_for(self) -> float:
        """Seconds since the current streak's first failure (0 when writes succeed)."""
        return 0.0 if self.failing_since is None else self.clock() - self.failing_since

    def _start(self, job: Job) -> None:
        def run() -> None:
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                self.last = job()
            except BaseException as e:  # booked on the training thread by check() or wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="hpc_ddp-ckpt-writer", daemon=False)
        self._thread.start()

    def _start_retry(self) -> None:
        assert self._job is not None
        self._retry_at = None
        self.retried += 1
        self._start(self._job)

    def _collect(self, block: bool) -> None:
        """Book the outcome of the write in flight once it ended (with `block`, wait for it to end)."""
        thread = self._thread
        if thread is None or (not block and thread.is_alive()):
            return
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is None:
            if self.failures and self.last is not None:
                self.warn(f"checkpoint {self.last[0]} written after {self.failures} failed attempt(s)")
            self.failures, self.retried, self.failing_since = 0, 0, None
            self._job, self._failed, self._retry_at = None, None, None
            return
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        self.failures += 1
        self._failed = error
        if not retriable(error) or now - self.failing_since >= self.budget_s:
            self.fatal, self._retry_at = error, None
            return
        # The delay doubles with each retry of the streak, not with each failed write: a newer save that
        # failed too only pushes the pending retry back.
        delay = self.backoff_s * 2**self.retried
        self._retry_at = now + delay
        self.warn(
            f"a checkpoint could not be written ({describe(error)}); retry {self.retried + 1} of "
            f"{self.retries} in {delay:g} s, training goes on"
        )

    def check(self) -> BaseException | None:
        """Non-blocking, every step: book a write that ended, start a retry that is due. The error that must
        stop the run, once saving keeps failing; else None."""
        self._collect(block=False)
        if (
            self.fatal is None
            and self._retry_at is not None
            and self._job is not None
            and self._thread is None
            and self.clock() >= self._retry_at
        ):
            self._start_retry()
        return self.fatal

    def submit(self, job: Job) -> None:
        """Write in the background (after the write in flight). Once saving has failed for good nothing more
        is started: `check()` (every step) or `wait()` reports it, on every rank at the same step."""
        self._collect(block=True)
        if self.fatal is not None:
            return
        self._retry_at = None  # a failed older write is superseded: this state is newer
        self._job = job
        self._start(job)

    def wait(self, retry: bool = False) -> tuple[Path, int] | None:
        """Block until the write in flight is durable; re-raise its error, if any. With `retry`, a failed write
        is retried (sleeping until each retry is due) until it is written or the schedule is spent."""
        while True:
            self._collect(block=True)
            if self.fatal is not None:
                raise self.fatal
            if self._retry_at is None or self._job is None:
                return self.last
            if not retry:
                assert self._failed is not None
                raise self._failed
            time.sleep(max(0.0, self._retry_at - self.clock()))
            self._start_retry()


def _warn_stderr(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()
