"""Stragglers: one rank slower than the others sets the pace for all. Measure, compare, name.

Every rank splits its own step time into data (waiting for the next batch), compute (forward and backward
until its last gradient bucket is ready, the optimizer) and communication wait (what remains of the gradient
all-reduce after backward, plus the step's all-reduce). DDP overlaps the all-reduce with backward, so the
remaining wait is what a fast rank spends waiting for a slow one; it is not the slow rank's fault.

Every `EVERY_STEPS` optimizer steps (all ranks count the same steps, so they agree on the step without a
message) the ranks gather one fixed-size row each, [data, compute, comm, steps] summed over the window, in that
step's all-reduce (hpc_ddp.run.loop.agreed: each rank's row in its own slot of zeros). Every rank then judges the
same numbers the same way (`judge`); rank 0 reports.

The rule: a rank's own work per step is data + compute. It is slow in a window when its own work exceeds the
median rank's by more than `FACTOR` times and by more than `MIN_EXCESS_S` (noise on a shared machine). It is
named a straggler once it was slow in `WINDOWS` consecutive windows; the phase named is the part (data or
compute) that exceeds the median the most. A healthy run, where every rank does about the same work, names
nobody.

A window is judged only once it holds at least `MIN_WINDOW_S` of the median rank's own work: the gathered rows
of shorter ones are added up until it does. Steps of a few milliseconds (the quick start's) are as long as the
operating system's scheduling hiccups on a shared machine, and a rank descheduled twice looks twice as slow;
over half a second of work such a hiccup is lost in the sum, while a real straggler stays slow. So a run with
less than WINDOWS x MIN_WINDOW_S of work per rank is too short to judge, and names nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EVERY_STEPS = 5
FACTOR = 1.5
MIN_EXCESS_S = 0.002
WINDOWS = 2
MIN_WINDOW_S = 0.5  # the median rank's own work (data + compute) a judged window holds at least
ROW = 4  # data_s, compute_s, comm_s, steps


@dataclass(frozen=True)
class Straggler:
    rank: int
    phase: str  # "data loading" or "forward and backward"
    own_s: float  # this rank's data + compute per step
    median_s: float

    @property
    def slower(self) -> float:
        return self.own_s / self.median_s if self.median_s > 0 else float("inf")


class Window:
    """This rank's time split, summed since the last check."""

    def __init__(self) -> None:
        self.data_s = self.compute_s = self.comm_s = 0.0
        self.steps = 0

    def row(self) -> list[float]:
        return [self.data_s, self.compute_s, self.comm_s, float(self.steps)]

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return 0.0 if n == 0 else (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2)


def slow_ranks(rows: Sequence[Sequence[float]]) -> list[Straggler]:
    """Ranks slow in this window (pure). rows[r] = [data_s, compute_s, comm_s, steps] of rank r."""
    per_step = [(d / s, c / s) if s else (0.0, 0.0) for d, c, _, s in rows]
    own = [d + c for d, c in per_step]
    median = _median(own)
    median_data = _median([d for d, _ in per_step])
    median_compute = _median([c for _, c in per_step])
    slow = []
    for rank, (data, compute) in enumerate(per_step):
        if own[rank] > FACTOR * median and own[rank] - median > MIN_EXCESS_S:
            phase = (
                "data loading" if data - median_data >= compute - median_compute else "forward and backward"
            )
            slow.append(Straggler(rank, phase, own[rank], median))
    return slow


class Judge:
    """Counts consecutive slow windows per rank; names a rank once, when it reaches `WINDOWS`. Rows that hold
    less than `min_window_s` of the median rank's own work wait for the next ones (see the module docstring)."""

    def __init__(self, min_window_s: float = MIN_WINDOW_S) -> None:
        self.min_window_s = min_window_s
        self.pending: list[list[float]] | None = None  # the rows gathered since the last judged window
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()

    def add(self, rows: Sequence[Sequence[float]]) -> list[Straggler]:
        pending = self.pending
        if pending is not None and len(pending) == len(rows):
            rows = [
                [a + b for a, b in zip(old, new, strict=True)] for old, new in zip(pending, rows, strict=True)
            ]
        if _median([d + c for d, c, _, _ in rows]) < self.min_window_s:
            self.pending = [list(row) for row in rows]
            return []
        self.pending = None
        slow = {s.rank: s for s in slow_ranks(rows)}
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        new = [s for r, s in slow.items() if self.streak[r] >= WINDOWS and r not in self.named]
        self.named.update(s.rank for s in new)
        return new


def describe(s: Straggler, host: str, step: int) -> str:
    return (
        f"straggler at step {step}: rank {s.rank} ({host}) is {s.slower:.1f}x slower than the median rank "
        f"in {s.phase} ({s.own_s * 1000:.1f} ms of its own work per step vs {s.median_s * 1000:.1f} ms); every "
        "rank waits for it at each all-reduce"
    )
