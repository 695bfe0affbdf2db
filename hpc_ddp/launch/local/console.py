"""The local launcher's console pumping: the ranks' pipes drained to their logs, and the one terminal.

A rank blocks in print() once its pipe to the launcher is full, and its peers then wait for it in the next
collective until the timeout blames the wrong rank. So each rank's pipe is drained to its end whatever happens
to the copies (`RankOutput`): a log file that cannot be written (full disk) is reported once and dropped, and
the console is written by its own thread from a bounded queue (`Console`), so a console that stalls (Ctrl-S,
`| less`) or is gone (`| head`, a dead ssh session, a launcher started with its stdout closed) costs console
lines, never training.
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from hpc_ddp.ledger import files, judge
from hpc_ddp.log import TracebackFold
from hpc_ddp.run.records import progress

# Characters queued for the console at most; beyond, lines are dropped (not from the logs).
CONSOLE_BACKLOG = 16 << 20
# At exit, give up on a console that took nothing for this long (the ranks are all gone by then).
CONSOLE_STALL_S = 30.0
TAIL_LINES = 15


class Console:
    """The launcher's terminal, which must never hold up a rank, nor the launcher's supervision.

    The readers that drain the ranks' pipes only queue lines here; one writer thread alone talks to the
    terminal. A console that stalls (Ctrl-S, `| less` nobody scrolls) lets the queue grow to CONSOLE_BACKLOG
    characters and then drops lines, and says how many once it catches up; all of them are in the per-rank logs.
    A console that is gone (`| head` exited: BrokenPipeError; a closed terminal: EIO; any OSError) is marked
    gone and nothing more is said there; its file descriptor is pointed at /dev/null, the Python docs'
    recipe for SIGPIPE, so that no later print() and no flush at interpreter exit fails on it either.

    On a terminal it also holds rank 0's live progress line (`live`), at the bottom: only the newest one is
    kept (no backlog), every other line erases it first, and it is drawn again after them.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        # None: the launcher was started with that stream closed (`>&-`), where Python's sys.stdout is None.
        self.gone = stream is None
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self._queue: deque[str] = deque()
        self._queued = 0  # characters in the queue
        self._dropped = 0
        self._busy = False  # the writer holds a batch it has not finished writing
        self._progress = time.monotonic()  # last time the console took some output
        self._cond = threading.Condition()
        self._live = ""  # rank 0's live line ("" : none)
        self._live_changed = False
        self._shown = False  # (writer thread) a live line is on the terminal, the cursor at its end
        self._fd: int | None = None
        self.tty = False
        if stream is not None:
            try:
                self._fd = stream.fileno()
            except (
                AttributeError,
                OSError,
                ValueError,
            ):  # io.UnsupportedOperation is both; no fd (a StringIO)
                self._fd = None
            try:
                self.tty = stream.isatty()
            except (AttributeError, OSError, ValueError):
                self.tty = False
            try:
                stream.flush()  # what was printed before us goes first
            except (AttributeError, OSError, ValueError):
                self._mark_gone()
        self._writer = threading.Thread(target=self._write_loop, name="console", daemon=True)
        self._writer.start()

    def line(self, text: str) -> None:
        """Queue one line; never blocks, never raises."""
        with self._cond:
            if self.gone:
                return
            if self._queued + len(text) >= CONSOLE_BACKLOG:
                self._dropped += 1
                return
            self._queue.append(text + "\n")
            self._queued += len(text) + 1
            self._cond.notify()

    def live(self, text: str) -> None:
        """Show `text` as the live line ("" erases it); only on a terminal. Never blocks, never raises."""
        with self._cond:
            if self.gone or not self.tty or text == self._live:
                return
            self._live, self._live_changed = text, True
            self._cond.notify()

    def drain(self, stall_s: float = CONSOLE_STALL_S) -> None:
        """Wait until everything queued was written, the console is gone, or it took nothing for `stall_s`."""
        began = time.monotonic()
        with self._cond:
            while (self._queue or self._live_changed or self._busy) and not self.gone:
                if time.monotonic() - max(self._progress, began) > stall_s:
                    return  # a console nobody reads: the run is over, its lines are in the logs
                self._cond.wait(timeout=0.1)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._live_changed and not self.gone:
                    self._cond.wait()
                if self.gone:
                    return
                batch, dropped = "".join(self._queue), self._dropped
                live, self._live_changed = self._live, False
                self._queue.clear()
                self._queued, self._dropped, self._busy = 0, 0, True
            if dropped:
                batch += (
                    f"[launcher] the console fell behind: {dropped} lines were not shown here (they are all "
                    "in the per-rank logs)\n"
                )
            # The live line stays at the bottom: erased before the lines, drawn again after them.
            ok = self._emit((progress.LIVE if self._shown else "") + batch + live)
            self._shown = ok and bool(live)
            with self._cond:
                self._busy = False
                if not ok:
                    self._mark_gone()
                self._cond.notify_all()

    def _emit(self, text: str) -> bool:
        """Write all of `text`; False once the console is gone (or anything else went wrong: then it is too)."""
        try:
            if self._fd is None:
                assert self.stream is not None  # a console without one is gone from the start
                self.stream.write(text)
                self.stream.flush()
                return True
            # Straight to the fd, not through the stream: a write blocked on a stalled console then holds no
            # lock of sys.stdout's, so the interpreter's own flush at exit cannot wait on it.
            data = memoryview(text.encode(self.encoding, "replace"))
            while data:
                try:
                    n = os.write(self._fd, data[:65536])
                except BlockingIOError:  # a terminal or pipe someone left non-blocking: wait until writable
                    select.select([], [self._fd], [], 1.0)
                    continue
                data = data[n:]
                with self._cond:
                    self._progress = time.monotonic()
            return True
        except Exception:  # OSError: BrokenPipeError, EIO, ENOSPC...; ValueError: a closed stream
            return False

    def _mark_gone(self) -> None:
        # Called with self._cond held (or before the writer exists).
        self.gone = True
        self._queue.clear()
        self._queued = 0
        if self._fd is not None:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._fd)
                os.close(devnull)
            except OSError:
                pass


def consequence(line: str) -> str | None:
    """The part of a rank's output line that says it failed only because another rank ended first (gloo's
    "Connection closed by peer ... GLHF!", NCCL's "remote process exited", a reset connection: the patterns of
    hpc_ddp.ledger.judge.SECONDARY), as it was written; None for any other line."""
    low = line.lower()
    for pattern in judge.SECONDARY:
        at = low.find(pattern)
        if at >= 0:
            return line[at : at + len(pattern)].rstrip(" (")
    return None


def stopped_by(line: str, by: str) -> str:
    """Rank 0's line about a stop, as the console shows it when the launcher turned the user's signal into the
    ranks' SIGTERM (`by`: "interrupted (Ctrl-C)"): the rank names the SIGTERM it got, the user the key they
    pressed. Its log keeps the rank's own words."""
    head = "SIGTERM: "
    if not by or not line.startswith(head):
        return line
    return f"{by}: {line[len(head) :].replace('stopped by SIGTERM: ', '')}"


class RankOutput:
    """One child process, its log file and the tail of its output.

    The console gets rank 0's lines (every rank's with `show_all`) and the other ranks' warnings. A rank that
    fails only because another ended first (`consequence`) would say so before the launcher names the first
    cause: from that line on, its console lines are held (`held`) for the launcher, which shows one line for
    them after the first cause (Launcher._show_consequences); everything is in the log as it came."""

    def __init__(
        self,
        rank: int,
        proc: subprocess.Popen[bytes],
        log_path: Path,
        console: Console,
        show_all: bool,
        stop_by: Callable[[], str] = lambda: "",
    ) -> None:
        self.rank, self.proc, self.log_path = rank, proc, log_path
        self.console, self.show_all = console, show_all
        self.stop_by = stop_by  # what stopped the run, in the user's words ("" : not a signal the user sent)
        self.log_lost = False
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.consequence = ""  # the secondary error this rank failed with, as written ("" : none)
        self.held: list[str] = []  # console lines from that error on, not shown (yet)
        self.folded = TracebackFold(str(log_path))
        self.reader = threading.Thread(target=self._pump, name=f"rank{rank}-reader", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        # The rank blocks in print() as soon as its pipe is full, and its peers then wait for it in the next
        # collective: whatever fails while copying a line, the pipe is read to its end (the rank's exit).
        assert self.proc.stdout is not None
        try:
            self._copy()
        except Exception as e:  # a bug in the copying: say it once, then only drain
            self.console.line(
                f"[launcher] rank {self.rank}'s output: copying stopped ({type(e).__name__}: {e}); "
                f"the rest is not saved in {self.log_path} nor shown"
            )
        finally:
            try:
                while self.proc.stdout.read(65536):
                    pass
            except (OSError, ValueError):
                pass

    def release(self) -> list[str]:
        """The held console lines, once (the launcher shows them, or one line for them)."""
        held, self.held = self.held, []
        return held

    def _copy(self) -> None:
        # The console shows rank 0's lines and the other ranks' warnings (hpc_ddp.log's `warn`); with
        # --all-ranks every rank's. Everything, C++ warnings and tracebacks included, goes to the log file.
        prefix = "" if self.rank == 0 else f"[rank {self.rank}] "
        assert self.proc.stdout is not None
        log: _Log | None = None
        try:
            log = _Log(self.log_path, self.console.line, self.rank)
        except OSError as e:
            self._log_lost(e)
        try:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if self.rank == 0 and line.startswith(progress.LIVE):
                    # Rank 0's live progress line (hpc_ddp.run.records.metrics): in place on the console; the log gets
                    # rank 0's plain periodic lines instead.
                    self.console.live(line[len(progress.LIVE) :])
                    continue
                self.tail.append(line)
                if log is not None:
                    try:
                        log.write(line + "\n")
                    except OSError as e:
                        if log.full_since is None:
                            self._log_lost(e)
                        else:  # said when it filled up
                            self.log_lost = True
                            self.console.line(
                                f"[launcher] rank {self.rank}'s log {self.log_path}: the disk stayed full for "
                                f"{files.window_s():g} s; its lines are dropped from that file from here on"
                            )
                        log.close()
                        log = None
                shown = self.folded.feed(line)
                if shown is None:
                    continue
                if not self.consequence:
                    self.consequence = consequence(shown) or ""
                if not (self.rank == 0 or self.show_all or shown.startswith(prefix + "warning: ")):
                    continue
                shown = stopped_by(shown, self.stop_by()) if self.rank == 0 else shown
                shown = shown if shown.startswith(prefix) else prefix + shown
                if self.consequence:
                    self.held.append(shown)
                else:
                    self.console.line(shown)
        finally:
            if log is not None:
                log.close()
            if self.rank == 0:
                self.console.live("")  # rank 0 is gone: its live line with it

    def _log_lost(self, error: OSError) -> None:
        # Once: a full disk would otherwise repeat this for every line. Training goes on; the log is the only loss.
        self.log_lost = True
        self.console.line(
            f"[launcher] rank {self.rank}'s log {self.log_path}: cannot write "
            f"({error.strerror or error}); its lines are dropped from that file from here on. "
            "Training goes on, and the console and a failure report still get them as before"
        )


class _Log:
    """A rank's log file, written line by line. A full disk (or quota) loses nothing for the retry window
    (hpc_ddp.ledger.files.window_s): the lines are held in memory, in order, tried again every half second and
    written once there is space; `write` raises only for any other error, or once the disk has been full for
    the whole window (or the held lines pass HELD_MAX), and `close` says how many were never written."""

    HELD_MAX = 16 << 20
    RETRY_S = 0.5

    def __init__(self, path: Path, say: Callable[[str], None], rank: int) -> None:
        self.path, self.say, self.rank = path, say, rank
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
        self.held = bytearray()
        self.full_since: float | None = None
        self.tried = 0.0

    def write(self, text: str) -> None:
        self.held += text.encode("utf-8", "replace")
        now = time.monotonic()
        if (
            self.full_since is not None
            and now - self.tried < self.RETRY_S
            and len(self.held) <= self.HELD_MAX
        ):
            return
        self.tried = now
        try:
            self._write_held()
        except OSError as e:
            full = files.is_full(e) and len(self.held) <= self.HELD_MAX
            if not full or (self.full_since is not None and now - self.full_since >= files.window_s()):
                self.held.clear()
                raise
            if self.full_since is None:
                self.full_since = now
                self.say(
                    f"[launcher] rank {self.rank}'s log {self.path}: cannot write ({e.strerror or e}); its lines "
                    f"are held here and written once there is space (dropped if the disk stays full for "
                    f"{files.window_s():g} s). Training goes on, and the console and a failure report still get "
                    "them as before"
                )
            return
        if self.full_since is not None:
            self.say(
                f"[launcher] rank {self.rank}'s log {self.path}: written again after "
                f"{now - self.full_since:.0f} s; no line was lost"
            )
            self.full_since = None

    def _write_held(self) -> None:
        view = memoryview(self.held)
        done = 0
        try:
            while done < len(view):
                written = self.file.write(view[done:])
                if not written:
                    raise OSError(f"{self.path}: nothing written")
                done += written
        finally:
            view.release()
            del self.held[:done]

    def close(self) -> None:
        if self.held:
            try:
                self._write_held()
            except OSError:
                pass
        if self.held:
            lines = self.held.count(b"\n")
            self.say(
                f"[launcher] rank {self.rank}'s log {self.path}: {lines} line(s) never written (the disk was "
                "still full when the rank ended)"
            )
            self.held.clear()
        try:
            self.file.close()
        except OSError:
            pass


def _close_quietly(log: TextIO | None) -> None:
    # close() flushes first; on a full disk that fails again, but the file is closed all the same.
    if log is not None:
        try:
            log.close()
        except OSError:
            pass
