"""The scale bench's hang: N simulated ranks, one silent, through the kit's own watchdog (hpc_ddp.run.watch.watchdog).

Each simulated rank is a thread running the real `Watchdog`: its tick loop, its report written to the run
folder, the round's collection, the claim, `decide` and `hang.json`. Only what cannot be shared by thousands of
ranks in one process is replaced: the faulthandler timer (one per process, it would end the bench), the report's
stacks (every thread's stack of this process would be every simulated rank's: one thread's stack is taken, the
size of a real rank's) and the exit (recorded instead of os._exit). One rank runs no watchdog at all: a rank
SIGSTOPped, as far as its peers can tell. Every other rank waits in the gradient all-reduce, as a job's ranks do
when one of them stopped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from hpc_ddp.bench import scale_parts
from hpc_ddp.ledger import verdict as ledger_verdict
from hpc_ddp.run.watch import beacon as phases
from hpc_ddp.run.watch import watchdog
from hpc_ddp.run.watch.beacon import Beacon

LIMIT_S = 2.0  # the simulated ranks' --hang-timeout-s: short, so that the bench measures what comes after it
STACK_BYTES = 512 * 1024  # each simulated rank's thread stack (thousands of threads)
HOST_RANKS = 8  # simulated ranks per simulated node (host names in the reports)


class _Rank(watchdog.Watchdog):
    """The kit's watchdog for one simulated rank: no faulthandler timer, a one-thread stack."""

    def _arm(self) -> None:  # one timer per process: the simulated ranks share one process
        pass

    def report(self, phase: str, step: int, stalled: float) -> dict[str, Any]:
        """The fields of Watchdog.report, with this thread's stack alone (its own would list every thread)."""
        return {
            "rank": self.who.rank,
            "host": self.who.host,
            "pid": self.who.peers[self.who.rank][1],
            "phase": phase,
            "step": step,
            "stalled_s": round(stalled, 1),
            "collective": phase in phases.COLLECTIVE,
            "user_frame": None,
            "stack": "".join(traceback.format_stack(sys._getframe())),
            "time": round(time.time(), 3),
        }


def _who(rank: int, n: int, peers: tuple[tuple[str, int], ...]) -> watchdog.Identity:
    return watchdog.Identity(rank, n, peers[rank][0], peers, "sim-0")


def hang(folder: Path, n: int, silent: int | None = None, deadline_s: float = 300.0) -> dict[str, Any]:
    """N ranks, `silent` (default: the middle one) without a watchdog; the others diagnose. Returns the seconds
    from the limit to hang.json and to every rank's exit, who the verdict names, and the files and bytes."""
    silent = n // 2 if silent is None else silent
    peers = tuple((f"node{r // HOST_RANKS:05d}", 100000 + r) for r in range(n))
    left: dict[int, float] = {}
    lock = threading.Lock()

    def leave(rank: int):
        def record(_code: int) -> None:
            with lock:
                left[rank] = time.monotonic()

        return record

    # A rank's look at its own DataLoader workers scans /proc (~10 ms): in parallel on a cluster's nodes, one
    # after another in this one process, where it would measure this machine, not the kit's protocol.
    looked, watchdog._add_worker_stacks = watchdog._add_worker_stacks, lambda mine: None
    old, err = threading.stack_size(STACK_BYTES), sys.stderr
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - every rank prints its stack there: thousands of them
    dogs = []
    try:
        for rank in range(n):
            if rank == silent:
                continue
            beacon = Beacon()
            beacon.state = (phases.GRAD_ALLREDUCE, 10, time.monotonic() + 1e6, False, None)  # not yet
            dog = _Rank(beacon, _who(rank, n, peers), folder, LIMIT_S, 600.0, list, None, leave(rank))
            dog.thread.name = f"sim-rank-{rank}"
            dogs.append(dog)
        started, cpu = time.monotonic(), time.process_time()
        for dog in dogs:
            dog.start()
        started = time.monotonic() - started
        begun = time.monotonic()  # every rank enters the all-reduce now: their limits run from here
        for dog in dogs:
            dog.beacon.state = (phases.GRAD_ALLREDUCE, 10, begun, False, None)
        limit_at = begun + LIMIT_S
        verdict_at, record = _wait_for_verdict(folder, begun + deadline_s)
        end = time.monotonic() + deadline_s
        for dog in dogs:
            dog.thread.join(timeout=max(0.0, end - time.monotonic()))
        cpu = time.process_time() - cpu
    finally:
        for dog in dogs:
            dog.stopped.set()
        threading.stack_size(old)
        watchdog._add_worker_stacks = looked
        sys.stderr.close()
        sys.stderr = err
    rounds = folder / watchdog.HANG_DIR
    files, size = scale_parts.tree(rounds)
    times = _report_times(rounds)
    hang_bytes = ledger_verdict.path(folder).stat().st_size if ledger_verdict.path(folder).exists() else 0
    return {
        "ranks": n,
        "silent": silent,
        "named": (record or {}).get("culprits"),
        "reason": (record or {}).get("reason"),
        "verdict_after_limit_s": None if verdict_at is None else round(verdict_at - limit_at, 2),
        "all_left_after_limit_s": round(max(left.values()) - limit_at, 2) if len(left) == n - 1 else None,
        "ranks_left": len(left),
        "threads_start_s": round(started, 2),
        # this process's CPU while the ranks ran, per rank: what each rank's own watchdog spends on a cluster
        "cpu_ms_per_rank": round(1000 * cpu / max(1, n - 1), 2),
        "reports_spread_s": round(max(times) - min(times), 2) if times else None,
        "report_files": files,
        "report_bytes": size,
        "hang_json_bytes": hang_bytes,
    }


def _wait_for_verdict(folder: Path, until: float) -> tuple[float | None, dict[str, Any] | None]:
    while time.monotonic() < until:
        record = ledger_verdict.read(folder)
        if record is not None:
            return time.monotonic(), record
        time.sleep(0.05)
    return None, None


def _report_times(root: Path) -> list[float]:
    """When each report was written (its own "time"): how long this machine took to write them all."""
    times = []
    for path in root.glob("*/*/rank-*.json"):
        try:
            times.append(float(json.loads(path.read_text())["time"]))
        except (OSError, ValueError, KeyError):
            continue
    return times
