"""The local launcher: N emulated nodes x T tasks on this machine, each task given what `srun` would give it.

Every child gets the SLURM_* variables of a real `srun --nodes N --ntasks-per-node T` step (a fresh fake job
id per run, node list `127.0.0.[1-N]`, which resolves everywhere without editing /etc/hosts, node/proc/local
ids and counts), so `hpc_ddp.cluster.env.detect` takes its Slurm path: the same code as a cluster job.

The launcher supervises like Slurm with `--kill-on-bad-exit`: when a rank exits non-zero or dies, the others
are stopped within seconds and the launcher names the failed rank and prints the end of its log. Signals:
SIGUSR1/SIGUSR2 are passed to every rank, which save at an agreed step and exit PREEMPTED; the launcher then
plays Slurm's requeue and starts them again (SLURM_RESTART_COUNT+1) while `preempted.json` says so.
Every rank is told `--requeue-by launcher` (its fake job id is no Slurm job for scontrol to requeue).
SIGINT/SIGTERM/SIGHUP are passed on too (Ctrl-C and a closed terminal as SIGTERM); the ranks save and the
launcher does not restart.
Children live in their own session (a terminal's Ctrl-C reaches only the launcher, which forwards it) and die
with the launcher even if it is SIGKILLed (PR_SET_PDEATHSIG).

A signal never kills a rank that is still starting: training ranks start with SIGUSR1/SIGUSR2/SIGTERM
blocked (inherited through exec) until `preemption.install()` has set their handlers, so a signal that comes
meanwhile waits in the kernel; and a signal the launcher receives while it (re)starts the ranks, or between
two runs of a restart, is sent again to every new rank once they all exist.

The launcher holds the run folder (`run.lock`, hpc_ddp.run.folder.hold_folder) from before it touches anything
there until its last rank is gone; its rank 0 inherits the lock. A second run in the same folder is refused.

It must never hang, whatever the ranks or the machine do, since a hung launcher holds every rank:

- A rank stops only at an agreed step, and one stuck in user code or in a collective never gets there. So a
  stop has a deadline, as under torchrun and Slurm (KillWait): a second Ctrl-C, or `stop_grace_s` after the
  first Ctrl-C/SIGTERM, SIGKILLs every rank's process group and the launcher exits 128 + signal, naming the
  ranks that did not stop.
- A rank blocks in print() once its pipe to the launcher is full, and its peers then wait for it in the next
  collective until the timeout blames the wrong rank. So each rank's pipe is drained to its end whatever
  happens to the copies: a log file that cannot be written (full disk) is reported once and dropped, and the
  console is written by its own thread from a bounded queue, so a console that stalls (Ctrl-S, `| less`)
  or is gone (`| head`, a dead ssh session) costs console lines, never training.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from hpc_ddp import exitcodes
from hpc_ddp.cluster.env import port_for_job, without_launcher
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.shape import JobShape
from hpc_ddp.log import TracebackFold
from hpc_ddp.proc import run as run_command
from hpc_ddp.run import attempts as record
from hpc_ddp.run import exits, progress, retry, watchdog
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig

GRACE_S = 3.0  # after a failure, survivors get SIGTERM, then SIGKILL after this long
STOP_GRACE_S = (
    30.0  # after Ctrl-C/SIGTERM to the launcher: time to save and exit before SIGKILL (Slurm's KillWait)
)
KILL_WAIT_S = 5.0  # how long a SIGKILLed rank may take to disappear before the launcher says so and goes on
READER_JOIN_S = (
    5.0  # after the ranks are gone, all their readers together get this long to copy the last lines
)
CONSOLE_BACKLOG = (
    16 << 20
)  # characters queued for the console at most; beyond, lines are dropped (not from logs)
CONSOLE_STALL_S = 30.0  # at exit, give up on a console that took nothing for this long (ranks are all gone)
TAIL_LINES = 15


@dataclass(frozen=True)
class LocalJob:
    nodes: int
    tasks_per_node: int
    folder: Path
    train_argv: list[str]
    max_requeue: int
    all_ranks: bool = False
    job_id: str = ""
    module: str = "hpc_ddp.train"
    extra_env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float = (
        STOP_GRACE_S  # Ctrl-C/SIGTERM: how long the ranks get to save and exit before SIGKILL
    )
    max_restarts: int = 0  # failures after which the job is not started again (--max-restarts)
    records: bool = False  # append every attempt's end to attempts.jsonl (training runs)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def nodelist(nodes: int) -> str:
    return "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"


def slurm_env(job: LocalJob, rank: int, restarts: int) -> dict[str, str]:
    """The SLURM_* variables `srun --nodes N --ntasks-per-node T` gives task `rank` (pure)."""
    node, local = divmod(rank, job.tasks_per_node)
    hosts = nodelist(job.nodes)
    per_node = f"{job.tasks_per_node}(x{job.nodes})" if job.nodes > 1 else str(job.tasks_per_node)
    env = {
        "SLURM_JOB_ID": job.job_id,
        "SLURM_JOBID": job.job_id,
        "SLURM_JOB_NAME": "hpc_ddp-local",
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_NODELIST": hosts,
        "SLURM_JOB_NUM_NODES": str(job.nodes),
        "SLURM_NNODES": str(job.nodes),
        "SLURM_NTASKS": str(job.world_size),
        "SLURM_NPROCS": str(job.world_size),
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": hosts,
        "SLURM_STEP_NUM_NODES": str(job.nodes),
        "SLURM_STEP_NUM_TASKS": str(job.world_size),
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": f"127.0.0.{node + 1}",
        "SLURM_CPUS_ON_NODE": str(os.cpu_count() or 1),
    }
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)  # unset on the first run, as in Slurm
    return env


def child_environ(base: dict[str, str], job: LocalJob, rank: int, restarts: int) -> dict[str, str]:
    """The parent's environment minus any launcher variables it carries, plus this rank's fake srun step."""
    env = without_launcher(base)
    env.update(slurm_env(job, rank, restarts))
    env.update(job.extra_env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fresh_job_id() -> str:
    """A random fake job id whose derived port is free on loopback right now."""
    for _ in range(50):
        job_id = str(random.randint(1_000_000, 9_999_999))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port_for_job(job_id)))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port found for the local run in 50 tries")


# Looked up once, here: the launcher has threads (readers, console) when it forks a rank, and a dlopen/dlsym
# between fork and exec can deadlock on a loader lock one of them held at the fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


# Signals that stop the run (save at the next agreed step, no restart), and what the ranks get for them. Ctrl-C
# and a closed terminal (SIGHUP: an ssh session that drops) become SIGTERM for the ranks, the same "save and
# stop" path as scancel; the ranks, in their own sessions, never see the terminal's signals themselves.
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_FOR_RANKS = {signal.SIGINT: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}
_HELD = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)  # blocked in a training rank until it handles them
_HOLDS_SIGNALS = ("hpc_ddp.train",)  # modules that unblock them first thing (preemption.install)


def _die_with_parent(parent: int, hold: bool = False) -> None:
    # Runs in the child between fork and exec: SIGKILL us when the launcher dies, however it dies.
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
    if hold:  # the mask survives exec: pending until preemption.install() has set the handlers
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)


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

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False
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
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both; no fd (a StringIO)
            self._fd = None
        try:
            self.tty = stream.isatty()
        except (AttributeError, OSError, ValueError):
            self.tty = False
        try:
            stream.flush()  # what was printed before us goes first
        except (OSError, ValueError):
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


class _Rank:
    """One child process, its log file and the tail of its output."""

    def __init__(
        self, rank: int, proc: subprocess.Popen[bytes], log_path: Path, console: Console, show_all: bool
    ) -> None:
        self.rank, self.proc, self.log_path = rank, proc, log_path
        self.console, self.show_all = console, show_all
        self.log_lost = False
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
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

    def _copy(self) -> None:
        # The console shows rank 0's lines and the other ranks' own messages (start, end, warnings: the
        # lines hpc_ddp.log prefixes); everything, C++ warnings and tracebacks included, goes to the log file.
        prefix = "" if self.rank == 0 else f"[rank {self.rank}] "
        assert self.proc.stdout is not None
        log: TextIO | None = None
        try:
            log = open(self.log_path, "a", encoding="utf-8")
        except OSError as e:
            self._log_lost(e)
        try:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if self.rank == 0 and line.startswith(progress.LIVE):
                    # Rank 0's live progress line (hpc_ddp.run.metrics): in place on the console; the log gets
                    # rank 0's plain periodic lines instead.
                    self.console.live(line[len(progress.LIVE) :])
                    continue
                self.tail.append(line)
                if log is not None:
                    try:
                        log.write(line + "\n")
                        log.flush()
                    except OSError as e:
                        self._log_lost(e)
                        _close_quietly(log)
                        log = None
                shown = self.folded.feed(line)
                if shown is not None and (self.rank == 0 or self.show_all or shown.startswith(prefix)):
                    self.console.line(shown if shown.startswith(prefix) else prefix + shown)
        finally:
            _close_quietly(log)
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


def _close_quietly(log: TextIO | None) -> None:
    # close() flushes first; on a full disk that fails again, but the file is closed all the same.
    if log is not None:
        try:
            log.close()
        except OSError:
            pass


_OUT_OF_TIME = (
    -1
)  # _supervise: a stop ran out of time (second Ctrl-C, or stop_grace_s after the first signal)


def _send(proc: subprocess.Popen[bytes], sig: int, group: bool = False) -> None:
    """Signal a rank (with `group`, its whole process group: its DataLoader workers and anything it started).

    Only while the launcher has not reaped it: until then its pid, and so its process-group id, cannot belong
    to anyone else. Only the main thread reaps (poll/wait), and the signal handler does not, so nothing reaps
    between this check and the kill."""
    if proc.returncode is not None:
        return
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    """Starts, supervises, signals and restarts the ranks of one local job."""

    def __init__(self, job: LocalJob, console: Console | TextIO | None = None) -> None:
        self.job = job
        self.console = console if isinstance(console, Console) else Console(console or sys.stdout)
        self.ranks: list[_Rank] = []
        self.forwarded: list[int] = []  # signals the launcher received and passed on
        self.stop_requested = False
        self.stop_signal = 0  # the first SIGINT/SIGTERM: its stop's grace period is running
        self.stop_deadline: float | None = None
        self.kill_now = False  # a Ctrl-C after the first stop signal: kill without waiting any longer
        self._announced = False
        self.started_at = 0.0  # when the ranks were last started (epoch seconds)
        self.lock_token = ""  # the run folder's lock, which the ranks' rank 0 inherits
        self.restarts = 0  # SLURM_RESTART_COUNT of the ranks now running: starts so far, minus one
        self.shown: set[str] = set()  # signatures of the errors whose traceback was shown already

    def say(self, message: str) -> None:
        self.console.line(f"[launcher] {message}")

    def _start(self, restarts: int) -> None:
        self.started_at = time.time()  # a hang verdict older than this belongs to an earlier start
        logs = self.job.folder / run_folder.LOGS
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-u", "-m", self.job.module, *self.job.train_argv]
        parent = os.getpid()
        hold = self.job.module in _HOLDS_SIGNALS
        self.ranks = []
        for rank in range(self.job.world_size):
            env = child_environ(dict(os.environ), self.job, rank, restarts)
            if self.lock_token:
                env[run_folder.LOCK_VAR] = self.lock_token
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent, hold),
            )
            self.ranks.append(_Rank(rank, proc, logs / f"rank{rank}.log", self.console, self.job.all_ranks))

    def _resend(self, since: int) -> None:
        """Send every rank the signals that came since `forwarded[since]` (while the ranks were being started,
        or between two runs of a restart): a rank started after one came never got it. Held until the rank
        handles them (see `_die_with_parent`); a rank that got one twice notes it once."""
        for signum in dict.fromkeys(self.forwarded[since:]):
            for r in self.ranks:
                _send(r.proc, _FOR_RANKS.get(signum, signum))

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Runs on the main thread between two bytecodes of whatever it was doing: only take note and pass the
        # signal on (os.kill is safe here; the console's lock and reaping children are not). The supervision
        # loop does the rest: announcing, and killing when the stop runs out of time.
        self.forwarded.append(signum)
        if signum in _STOPS:
            self.stop_requested = True
            if not self.stop_signal:
                self.stop_signal = signum
                self.stop_deadline = time.monotonic() + self.job.stop_grace_s
            elif signum == signal.SIGINT:
                # A second Ctrl-C: the user will not wait for the agreed step, which a rank stuck in user code
                # or in a collective never reaches. A second SIGTERM is only passed on (it must not tear a
                # save): whoever sends SIGTERM gives the grace period, as Slurm's KillWait does.
                self.kill_now = True
                return
        for r in self.ranks:
            _send(r.proc, _FOR_RANKS.get(signum, signum))

    def _alive(self, ranks: list[_Rank] | None = None) -> list[_Rank]:
        return [r for r in (self.ranks if ranks is None else ranks) if r.proc.poll() is None]

    def _wait_gone(self, ranks: list[_Rank], seconds: float, until_kill: bool = False) -> list[_Rank]:
        """Wait up to `seconds` (less if `until_kill` and a kill was asked for) for `ranks` to exit; the living."""
        deadline = time.monotonic() + seconds
        alive = self._alive(ranks)
        while alive and time.monotonic() < deadline and not (until_kill and self.kill_now):
            time.sleep(0.05)
            alive = self._alive(alive)
        return alive

    def _kill(self, ranks: list[_Rank]) -> list[_Rank]:
        """SIGKILL `ranks` with their process groups; returns those still there after KILL_WAIT_S."""
        for r in ranks:
            _send(r.proc, signal.SIGKILL, group=True)
        return self._wait_gone(ranks, KILL_WAIT_S)

    def _stop_all(self) -> list[_Rank]:
        """SIGTERM the survivors, then SIGKILL whoever is still there after GRACE_S; returns the ranks that
        outlived even SIGKILL (a process stuck in the kernel, e.g. on a dead file system)."""
        alive = self._alive()
        for r in alive:
            _send(r.proc, signal.SIGTERM)
        alive = self._wait_gone(alive, GRACE_S, until_kill=True)
        return self._kill(alive) if alive else []

    def _join_readers(self) -> None:
        # A reader ends at the end of its pipe: when the rank and everything that inherited its stdout are gone.
        # Something the rank started and left behind may hold it open for good, so all together wait a while.
        deadline = time.monotonic() + READER_JOIN_S
        for r in self.ranks:
            r.reader.join(timeout=max(0.0, deadline - time.monotonic()))

    def _announce_stop(self) -> None:
        self._announced = True
        grace = f"{self.job.stop_grace_s:g} s"
        if self.stop_signal == signal.SIGINT:
            self.say(
                f"Ctrl-C: asked every rank to save at the next agreed step and stop; Ctrl-C again kills them "
                f"now, and they are killed anyway if still running in {grace} (--stop-grace-s)"
            )
        else:
            name = signal.Signals(self.stop_signal).name
            if self.stop_signal == signal.SIGHUP:
                name += " (the terminal closed)"
            self.say(
                f"{name}: asked every rank to save at the next agreed step and stop; they are killed if "
                f"still running in {grace} (--stop-grace-s)"
            )

    def _supervise(self) -> int:
        """Wait for all ranks. Returns the first failure's rank index, -1 (_OUT_OF_TIME) when a stop ran out of
        time with ranks still running, or world_size when all exited OK or PREEMPTED."""
        while True:
            if self.stop_signal and not self._announced:
                self._announce_stop()
            codes = [r.proc.poll() for r in self.ranks]
            failed = [i for i, c in enumerate(codes) if c not in (None, exitcodes.OK, exitcodes.PREEMPTED)]
            if failed:
                return failed[0]
            if all(c is not None for c in codes):
                return len(self.ranks)
            if self.kill_now or (self.stop_deadline is not None and time.monotonic() >= self.stop_deadline):
                return _OUT_OF_TIME
            time.sleep(0.05)

    def _kill_stopping(self) -> int | None:
        """The stop ran out of time: SIGKILL every rank still running and say which; the launcher's exit code,
        or None if they all exited meanwhile after all."""
        alive = self._alive()
        if not alive:
            return None
        if self.kill_now:
            why, signum = "second Ctrl-C", signal.SIGINT
        else:
            asked = "Ctrl-C" if self.stop_signal == signal.SIGINT else signal.Signals(self.stop_signal).name
            why, signum = f"{self.job.stop_grace_s:g} s after {asked}", self.stop_signal
        stuck = self._kill(alive)
        self._join_readers()
        names = ", ".join(f"rank {r.rank} (pid {r.proc.pid})" for r in alive)
        self.say(
            f"{why}: killed the ranks that did not stop: {names}. Their work since the last checkpoint "
            f"(if any) in {self.job.folder} is lost; the same command resumes from it"
        )
        self._report_stuck(stuck)
        return 128 + signum  # as a shell reports a process killed by that signal: 130 for Ctrl-C

    def _report_stuck(self, stuck: list[_Rank]) -> None:
        for r in stuck:
            self.say(
                f"rank {r.rank} (pid {r.proc.pid}) is still there {KILL_WAIT_S:g} s after SIGKILL: stuck in "
                "the kernel (a dead file system or device?); it ends when that call returns"
            )

    def _failure(self, index: int) -> retry.Ending:
        """Rank `index` failed first: stop the others, then name the first cause from what the ranks left (their
        exit notes, a hang verdict) and what the launcher saw (who ended first, and how)."""
        failed = self.ranks[index]
        code = failed.proc.returncode
        if code == exitcodes.HANG:
            self._end_after_verdict()
        self._report_stuck(self._stop_all())
        self._join_readers()
        verdict = watchdog.read_verdict(self.job.folder, since=self.started_at)
        evidence = retry.Evidence(
            code=code,
            rank_nodes=tuple(self._node(r.rank) for r in self.ranks),
            notes=tuple(exits.read(self.job.folder, self.job.job_id, self.restarts)),
            verdict=verdict,
            first_rank=index,
        )
        ending = retry.judge(evidence)
        if verdict is None and ending.rank is None:
            ending = dataclasses.replace(ending, rank=index, node=self._node(index))
        return ending

    def _node(self, rank: int) -> str:
        return slurm_env(self.job, rank, 0)["SLURMD_NODENAME"]

    def _show_failure(self, index: int, code: int) -> None:
        """The rank that ended first, and how (a hang's verdict line says it instead)."""
        failed = self.ranks[index]
        if code == exitcodes.HANG:
            return
        how = f"was killed by {retry.signal_name(-code)}" if code < 0 else f"exited with code {code}"
        node = index // self.job.tasks_per_node
        self.say(f"rank {index} (node {node}, pid {failed.proc.pid}) {how}; stopped the other ranks")

    def _show_error(self, ending: retry.Ending, index: int | None) -> None:
        """The first cause's traceback (or its log's last lines), shown once per distinct error."""
        if ending.signature in self.shown:
            self.say(f"the same error as before ({ending.reason})")
            return
        self.shown.add(ending.signature)
        if ending.outcome == record.HANG:  # its one line (Launcher._end_attempt) says where
            return
        rank = ending.rank if ending.rank is not None else index
        if ending.traceback:
            self.say(f"rank {rank} failed first; its traceback:")
            lines = ending.traceback.splitlines()
        elif rank is not None and 0 <= rank < len(self.ranks):
            r = self.ranks[rank]
            source = f"its output ({r.log_path} could not be written)" if r.log_lost else r.log_path
            self.say(f"Last lines of {source}:")
            lines = list(r.tail)  # a copy: a reader that outlived its join may still append
        else:
            return
        for line in lines[-TAIL_LINES * 4 :]:
            self.console.line(f"    {line}")

    def _end_attempt(self, ending: retry.Ending) -> retry.Decision:
        """Append this attempt's end to attempts.jsonl with what comes next; say it in one line."""
        folder, job = self.job.folder, self.job.job_id
        history = record.of_job(record.read(folder), job)
        this = record.find(history, job, self.restarts) or record.Attempt(
            job, self.restarts, number=len(history) + 1
        )
        history = [a for a in history if a.key != this.key]
        this = retry.close(
            this,
            ending,
            record.step_reached(folder, self.started_at),
            record.checkpoint_step(folder),
            time.time(),
        )
        decision = retry.decide(
            history, this, self.job.max_restarts, again=record.RESTART, retryable=ending.retryable
        )
        if self.stop_requested and decision.action == record.RESTART:
            decision = retry.Decision(record.STOP, "stopped by Ctrl-C/SIGTERM", decision.exclude)
        if self.job.records and record.worth_recording(this):
            # Locally blame is recorded, nothing excluded: every emulated node is this machine.
            record.record_end(folder, dataclasses.replace(this, decision=decision.action, exclude=()))
        if this.failed:
            where = f" on {this.node}" if this.node else ""
            blame = " (points at the node)" if this.blamed else ""
            reason = f"{this.reason}; " if this.outcome != record.HANG else ""
            if this.outcome == record.HANG:  # the verdict's line as it was, then what comes next
                self.say(f"{this.reason}; every rank's report: {self.job.folder / watchdog.VERDICT}")
            self.say(f"attempt {this.number} {this.outcome}{where}{blame}: {reason}{decision.message}")
        return decision

    def _end_after_verdict(self) -> None:
        """A rank ended on a hang verdict; the others that can still run end on their own once it is written
        (run/watchdog.py): let them, and kill at once the ranks it names unresponsive (stopped, frozen)."""
        deadline = time.monotonic() + 3 * watchdog.WINDOW_S
        verdict = None
        while verdict is None and self._alive() and time.monotonic() < deadline:
            verdict = watchdog.read_verdict(self.job.folder, since=self.started_at)
            time.sleep(0.1)
        frozen = set(verdict.get("unresponsive", [])) if verdict else set()
        self._report_stuck(self._kill([r for r in self._alive() if r.rank in frozen]))
        self._wait_gone(self._alive(), watchdog.WINDOW_S)

    def _restart_wanted(self) -> bool:
        preempted = run_folder.read_preempted(self.job.folder)
        return preempted is not None and preempted.requeue and not self.stop_requested

    def run(self) -> int:
        handled = (*_STOPS, signal.SIGUSR1, signal.SIGUSR2)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        lock = None
        try:
            # Before anything in the folder changes (preempted.json, the logs): a second run is refused here.
            lock = run_folder.hold_folder(self.job.folder, "launcher", self.job.job_id, 0)
            self.lock_token = lock.token
            seen = len(self.forwarded)
            while True:
                run_folder.clear_preempted(self.job.folder)
                self._start(self.restarts)
                self._resend(seen)  # came after the last run's ranks were gone, before these existed
                if self.stop_requested:  # the stop came while they were starting: make sure each rank has it
                    for r in self.ranks:
                        _send(r.proc, signal.SIGTERM)
                outcome = self._supervise()
                if outcome == _OUT_OF_TIME:
                    code = self._kill_stopping()
                    if code is not None:
                        self._end_attempt(
                            retry.Ending(record.STOPPED, "killed: the stop ran out of time", "stop timeout")
                        )
                        return code
                    outcome = self._supervise()  # they all exited just before the kill: as if in time
                if outcome < len(self.ranks):
                    code = self.ranks[outcome].proc.returncode  # not None: _supervise saw it end
                    ending = self._failure(outcome)
                    self._show_failure(outcome, code)
                    decision = self._end_attempt(ending)
                    self._show_error(ending, outcome)
                    if decision.action != record.RESTART:
                        return self._final_code(ending, code)
                else:
                    seen = len(self.forwarded)  # every rank has exited: later signals are for the next ranks
                    self._join_readers()
                    if all(r.proc.returncode == exitcodes.OK for r in self.ranks):
                        self._end_attempt(retry.Ending(record.COMPLETED, "finished"))
                        return exitcodes.OK
                    wanted = self._restart_wanted()
                    decision = self._end_attempt(
                        retry.judge(retry.Evidence(code=exitcodes.PREEMPTED, requeue=wanted))
                    )
                    if decision.action != record.RESTART:
                        self.say(
                            f"ranks stopped after saving a checkpoint in {self.job.folder}; run the same "
                            "command to resume"
                        )
                        return exitcodes.PREEMPTED
                    done = record.count(record.read(self.job.folder), self.job.job_id, (record.PREEMPTED,))
                    self.say(
                        f"preempted: restarting all ranks ({done} of --max-requeue {self.job.max_requeue})"
                    )
                seen = len(self.forwarded)
                self.restarts += 1
        finally:
            # Every path, an exception in the launcher included, ends every rank it started.
            self._report_stuck(self._stop_all())
            if lock is not None:
                lock.release()
            for s, handler in previous.items():
                signal.signal(s, handler)
            # The ranks are all gone; hand the console what is left for it (a Ctrl-C here stops waiting).
            self.console.drain()

    def _final_code(self, ending: retry.Ending, code: int | None) -> int:
        if ending.outcome == record.HANG:
            return exitcodes.HANG
        return code if code in (exitcodes.USAGE, exitcodes.NONFINITE) else exitcodes.FAILED


def gpu_count() -> int:
    """GPUs on this machine, without importing torch (nvidia-smi, else 0)."""
    out = run_command(["nvidia-smi", "-L"], timeout_s=10).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def run_local(
    shape: JobShape,
    cfg: TrainConfig,
    all_ranks: bool,
    module: str,
    extra_argv: tuple[str, ...] = (),
    stop_grace_s: float | None = None,
) -> int:
    """`python -m hpc_ddp.submit --local`: prepare the run folder, start the ranks here, supervise them."""
    if stop_grace_s is not None and not (math.isfinite(stop_grace_s) and stop_grace_s >= 0):
        raise UsageError(f"--stop-grace-s {stop_grace_s:g}: must be 0 or more seconds (0 kills at once)")
    if cfg.requeue_by == "scontrol":
        raise UsageError(
            "--requeue-by scontrol: a local run is no Slurm job that scontrol could requeue; its "
            "launcher restarts it after a preemption. Fix: drop --requeue-by"
        )
    # Said explicitly to every rank: there is no real Slurm job to requeue (its job id is fake), so after a
    # preemption the ranks exit PREEMPTED and this launcher starts them again (see Launcher.run).
    cfg = dataclasses.replace(cfg, requeue_by="launcher")
    # Every line of the launcher goes through this console: one whose reader is gone (`| head`) must not
    # stop the run, nor stall a rank (Console).
    console = Console(sys.stdout)
    # Rank 0's stdout is a pipe to this launcher: tell it whether its progress line ends on a terminal.
    extra = {progress.LIVE_VAR: "1" if console.tty else "0"}
    job_id = fresh_job_id()
    folder = Path(cfg.folder) if cfg.folder else run_folder.default_for_local_run(job_id)
    run_folder.prepare(folder)
    (folder / run_folder.LOGS).mkdir(exist_ok=True)
    cfg = cfg.with_folder(str(folder))
    if shape.gpus_per_node > 0:
        have = gpu_count()
        if have < shape.nodes * shape.gpus_per_node:
            console.line(
                f"[launcher] --gpus-per-node {shape.gpus_per_node} x {shape.nodes} nodes asked, this "
                f"machine has {have} GPU(s): running {shape.tasks_per_node} CPU processes per node with "
                "gloo instead"
            )
            extra["CUDA_VISIBLE_DEVICES"] = ""
    job = LocalJob(
        nodes=shape.nodes,
        tasks_per_node=shape.tasks_per_node,
        folder=folder,
        train_argv=cfg.to_argv() + list(extra_argv),
        max_requeue=cfg.max_requeue,
        max_restarts=cfg.max_restarts if module in _HOLDS_SIGNALS else 0,
        records=module in _HOLDS_SIGNALS,
        all_ranks=all_ranks,
        job_id=job_id,
        module=module,
        extra_env=extra,
        **({} if stop_grace_s is None else {"stop_grace_s": stop_grace_s}),
    )
    console.line(
        f"[launcher] local job {job_id}: {shape.nodes} nodes x {shape.tasks_per_node} processes, run "
        f"folder {folder}, per-rank logs in {folder / run_folder.LOGS}"
    )
    return Launcher(job, console).run()  # which hands the console all it has before it returns
