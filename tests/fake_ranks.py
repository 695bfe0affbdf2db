"""Ranks without torch for the local launcher's supervision tests: `LocalJob(module="fake_ranks", ...)`.

Each rank does what FAKE_RANKS_DO says (one word), then exits; every start of rank 0 appends a line to the file
FAKE_RANKS_STARTS (its SLURM_RESTART_COUNT), so a test counts the launcher's restarts.

- `preempted`: rank 0 writes the preemption record the way a training rank 0 does (the signals ask for a
  requeue) while fewer than FAKE_RANKS_ASK_MAX (default 4) starts happened, then one that asks for none; every
  rank exits PREEMPTED. A launcher that restarts while the record asks, without a budget, starts 4 times.
- `fail`: rank 1 exits 1 once rank 0 has counted the start (a crash with no exit note); the others wait to be
  stopped.
- `peer_killed`: rank 1 dies by SIGKILL 0.3 s after rank 0 has already failed on it (gloo's "Connection closed
  by peer" exit note, exit 1): the order a poll can see under load, the survivor's exit before the killed peer's.
- `usage`: rank 0 prints a usage error's one line, as `python -m hpc_ddp.train` does, and exits 2.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from hpc_ddp import exitcodes
from hpc_ddp.ledger import exits, preemption


def main() -> int:
    rank = int(os.environ["SLURM_PROCID"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    folder = Path(os.environ["FAKE_RANKS_FOLDER"])
    what = os.environ["FAKE_RANKS_DO"]
    if rank == 0:
        with open(os.environ["FAKE_RANKS_STARTS"], "a") as f:
            f.write(f"{restart}\n")
    if what == "preempted":
        if rank == 0:
            ask = restart + 1 < int(os.environ.get("FAKE_RANKS_ASK_MAX", "4"))
            preemption.write(folder, preemption.Preempted(requeue=ask, signal="SIGUSR2", mode="exit", step=1))
        else:
            time.sleep(0.5)  # rank 0's record is written before the last rank is gone
        return exitcodes.PREEMPTED
    if what == "fail":
        if rank == 1:
            # Not before rank 0 has counted this start: else, on a loaded machine, the launcher stops rank 0
            # (rank 1 failed) before it writes its line, and the test counts one start too few.
            starts, deadline = Path(os.environ["FAKE_RANKS_STARTS"]), time.monotonic() + 30
            while not (starts.exists() and str(restart) in starts.read_text().split()):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            return exitcodes.FAILED
        time.sleep(60)
        return exitcodes.OK
    if what == "peer_killed":
        if rank == 0:
            error = RuntimeError(
                "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8110"
            )
            exits.note(folder, os.environ["SLURM_JOB_ID"], restart, 0, "127.0.0.1", error)
            print(f"RuntimeError: {error}", flush=True)
            return exitcodes.FAILED
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "usage":
        if rank == 0:
            print("python -m hpc_ddp.train: error: --lr -1: must be positive. Fix: --lr 0.1", flush=True)
            return exitcodes.USAGE
        time.sleep(60)
        return exitcodes.OK
    raise SystemExit(f"fake_ranks: FAKE_RANKS_DO={what!r}?")


if __name__ == "__main__":
    sys.exit(main())
