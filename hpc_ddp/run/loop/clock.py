"""Where a step's time goes: the beacon's phase for the hang watchdog, and the straggler window's split.

The loop says which phase it enters (`data`, `compute`, `backward_done`, `all_reduce`, `optimizer`,
`step_done`); the clock sets the beacon (run/watch/beacon.py) and adds each phase's time to this rank's window
(run/watch/stragglers.py): data (waiting for the next batch), compute (forward and backward until the last gradient
bucket is ready, the optimizer) and communication wait (what remained of the gradient all-reduce after
backward, plus the step's all-reduce). Every phase of a process's first step is long for the watchdog: it pays
warm-up, lazy initialisation and a resumed checkpoint's first use.

`with clock.task:` marks the task's own work in a step (forward, backward, the update): what a hand-written loop
does too. The rest of the step, less its wait for data, is the kit's own work, which the end record gives per
step (`kit_us_per_step`; `python -m hpc_ddp.bench overhead` holds it to a budget). Two clock reads a block.

Every `stragglers.EVERY_STEPS` steps the ranks compare their windows: each one's rides in that step's packet
(`rows`; hpc_ddp.run.loop.agreed), no collective of its own. An unwatched rank (a `NullBeacon`: the bench's
baseline) neither marks the end of backward nor compares.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.watch import beacon as phase
from hpc_ddp.run.watch import stragglers
from hpc_ddp.run.watch.beacon import Beacon


class StepClock:
    def __init__(self, beacon: Beacon) -> None:
        self.beacon = beacon
        self.window = stragglers.Window()  # this rank's time split since the last straggler check
        self.judge = stragglers.Judge()
        self.first_step = True  # this process's first optimizer step (after a start or a resume)
        self.data_s = 0.0  # this step's wait for data (rank 0 records it)
        self.task_s = 0.0  # this step's time in the task's own work (`with clock.task:`)
        self.task = _Task(self)
        self.kit = _Task(
            self, -1.0
        )  # inside a `task` block: the kit's own work, taken out of the task's time
        # The gradient norm the step records compute without --clip-grad (issue 46): the kit's own work, also
        # counted apart (`norm_s`), so that the bench can say what that one reduction costs and what the rest does.
        self.norm = _Task(self, -1.0, apart=True)
        self.norm_s = 0.0  # this step's time in `norm`
        self.grads_ready = 0.0  # when backward's last gradient bucket was ready (the comm wait starts)
        self._since = 0.0  # when the current phase of the step began
        self._ready = 0.0

    @property
    def watched(self) -> bool:
        return self.beacon.watched

    def timed(self, batches: Iterator[Any], pos: Position) -> Iterator[Any]:
        """`batches`, each fetched in the "data loading" phase of the step in the making (after `pos`), and
        timed. The first batch of an epoch is long for the watchdog: the loader's workers start (and open their
        data)."""
        first = True
        while True:
            start = self.beacon.set(phase.DATA, pos.step + 1, long=first or self.first_step)
            first = False
            try:
                batch = next(batches)
            except StopIteration:
                return
            waited = time.monotonic() - start
            self.window.data_s += waited
            self.data_s += waited
            yield batch

    def compute(self, step: int | None = None) -> None:
        """A micro-batch's forward and backward begin."""
        self._since = self.beacon.set(phase.COMPUTE, step, long=self.first_step)
        self.grads_ready = 0.0

    def computing(self) -> None:
        """Forward and backward again, after a fetch inside them (a stream's next step) set "data loading"."""
        self.beacon.set(phase.COMPUTE, long=self.first_step)

    def mark_grads_ready(self) -> None:
        """Backward has computed every gradient (the strategy's end-of-backward callback, watched ranks only)."""
        self.grads_ready = self.beacon.set(phase.GRAD_ALLREDUCE, long=self.first_step)

    def micro_done(self) -> None:
        """A micro-batch that is not the step's last is done (its gradients stay local)."""
        self.window.compute_s += time.monotonic() - self._since

    def backward_done(self) -> None:
        """The step's last backward returned: its gradients are synchronised."""
        self._ready = self.grads_ready or time.monotonic()  # no end-of-backward mark: an unwatched rank

    def all_reduce(self) -> None:
        """The step's own all-reduce begins; what came since backward's end was communication wait."""
        now = self.beacon.set(phase.STEP_ALLREDUCE, long=self.first_step)
        self.window.compute_s += self._ready - self._since
        self.window.comm_s += now - self._ready
        self._since = now

    def optimizer(self) -> None:
        start = self.beacon.set(phase.OPTIMIZER, long=self.first_step)
        self.window.comm_s += start - self._since
        self._since = start

    def step_done(self) -> None:
        self.window.compute_s += time.monotonic() - self._since
        self.window.steps += 1
        self.first_step = False

    def rows(self, step: int, env: DistEnv) -> list[float]:
        """What step `step` carries of the straggler windows in its packet (hpc_ddp.run.loop.agreed): every
        `stragglers.EVERY_STEPS` steps with more than one watched rank, this rank's window in its own slot of a
        row of zeros for every rank (the window starts anew); none otherwise. Taken before the step's first
        micro-batch: a window holds whole steps."""
        if step % stragglers.EVERY_STEPS or env.world_size < 2 or not self.watched:
            return []
        rows = [0.0] * (stragglers.ROW * env.world_size)
        rows[env.rank * stragglers.ROW : (env.rank + 1) * stragglers.ROW] = self.window.row()
        self.window.reset()
        return rows


class _Task:
    """`with clock.task:`: the block's time is the task's own work (`sign` -1: `clock.kit`, a block of the kit's
    own inside one of the task's). One object per clock, reused (no allocation per step)."""

    __slots__ = ("apart", "clock", "sign", "start")

    def __init__(self, clock: StepClock, sign: float = 1.0, apart: bool = False) -> None:
        self.clock, self.sign, self.start, self.apart = clock, sign, 0.0, apart

    def __enter__(self) -> None:
        self.start = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self.start
        self.clock.task_s += self.sign * elapsed
        if self.apart:  # `clock.norm`: counted on its own too
            self.clock.norm_s += elapsed
