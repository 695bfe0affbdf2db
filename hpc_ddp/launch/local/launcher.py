"""The local launcher itself: start the ranks, pass signals on, supervise, end each attempt, restart.

It supervises like Slurm with `--kill-on-bad-exit`: when a rank exits non-zero or dies, the others are stopped
within seconds and the launcher names the failed rank and shows its error once. Every end of an attempt goes
through the supervisor core (hpc_ddp.launch.supervisor: judge, close, decide with both budgets, record), and
the launcher acts on the decision: start every rank again (SLURM_RESTART_COUNT + 1), or stop with the
outcome's exit code. Signals: SIGUSR1/SIGUSR2 are passed to every rank, which save at an agreed step and exit
PREEMPTED; the launcher then plays Slurm's requeue within --max-requeue. SIGINT/SIGTERM/SIGHUP are passed on
too (Ctrl-C and a closed terminal as SIGTERM); the ranks save and the launcher does not restart. A signal the
launcher receives while it (re)starts the ranks, or between two runs of a restart, is sent again to every new
rank once they all exist.

It must never hang, whatever the ranks or the machine do, since a hung launcher holds every rank: a rank stops
only at an agreed step, and one stuck in user code or in a collective never gets there. So a stop has a
deadline, as under torchrun and Slurm (KillWait): a second Ctrl-C, or `stop_grace_s` after the first
Ctrl-C/SIGTERM, SIGKILLs every rank's process group and the launcher exits 128 + signal, naming the ranks that
did not stop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import TextIO

from hpc_ddp import exitcodes
from hpc_ddp.launch import spares, supervisor
from hpc_ddp.launch.local import cause, forkserver, processes
from hpc_ddp.launch.local.console import TAIL_LINES, Console, RankOutput
from hpc_ddp.launch.local.srun_env import LocalJob, child_environ
from hpc_ddp.ledger import attempts, decision, exits, judge, outcomes, preemption, rules
from hpc_ddp.ledger import verdict as hang_verdict
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.snapshot import store as snapshots
from hpc_ddp.run.watch.watchdog import WINDOW_S
from hpc_ddp.scheduler.local import node_name

# After the ranks are gone, all their readers together get this long to copy the last lines.
READER_JOIN_S = 5.0
# What _supervise returns when a stop ran out of time (a second Ctrl-C, or stop_grace_s after the first signal).
_OUT_OF_TIME = -1


class Launcher:
    """Starts, supervises, signals and restarts the ranks of one local job."""

    def __init__(
        self,
        job: LocalJob,
        console: Console | TextIO | None = None,
        lock: run_folder.FolderLock | None = None,
    ) -> None:
        self.job = job
        self.console = console if isinstance(console, Console) else Console(console or sys.stdout)
        self.lock = lock  # the run folder's, taken by run_local before it says anything; else by run()
        self.ranks: list[RankOutput] = []
        self.forwarded: list[int] = []  # signals the launcher received and passed on
        self.stop_requested = False
        self.stop_signal = 0  # the first SIGINT/SIGTERM: its stop's grace period is running
        self.stop_deadline: float | None = None
        self.kill_now = False  # a Ctrl-C after the first stop signal: kill without waiting any longer
        self._announced = False
        self.started_at = 0.0  # when the ranks were last started (epoch seconds)
        self.restarts = 0  # SLURM_RESTART_COUNT of the ranks now running: starts so far, minus one
        self.shown: set[str] = set()  # signatures of the errors whose traceback was shown already
        # attempts.jsonl, for training runs only; anything else keeps nothing (the budgets then count nothing).
        # The run's checkpoints, through its --checkpoint-storage: built once, read at each attempt's end.
        checkpoints = store.of_run(job.folder, job.checkpoint_storage)
        self.journal = supervisor.Journal(checkpoints, attempts.append if job.records else _keep)
        # The budgets, built once: the launcher starts its ranks again itself (a restart, not a requeue).
        self.budgets = decision.Budgets(job.max_restarts, job.max_requeue, outcomes.RESTART)
        # Training ranks are forked from one process that imported torch once (forkserver), kept across
        # restarts; where it cannot serve, each rank starts the plain way (processes.start).
        self.forks = forkserver.Server(job.module, self.say)
        # The emulated nodes the ranks run on; with --spare-nodes K, K more wait, each taken in place of a node
        # a failure blames (hpc_ddp.launch.spares), as a Slurm job's batch shell does inside its allocation.
        self.step_nodes = tuple(node_name(i) for i in range(job.nodes))
        self.allocation = tuple(node_name(i) for i in range(job.nodes + job.spare_nodes))
        self.next_nodes = self.step_nodes

    def say(self, message: str) -> None:
        self.console.line(f"[launcher] {message}")

    # ----- the ranks' processes -----------------------------------------------------------------------------

    def _start(self, restarts: int) -> None:
        self.started_at = time.time()  # a hang verdict older than this belongs to an earlier start
        logs = self.job.folder / run_folder.LOGS
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-u", "-m", self.job.module, *self.job.train_argv]
        hold = self.job.module in processes.HOLDS_SIGNALS
        self.ranks = []
        for rank in range(self.job.world_size):
            env = child_environ(
                dict(os.environ), self.job, rank, restarts, self.step_nodes if self.job.spare_nodes else ()
            )
            if self.lock is not None:
                env[run_folder.LOCK_VAR] = self.lock.token
            proc = self.forks.start(self.job.train_argv, env, hold) or processes.start(cmd, env, hold)
            self.ranks.append(
                RankOutput(
                    rank, proc, logs / f"rank{rank}.log", self.console, self.job.all_ranks, self._stopped_by
                )
            )

    def _resend(self, since: int) -> None:
        """Send every rank the signals that came since `forwarded[since]` (while the ranks were being started,
        or between two runs of a restart): a rank started after one came never got it. Held until the rank
        handles them (processes.die_with_parent); a rank that got one twice notes it once."""
        for signum in dict.fromkeys(self.forwarded[since:]):
            for r in self.ranks:
                processes.send(r.proc, processes.FOR_RANKS.get(signum, signum))

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Runs on the main thread between two bytecodes of whatever it was doing: only take note and pass the
        # signal on (os.kill is safe here; the console's lock and reaping children are not). The supervision
        # loop does the rest: announcing, and killing when the stop runs out of time.
        self.forwarded.append(signum)
        if signum in processes.STOPS:
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
            processes.send(r.proc, processes.FOR_RANKS.get(signum, signum))

    def _alive(self) -> list[RankOutput]:
        return [r for r in self.ranks if r.proc.poll() is None]

    def _of(self, procs: list[subprocess.Popen[bytes]]) -> list[RankOutput]:
        return [r for r in self.ranks if r.proc in procs]

    def _kill(self, ranks: list[RankOutput]) -> list[RankOutput]:
        """SIGKILL `ranks` with their process groups; those still there after processes.KILL_WAIT_S."""
        return self._of(processes.kill([r.proc for r in ranks]))

    def _stop_all(self) -> list[RankOutput]:
        """SIGTERM, then SIGKILL, every rank still running (a second Ctrl-C cuts the wait short); those that
        outlived even SIGKILL."""
        return self._of(processes.stop([r.proc for r in self.ranks], lambda: self.kill_now))

    def _join_readers(self) -> None:
        # A reader ends at the end of its pipe: when the rank and everything that inherited its stdout are gone.
        # Something the rank started and left behind may hold it open for good, so all together wait a while.
        deadline = time.monotonic() + READER_JOIN_S
        for r in self.ranks:
            r.reader.join(timeout=max(0.0, deadline - time.monotonic()))

    def _report_stuck(self, stuck: list[RankOutput]) -> None:
        for r in stuck:
            self.say(
                f"rank {r.rank} (pid {r.proc.pid}) is still there {processes.KILL_WAIT_S:g} s after SIGKILL: "
                "stuck in the kernel (a dead file system or device?); it ends when that call returns"
            )

    # ----- supervision --------------------------------------------------------------------------------------

    def _stopped_by(self) -> str:
        """The stop the user asked for, in their words ("" : none yet)."""
        return stop_words(self.stop_signal)

    def _resume(self) -> str:
        return f"to resume, run: {self.job.resume_command}" if self.job.resume_command else ""

    def _announce_stop(self) -> None:
        self._announced = True
        grace = f"{self.job.stop_grace_s:g} s"
        again = "; Ctrl-C again kills them now, and" if self.stop_signal == signal.SIGINT else ";"
        self.say(
            f"{self._stopped_by()}: asked every rank to save at the next agreed step and stop{again} they are "
            f"killed {'anyway ' if self.stop_signal == signal.SIGINT else ''}if still running in {grace} "
            "(--stop-grace-s)"
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
            why, signum = f"{self.job.stop_grace_s:g} s after {self._stopped_by()}", self.stop_signal
        stuck = self._kill(alive)
        self._join_readers()
        names = ", ".join(f"rank {r.rank} (pid {r.proc.pid})" for r in alive)
        self.say(
            f"{why}: killed the ranks that did not stop: {names}. Their work since the last checkpoint "
            f"(if any) in {self.job.folder} is lost; {self._resume() or 'the same command resumes from it'}"
        )
        self._report_stuck(stuck)
        return 128 + signum  # as a shell reports a process killed by that signal: 130 for Ctrl-C

    # ----- the end of an attempt ----------------------------------------------------------------------------

    def _failure(self, index: int) -> judge.Evidence:
        """Rank `index` failed first: stop the others, then gather what the ranks left (their exit notes, a hang
        verdict) and what the launcher saw (who ended first, and how)."""
        code = self.ranks[index].proc.returncode
        killed: tuple[tuple[int, str], ...] = ()
        if code == exitcodes.HANG:
            self._end_after_verdict()  # which may SIGKILL the frozen ranks itself: no death of theirs to name
        else:  # who died by a signal, before the launcher's own SIGTERM/SIGKILL make every rank look killed
            notes = exits.read(self.job.folder, self.job.job_id, self.restarts)  # the first rank's, at least
            killed = cause.seen_dead(self.ranks, index, notes)
        self._report_stuck(self._stop_all())
        self._join_readers()
        return judge.Evidence(
            code=code if code is not None else exitcodes.FAILED,
            rank_nodes=tuple(self._node(r.rank) for r in self.ranks),
            notes=tuple(exits.read(self.job.folder, self.job.job_id, self.restarts)),
            verdict=hang_verdict.read(self.job.folder, since=self.started_at),
            killed=killed,
            first_rank=index,
        )

    def _end_after_verdict(self) -> None:
        """A rank ended on a hang verdict; the others that can still run end on their own once it is written
        (run/watch/watchdog.py): let them, and kill at once the ranks it names unresponsive (stopped, frozen)."""
        deadline = time.monotonic() + 3 * WINDOW_S
        found = None
        while found is None and self._alive() and time.monotonic() < deadline:
            found = hang_verdict.read(self.job.folder, since=self.started_at)
            time.sleep(0.1)
        frozen = set(found.get("unresponsive", [])) if found else set()
        self._report_stuck(self._kill([r for r in self._alive() if r.rank in frozen]))
        processes.wait_gone([r.proc for r in self._alive()], WINDOW_S)  # the rest: stopped with the others

    def _node(self, rank: int) -> str:
        return self.step_nodes[rank // self.job.tasks_per_node]

    def _preemption(self) -> judge.Evidence:
        record = preemption.read(self.job.folder)  # cleared before each start: this attempt's own
        return judge.Evidence(code=exitcodes.PREEMPTED, requeue=record is not None and record.requeue)

    def _end_attempt(
        self, found: judge.Evidence | judge.Ending, seen: int | None = None
    ) -> supervisor.Closed:
        """The supervisor core ends the attempt (both budgets; a stop asked of the launcher wins over a restart);
        a failure's end is said in one line. `seen`: the failing rank the launcher saw end first; the line
        naming who ended comes first (judge.named_first: the first cause, when its process ended failing)."""

        def survey(this: attempts.Attempt, blamed: tuple[str, ...]) -> decision.Facts:
            # A stop the launcher was asked for wins over a restart; a spare emulated node in place of each
            # blamed one (none left: the same nodes, as without spares).
            stop = self._stopped_by() if self.stop_requested else None
            here = spare_in(self.allocation, self.step_nodes, this, blamed) if self.job.spare_nodes else None
            return decision.Facts(stop=stop, in_place=here)

        closed = supervisor.end_attempt(
            self.journal,
            self.job.job_id,
            self.restarts,
            found,
            self.budgets,
            began=self.started_at,
            checkpoint=supervisor.resume_step(self.journal.checkpoints, self.job.job_id, os.environ),
            survey=survey,
            exclude=lambda _decision: (),  # locally blame is recorded, nothing excluded: every node is this one
            nodes=self.step_nodes,
        )
        if seen is not None:
            codes = [r.proc.returncode for r in self.ranks]
            named = judge.named_first(seen, closed.ending, codes)
            code = codes[named]  # not None: _supervise saw it end, or named_first checked it
            self._show_failure(named, code if code is not None else exitcodes.FAILED)
        if closed.attempt.outcome == outcomes.HANG:  # the verdict's line, once, then what comes next
            self.say(f"{closed.attempt.reason}; every rank's report: {hang_verdict.path(self.job.folder)}")
        if closed.decision.on:  # the ranks' next start (this attempt's lines still name its own)
            self.next_nodes = closed.decision.on
        if closed.attempt.failed:
            named = dataclasses.replace(closed.attempt, node=node_label(self.step_nodes, closed.attempt.node))
            self.say(attempts.line(named, closed.decision.said))
        return closed

    def _show_failure(self, index: int, code: int) -> None:
        """The rank that ended first, and how (a hang's verdict line says it instead)."""
        where = node_label(self.step_nodes, self._node(index))
        if code != exitcodes.HANG:
            self.say(ended_first(index, where, self.ranks[index].proc.pid, code))

    def _show_consequences(self, cause: int | None) -> None:
        """After the first cause: one line for the ranks that failed only because another ended (their own
        lines were held, RankOutput); the other ranks' held lines as they came."""
        after = [r for r in self.ranks if r.consequence and r.rank != cause]
        for r in self.ranks:
            held = r.release()
            if r.rank == cause or not r.consequence:
                for line in held:
                    self.console.line(line)
        if not after:
            return
        which = ", ".join(str(r.rank) for r in after)
        logs = after[0].log_path if len(after) == 1 else after[0].log_path.parent / "rank<N>.log"
        errors = ", ".join(dict.fromkeys(r.consequence for r in after))
        self.say(
            f"then {'rank' if len(after) == 1 else 'ranks'} {which} failed too, on the rank that ended first "
            f"({errors}): a consequence, not a cause; all of it in {logs}"
        )

    def _release_held(self) -> None:
        """No failure to put first: the held lines as they came."""
        for r in self.ranks:
            for line in r.release():
                self.console.line(line)

    def _show_error(self, ending: judge.Ending, index: int | None) -> None:
        """The first cause's traceback (or its log's last lines), shown once per distinct error; nothing for
        what the console showed already (a hang's verdict line, rank 0's one-line usage error)."""
        if ending.signature in self.shown:
            self.say(f"the same error as before ({ending.reason})")
            return
        self.shown.add(ending.signature)
        rank = ending.rank if ending.rank is not None else index
        if ending.outcome == outcomes.HANG:
            return
        if ending.outcome == outcomes.USAGE and (rank == 0 or self.job.all_ranks):
            return  # its one line came through the console as the rank printed it
        if not ending.retryable:
            # The kit stopped the run on purpose (hpc_ddp.errors.RunStopped), on every rank at one step: its
            # one line is the whole story (rank 0's came through the console), never a traceback.
            if rank == 0 or self.job.all_ranks:
                self.say(f"rank {rank} failed first, with the one-line error above")
            else:
                self.say(f"rank {rank} failed first: {ending.reason}")
            return
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

    # ----- the run ------------------------------------------------------------------------------------------

    def run(self) -> int:
        handled = (*processes.STOPS, signal.SIGUSR1, signal.SIGUSR2)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            if self.lock is None:  # before anything in the folder changes: a second run is refused here
                self.lock = run_folder.hold_folder(self.job.folder, "launcher", self.job.job_id, 0)
            return self._attempts()
        finally:
            # Every path, an exception in the launcher included, ends every rank it started, and the fork server.
            self._report_stuck(self._stop_all())
            self.forks.close()
            # The job ends: its snapshots in memory go, on every path (every emulated node's is on this machine).
            snapshots.remove_job(snapshots.root(os.environ), self.job.job_id)
            if self.lock is not None:
                self.lock.release()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if not self.journal.flush():
                self.say(self.journal.lost())
            # The ranks are all gone; hand the console what is left for it (a Ctrl-C here stops waiting).
            self._release_held()
            self.console.drain()

    def _attempts(self) -> int:
        """Start the ranks, supervise them, end the attempt; again while the decision says restart."""
        seen = len(self.forwarded)
        while True:
            preemption.clear(self.job.folder)
            self._start(self.restarts)
            self._resend(seen)  # came after the last run's ranks were gone, before these existed
            if self.stop_requested:  # the stop came while they were starting: make sure each rank has it
                for r in self.ranks:
                    processes.send(r.proc, signal.SIGTERM)
            outcome = self._supervise()
            if outcome == _OUT_OF_TIME:
                code = self._kill_stopping()
                if code is not None:
                    self._end_attempt(
                        judge.Ending(outcomes.STOPPED, "killed: the stop ran out of time", "stop timeout")
                    )
                    return code
                outcome = self._supervise()  # they all exited just before the kill: as if in time
            if outcome < len(self.ranks):
                closed = self._end_attempt(self._failure(outcome), seen=outcome)
                self._show_error(closed.ending, outcome)
                self._show_consequences(closed.ending.rank if closed.ending.rank is not None else outcome)
                if closed.decision.action != outcomes.RESTART:
                    self._advise(closed)
                    return outcomes.exit_code(closed.attempt.outcome)
            else:
                seen = len(self.forwarded)  # every rank has exited: later signals are for the next ranks
                self._join_readers()
                self._release_held()
                if all(r.proc.returncode == exitcodes.OK for r in self.ranks):
                    closed = self._end_attempt(judge.Ending(outcomes.COMPLETED, "finished"))
                    return outcomes.exit_code(closed.attempt.outcome)
                closed = self._end_attempt(self._preemption())
                if closed.decision.action != outcomes.RESTART:
                    if closed.attempt.outcome == outcomes.PREEMPTED:  # the budget is spent: say so
                        # (without the rule's advice, "the same command and --folder": the next line's, exactly)
                        self.say(closed.decision.message)
                    why = self._stopped_by() or "stopped"
                    self.say(
                        f"{why}: every rank saved a checkpoint in {self.job.folder} and stopped; "
                        f"{self._resume() or 'run the same command to resume'}"
                    )
                    return outcomes.exit_code(closed.attempt.outcome)  # preempted or stopped: saved, 75
                done = rules.preemptions(self.journal.history(self.job.job_id))
                self.say(f"preempted: restarting all ranks ({done} of --max-requeue {self.job.max_requeue})")
            seen = len(self.forwarded)
            self.restarts += 1
            self.step_nodes = self.next_nodes

    def _advise(self, closed: supervisor.Closed) -> None:
        """After a failure that ends the run: the command that resumes it, and from where."""
        if self.job.resume_command and closed.attempt.outcome in outcomes.RESUMABLE:  # else: the same failure
            self.say(advice(self.job.resume_command, supervisor.latest_step(self.journal.checkpoints)))


def node_label(step_nodes: tuple[str, ...], address: str | None) -> str | None:
    """An emulated node as every launcher line names it: "node 1 (127.0.0.2)", its index (the ranks' own start
    lines say "node 1" too) and the address it has in SLURM_JOB_NODELIST and attempts.jsonl."""
    for node, name in enumerate(step_nodes):
        if name == address:
            return f"node {node} ({address})"
    return address


def ended_first(rank: int, where: str | None, pid: int, code: int) -> str:
    """The line that names the rank that ended first, where, and how: its exit code or signal (pure)."""
    how = f"was killed by {judge.signal_name(-code)}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} on {where}, pid {pid}, {how}; stopped the other ranks"


def advice(resume_command: str, step: int | None) -> str:
    """The line that says how a failed run resumes, from its latest checkpoint's `step` (pure)."""
    start = (
        f"from the checkpoint at step {step}" if step is not None else "from the start (no checkpoint yet)"
    )
    return f"once the cause is fixed, the same command resumes {start}: {resume_command}"


def spare_in(
    allocation: tuple[str, ...], step_nodes: tuple[str, ...], this: attempts.Attempt, blamed: tuple[str, ...]
) -> decision.InPlace | None:
    """After a failure, a spare emulated node in place of each blamed node the next start leaves out, or None
    (not a failure, none to leave, or no spare left: the same nodes, as without spares; pure)."""
    if not this.failed:
        return None
    leave = spares.to_leave(blamed, this.signature, this.node)
    placed = spares.after(allocation, step_nodes, leave, len(step_nodes))
    if placed is None or not placed.left:
        return None
    return decision.InPlace(placed, len(step_nodes), leave)


def stop_words(signum: int) -> str:
    """A stop the launcher was asked for, as the user knows it (pure): the ranks always get SIGTERM."""
    if not signum:
        return ""
    if signum == signal.SIGINT:
        return "interrupted (Ctrl-C)"
    if signum == signal.SIGHUP:
        return "the terminal closed (SIGHUP)"
    return f"stopped by {signal.Signals(signum).name}"


def _keep(_folder: object, _record: object) -> None:
    """The journal's writer for runs that keep no attempts record (not a training run)."""
