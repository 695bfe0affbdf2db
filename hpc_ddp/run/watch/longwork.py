"""`hpc_ddp.long_work`: mark long legitimate work inside the task's own code for the hang watchdog.

A step that sometimes runs something long on every rank (a periodic callback, an extra evaluation, a dump to
slow storage) looks like a hang to the watchdog: every rank stays in "forward and backward" past the steady
limit (20 median step times, at least 60 s). The verdict then names that line of the task's code and blames no
node (run/watch/verdict.py), but the run still ends. Marked, it does not:

    import hpc_ddp

    def step(model, batch):
        loss = ...
        if my_counter.tick() % 1000 == 0:
            with hpc_ddp.long_work("the periodic sample dump", limit_s=900):
                dump_samples(model)
        return loss

While the block runs, the rank's phase is "the task's long work: <what>", a long phase whose limit is `limit_s`
(default: the start-up limit, half of --timeout-s). A peer that reaches its own limit while it waits for this
rank in a collective sees it answer that it is busy within its limit, and waits. --timeout-s still bounds how
long a collective may wait for a rank: a block longer than that on one rank only fails the collective, so give
such a run a larger --timeout-s. After the block the phase it interrupted goes on, its clock restarted. Outside
a run of the kit (no training loop in the process, a DataLoader worker) it marks nothing and runs the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hpc_ddp.run.watch import beacon as phases


@contextlib.contextmanager
def long_work(what: str, limit_s: float | None = None) -> Iterator[None]:
    """Run the block as the task's long work named `what`, judged by the hang watchdog against `limit_s`."""
    if limit_s is not None and not limit_s > 0:
        raise ValueError(f"long_work({what!r}, limit_s={limit_s}): a limit is a number of seconds > 0")
    beacon = phases.current()
    if beacon is None:
        yield
        return
    phase, step, _, long, limit = beacon.state
    beacon.set(f"{phases.USER_WORK}: {what}", step, long=True, limit_s=limit_s)
    try:
        yield
    finally:
        beacon.set(phase, step, long=long, limit_s=limit)
