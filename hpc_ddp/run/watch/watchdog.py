"""The hang watchdog: notice a stalled rank within seconds, find the culprit while every rank is alive, end.

One daemon thread per rank reads the progress beacon (`run/watch/beacon.py`) once per `TICK_S`. When this rank has
been in the same phase at the same step for longer than the hang threshold, it diagnoses:

1. It writes its own report (rank, host, pid, phase, step, seconds stalled, every thread's Python stack, the
   innermost frame of user code) to `<folder>/hang/<run id>/rank-<N>.json` on shared storage. Not through the
   TCP store, which lives in rank 0's process and dies with it; never through USR1/USR2/TERM, which mean
   preemption. In a hang every rank stalls within about a step of the others (the culprit where it is stuck,
   the rest in the next collective), so every watchdog fires at about the same time.
2. The lowest rank that reported waits up to `window_s` (5 s, and 1 s more per 1,024 ranks) for the other ranks' reports, claims the verdict
   (an O_EXCL file, so exactly one writes it), decides it (`run/watch/verdict.py`), and writes `<folder>/hang.json`
   atomically, through the ledger (hpc_ddp.ledger.verdict), then the decision alone in the round's
   `decided.json`, which the others wait for: a rank that finds a lower one's report reads no other report
   (at 8,192 ranks, every rank reading every report made the reports late and named live ranks). Every rank prints
   its own stack to its log; the verdict's line is printed once: by the rank that decided it, or, under a
   supervisor of the kit (the local launcher, a kit batch script), by that supervisor.
3. Every rank that can still run exits with `exitcodes.HANG` (os._exit, from this thread: the main thread is
   the one that is stuck), after releasing the run folder's lock if it holds it (rank 0 under srun or
   torchrun: os._exit runs no `finally`). srun, torchrun and the local launcher then end the step; they read
   hang.json.

What can run when: a main thread blocked in a gloo or NCCL wait, in `time.sleep` or in I/O releases the GIL,
so this thread runs. One stuck in native code that holds the GIL stops every Python thread, this one too.
For that case the watchdog keeps faulthandler's timer (a C thread) armed a little beyond the threshold and
pushes it forward on every tick: a dead man's switch. If the ticks stop, faulthandler dumps every thread's
stack to the rank's log and exits 1, and the other ranks' verdict names this rank as unresponsive.

Healthy runs cost one beacon read per second and one timer re-arm; shared storage is never touched.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hpc_ddp import exitcodes
from hpc_ddp.ledger import verdict as ledger_verdict
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.data import workers
from hpc_ddp.run.watch import beacon as phases
from hpc_ddp.run.watch.beacon import Beacon
from hpc_ddp.run.watch.verdict import decide

TICK_S = 1.0
WINDOW_S = 5.0  # how long the ranks' reports are collected: a rank silent that long is unresponsive
WINDOW_RANKS = 1024  # ... and 1 s more per this many ranks: thousands of reports land in one folder
FLOOR_S = 60.0  # auto: never below this (within the cap), whatever the step times say
STEP_MULTIPLE = 20.0  # auto: this many median step times
MIN_STEPS = 3  # auto: until this many steps were timed, only the long threshold applies
BACKSTOP_MARGIN_S = 10.0  # faulthandler fires this long after threshold + window if the ticks stopped
HANG_DIR = "hang"
DEFERRED = "deferred.json"  # in a diagnosis round: a peer was busy within its own limit, not hung
DECIDED = "decided.json"  # in a diagnosis round: the decision alone (no reports), what the other ranks read
WAIT_POLL_S = 1.0  # a rank waiting for the decision looks this often (thousands of ranks look at one file)
LOOK_FIRST = (
    64  # a rank looks for the reports of this many lowest ranks one by one, for the others in a listing
)
ANSWER_EVERY_S = 2.0  # a rank in a long phase past the steady limit looks for a diagnosis this often
VERDICT = ledger_verdict.VERDICT


def window_s(world_size: int) -> float:
    """How long the deciding rank waits for the others' reports (pure): 5 s, and 1 s more per 1,024 ranks, as
    a shared file system takes longer to create thousands of files in one folder (13 s at 8,192 ranks; the
    verdict still comes within 15 s of the limit)."""
    return WINDOW_S + round(world_size / WINDOW_RANKS, 1)


def threshold_s(
    setting: float | None, timeout_s: float, step_times: Sequence[float], phase: str, long: bool = False
) -> float:
    """How long a rank may stay in one phase at one step (pure). `setting` None means auto; `long` marks a
    phase that pays a start-up cost (run/watch/beacon.py; the SLOW phases always are).

    Long phases get the start-up limit, half of --timeout-s (so a verdict always comes before the collective
    timeout), whatever the setting: a fixed --hang-timeout-s S bounds the steady state only, and never lowers
    a long phase's limit below S. Steady phases: S; or, auto, half of --timeout-s until `MIN_STEPS` steps were
    timed, then 20 median step times, at least 60 s, at most half of --timeout-s."""
    cap = timeout_s / 2
    if long or phase in phases.SLOW:
        return cap if setting is None else max(setting, cap)
    if setting is not None:
        return setting
    if len(step_times) < MIN_STEPS:
        return cap
    ordered = sorted(step_times)
    median = ordered[len(ordered) // 2]
    return min(cap, max(FLOOR_S, STEP_MULTIPLE * median))


# The package's own folder, found by a module at its top (not by this file's depth in it: a module moved to
# another room must not make hpc_ddp/train.py look like the user's code), and the standard library's.
_LIBRARY_DIRS = tuple(
    {os.path.dirname(exitcodes.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep}
)


def _is_library(filename: str) -> bool:
    return (
        filename.startswith(_LIBRARY_DIRS) or f"{os.sep}torch{os.sep}" in filename or filename.startswith("<")
    )


def user_frame(frame: FrameType | None) -> dict[str, Any] | None:
    """The innermost frame of user code (not hpc_ddp, torch or the standard library) in a thread's stack."""
    while frame is not None:
        if not _is_library(frame.f_code.co_filename):
            return {
                "file": frame.f_code.co_filename,
                "line": frame.f_lineno,
                "function": frame.f_code.co_name,
            }
        frame = frame.f_back
    return None


def stacks(skip: int) -> str:
    """Every thread's Python stack but thread `skip` (the watchdog's own), main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == skip:
            continue
        out.append(f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(out)


@dataclass(frozen=True)
class Identity:
    """Who this rank is, and every rank's host and pid (one all-gather at start, for unresponsive ranks)."""

    rank: int
    world_size: int
    host: str
    peers: tuple[tuple[str, int], ...]
    run_id: str  # job id and restart: reports of a requeued run never mix with the last one's


class Watchdog:
    """Start it once training is about to begin, stop it before teardown (see the module docstring)."""

    def __init__(
        self,
        beacon: Beacon,
        who: Identity,
        folder: Path,
        setting: float | None,
        timeout_s: float,
        step_times: Callable[[], Sequence[float]],
        say: Callable[[str], None] | None,
        leave: Callable[[int], Any] = exitcodes.leave,
    ) -> None:
        """`say` prints the verdict's line on the job's console (None: a supervisor of the kit prints it)."""
        self.beacon, self.who, self.folder, self.setting, self.timeout_s = (
            beacon,
            who,
            folder,
            setting,
            timeout_s,
        )
        self.step_times, self.say, self.leave = step_times, say, leave
        self.stopped = threading.Event()
        self._extended: tuple[float, float] = (-1.0, 0.0)  # (the phase's start, until when): a deferral
        self._last_look = 0.0  # when this rank last looked for a diagnosis to answer (`_answer`)
        self.thread = threading.Thread(target=self._watch, name="hpc_ddp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._arm()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * TICK_S)
        faulthandler.cancel_dump_traceback_later()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def limit(self) -> float:
        """This rank's limit for the phase it is in now (a deferral may have extended it, `_watch`)."""
        phase, _, since, long, marked = self.beacon.state
        # The task's long work with a limit of its own (hpc_ddp.long_work) is judged against that one.
        own = (
            threshold_s(self.setting, self.timeout_s, self.step_times(), phase, long)
            if marked is None
            else marked
        )
        extended_since, until = self._extended
        return max(own, until - since) if extended_since == since else own

    def steady_limit(self) -> float:
        """The limit a peer in a steady phase gives itself now: past it, a rank in a long phase answers
        the peers that began to diagnose (they must know it is alive before they judge it)."""
        return threshold_s(self.setting, self.timeout_s, self.step_times(), phases.DATA)

    def _arm(self) -> None:
        # The dead man's switch: pushed forward on every tick; fires only if the ticks stop (GIL held).
        faulthandler.dump_traceback_later(
            self.limit() + window_s(self.who.world_size) + BACKSTOP_MARGIN_S, exit=True
        )

    def _watch(self) -> None:
        while not self.stopped.wait(TICK_S):
            self._arm()
            phase, step, since, long, _ = self.beacon.state
            stalled = time.monotonic() - since
            if self.stopped.is_set():
                return
            if stalled > self.limit():
                faulthandler.cancel_dump_traceback_later()  # from here on, this thread ends the process
                if self.diagnose(phase, step, stalled):
                    return  # not reached when it ends the process (leave); a test's leave returns
                self._arm()  # deferred: a peer is busy within its own limit
            elif long and stalled > self.steady_limit():
                self._answer(phase, step, stalled)

    def _rounds(self) -> Path:
        return self.folder / HANG_DIR / self.who.run_id

    def _open_round(self) -> Path | None:
        """The newest diagnosis round that is still collecting (no deferral decided in it), if any."""
        try:
            rounds = sorted(
                (p for p in self._rounds().iterdir() if p.name.startswith("r")), key=_round_number
            )
        except OSError:
            return None
        last = rounds[-1] if rounds else None
        return last if last is not None and not (last / DEFERRED).exists() else None

    def _round(self) -> Path:
        """The round this diagnosing rank joins: the open one, else the next (r0, r1, ...). Ranks that fire
        together compute the same name and mkdir it with exist_ok: they meet in one round."""
        rounds = self._rounds()
        rounds.mkdir(parents=True, exist_ok=True)
        numbers = sorted(_round_number(p) for p in rounds.iterdir() if p.name.startswith("r"))
        last = numbers[-1] if numbers else -1
        if last < 0 or (rounds / f"r{last}" / DEFERRED).exists():
            last += 1
        where = rounds / f"r{last}"
        where.mkdir(exist_ok=True)
        return where

    def _answer(self, phase: str, step: int, stalled: float) -> None:
        """A long phase past the steady limit: if peers are diagnosing, tell them this rank is alive and
        within its limit (at most once a round; one directory listing every ANSWER_EVERY_S meanwhile)."""
        now = time.monotonic()
        if now - self._last_look < ANSWER_EVERY_S:
            return
        self._last_look = now
        where = self._open_round()
        if where is None or (where / f"rank-{self.who.rank}.json").exists():
            return
        mine = self.report(phase, step, stalled)
        mine.update(busy=True, limit_s=round(self.limit(), 1))
        with contextlib.suppress(OSError):  # the folder is gone: the peers judge without this report
            ledger_verdict.write_json(where / f"rank-{self.who.rank}.json", mine)

    # ----- diagnosis ------------------------------------------------------------------------------------
    def report(self, phase: str, step: int, stalled: float) -> dict[str, Any]:
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        return {
            "rank": self.who.rank,
            "host": self.who.host,
            "pid": os.getpid(),
            "phase": phase,
            "step": step,
            "stalled_s": round(stalled, 1),
            "collective": phase in phases.COLLECTIVE,
            "user_frame": user_frame(main),
            "stack": stacks(skip=threading.get_ident()),
            "time": round(time.time(), 3),
        }

    def diagnose(self, phase: str, step: int, stalled: float) -> bool:
        """Report, collect, decide (lowest reporting rank), print, and leave with exitcodes.HANG; or, when a
        peer answered that it is busy within its own limit (a long save, an evaluation's start), wait for
        it: returns False and this rank's limit for the phase is extended to that peer's."""
        who = self.who
        try:
            where = self._round()
            mine = self.report(phase, step, stalled)
            _add_worker_stacks(mine)
            ledger_verdict.write_json(where / f"rank-{who.rank}.json", mine)
            reports = self._collect(where)
            verdict, decided = self._verdict(where, reports)
            if verdict.get("reason") == "busy":
                self._extended = (
                    self.beacon.state[2],
                    time.monotonic() + float(verdict["wait_s"]) + window_s(who.world_size),
                )
                if decided:  # in this rank's log (or the console it has): nobody was judged
                    (self.say or _raw)(verdict["line"])
                return False
            line = verdict.get("line", "hang: no verdict was written in time; see every rank's log")
            # The verdict once on the job's console (by the rank that decided it, unless a supervisor of the
            # kit prints it); every rank's own report in its log only: unprefixed lines of ranks other than 0
            # stay out of the local launcher's console.
            if decided and self.say is not None:
                self.say(line)
            _raw(
                ("" if decided or self.say is None else f"{line}\n")
                + f"hpc_ddp: rank {who.rank} was in {phase} at step {step} for "
                f"{stalled:.0f} s; its stacks:\n{mine['stack']}"
                + "".join(
                    f"\nits DataLoader worker (pid {w['pid']}):\n{w['stack']}"
                    for w in mine.get("workers", [])
                )
            )
        except Exception as e:  # the run folder is gone or read-only: still end, never hang here
            (self.say or _raw)(
                f"hang: rank {who.rank} stalled in {phase} at step {step} for {stalled:.0f} s, and its "
                f"report could not be written ({e})"
            )
        _end_children()
        run_folder.release_held()  # os._exit runs no `finally`: the lock rank 0 holds goes first
        self.leave(exitcodes.HANG)
        return True

    def _collect(self, where: Path) -> list[dict[str, Any]] | None:
        """The round's reports, when this rank decides it: no rank below it diagnosed in the round (read once,
        when every rank reported or the window closed); None when one did (that rank decides, this one waits
        for its word). Only the ranks that may decide watch the round meanwhile, by its names alone: the
        thousands of ranks of a large job never read each other's reports (thousands of reads of thousands
        of files on shared storage, every 0.2 s, slowed every rank's own report past the window, and ranks
        alive were named unresponsive: `python -m hpc_ddp.bench scale`)."""
        deadline = time.monotonic() + window_s(self.who.world_size)
        if self._lower_diagnosed(where):
            return None
        while len(_report_names(where)) < self.who.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._lower_diagnosed(where):
            return None
        return _read_reports(where)

    def _lower_diagnosed(self, where: Path) -> bool:
        """A rank below this one reported in this round, and not as busy (a busy rank only answered): it
        decides. The lowest ranks are looked at one by one (rank 0's report is usually there: one read), the
        others, only if none of those reported, in one listing of the round."""
        mine = self.who.rank
        ranks: list[int] = list(range(min(mine, LOOK_FIRST)))
        for rank in ranks + (_lower_names(where, LOOK_FIRST, mine) if mine > LOOK_FIRST else []):
            try:
                report = json.loads((where / f"rank-{rank}.json").read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                return True  # there, unreadable: a rank that diagnosed (a busy one's answer is rare)
            if not report.get("busy"):
                return True
        return False

    def _verdict(self, where: Path, reports: list[dict[str, Any]] | None) -> tuple[dict[str, Any], bool]:
        """The round's decision, and whether this rank made it: a hang verdict (hang.json) or a deferral
        (`<round>/deferred.json`), both with every report; then the decision alone, small, in
        `<round>/decided.json`, which the other ranks wait for (the reports of thousands of ranks are read
        once, by the supervisor, never by each rank)."""
        if reports is not None:
            try:  # exactly one rank writes the verdict, even if two saw themselves lowest
                os.close(os.open(where / "verdict.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                record = decide(reports, self.who.world_size, self.who.peers, window_s(self.who.world_size))
                record.update(
                    run_id=self.who.run_id, round=where.name, decided_by=self.who.rank, reports=reports
                )
                if record.get("reason") == "busy":
                    ledger_verdict.write_json(where / DEFERRED, record)
                else:
                    ledger_verdict.write(
                        self.folder, record
                    )  # before any rank leaves: its supervisor reads it
                word = {k: record.get(k) for k in ("run_id", "round", "line", "reason", "wait_s", "culprits")}
                ledger_verdict.write_json(where / DECIDED, word)
                return record, True
        deadline = time.monotonic() + 3 * window_s(self.who.world_size)
        while time.monotonic() < deadline:
            try:
                record = json.loads((where / DECIDED).read_text())
            except (OSError, ValueError):
                time.sleep(WAIT_POLL_S)
                continue
            if record.get("run_id") == self.who.run_id and record.get("round") == where.name:
                return dict(record), False
            time.sleep(WAIT_POLL_S)
        return {}, False


def _report_names(where: Path) -> list[str]:
    try:
        return [name for name in os.listdir(where) if name.startswith("rank-") and name.endswith(".json")]
    except OSError:
        return []


def _lower_names(where: Path, lo: int, hi: int) -> list[int]:
    """The ranks in [lo, hi) that reported in the round, lowest first (one listing)."""
    ranks = (name[len("rank-") : -len(".json")] for name in _report_names(where))
    return sorted(r for r in (int(x) for x in ranks if x.isdigit()) if lo <= r < hi)


def _read_reports(where: Path) -> list[dict[str, Any]]:
    reports = []
    for path in where.glob("rank-*.json"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being written (the rename is atomic, a torn read is not)
            continue
    return reports


def _add_worker_stacks(mine: dict[str, Any]) -> None:
    """A rank waiting for its DataLoader workers: their stacks too (run/data/workers.py), and the user line of the
    one that is stuck when the rank's own stack has none (it only waits in the loader)."""
    import psutil

    try:
        pids = [child.pid for child in psutil.Process().children()]
    except psutil.Error:
        return
    texts = workers.stacks(pids)
    if not texts:
        return
    mine["workers"] = [
        {"pid": pid, "stack": text, "user_frame": workers.user_line(text, _is_library)}
        for pid, text in texts.items()
    ]
    if mine.get("user_frame") is None:
        mine["user_frame"] = next((w["user_frame"] for w in mine["workers"] if w["user_frame"]), None)


def _round_number(path: Path) -> int:
    return int(path.name[1:]) if path.name[1:].isdigit() else -1


def _end_children() -> None:
    """SIGKILL the processes this rank started (DataLoader workers): one stuck in the user's __getitem__ never
    looks for its parent, and would outlive the rank's os._exit."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def _raw(text: str) -> None:
    try:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
