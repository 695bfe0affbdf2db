"""A trial's outcome in a row of the sweep's table (pure but for reading its folder): its state, steps, final and
best loss, attempts, the first cause of its failure, and the exit code it counts for (`--wait` and the report).

The loss is what every run records (metrics.jsonl's step records, rank 0's); a line a killed writer left cut is
skipped, as every reader of the file does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp import exitcodes
from hpc_ddp.launch.sweep import state
from hpc_ddp.ledger import outcomes
from hpc_ddp.run.folder import METRICS


@dataclass(frozen=True)
class Losses:
    steps: int | None = None  # the last step recorded
    final: float | None = None
    best: float | None = None
    curve: tuple[tuple[int, float], ...] = ()  # (step, loss) of every step record


def losses(lines: Iterable[str]) -> Losses:
    """The loss curve of metrics.jsonl's lines (pure)."""
    curve: list[tuple[int, float]] = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        loss, step = (record.get("loss"), record.get("step")) if isinstance(record, dict) else (None, None)
        if record.get("event") == "step" and isinstance(step, int) and isinstance(loss, (int, float)):
            if math.isfinite(loss):
                curve.append((step, float(loss)))
    if not curve:
        return Losses()
    return Losses(curve[-1][0], curve[-1][1], min(loss for _, loss in curve), tuple(curve))


def read_losses(folder: Path) -> Losses:
    try:
        with open(folder / METRICS, errors="replace") as f:
            return losses(f)
    except OSError:
        return Losses()


def exit_code(now: state.TrialState) -> int:
    """The exit code a trial counts for in the sweep's (pure): a finished trial 0, a failed one its outcome's,
    one that stopped to resume later PREEMPTED, one that never started training FAILED."""
    if now.state == state.FINISHED:
        return exitcodes.OK
    if now.state == state.FAILED:
        return outcomes.exit_code(now.outcome)
    if now.state == state.UNFINISHED and now.outcome in (outcomes.PREEMPTED, outcomes.STOPPED):
        return exitcodes.PREEMPTED
    return exitcodes.FAILED


# Worst first: the exit code of a sweep is that of its most serious trial.
SERIOUS = (
    exitcodes.USAGE,
    exitcodes.FAILED,
    exitcodes.HANG,
    exitcodes.NONFINITE,
    exitcodes.INTERRUPTED,
    exitcodes.PREEMPTED,
    exitcodes.OK,
)


def most_serious(codes: Sequence[int]) -> int:
    """The exit code of the most serious of `codes` (pure; an unknown code counts as FAILED; none: OK)."""
    known = [c if c in SERIOUS else exitcodes.FAILED for c in codes]
    return min(known, key=SERIOUS.index, default=exitcodes.OK)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


HEAD = ("trial", "state", "steps", "final loss", "best loss", "attempts", "first cause")


def row(name: str, now: state.TrialState, seen: Losses) -> tuple[str, ...]:
    steps = seen.steps if seen.steps is not None else now.step
    return (
        name,
        now.state if not now.outcome or now.state == state.FINISHED else f"{now.state} ({now.outcome})",
        "-" if steps is None else str(steps),
        _number(seen.final),
        _number(seen.best),
        str(now.attempts),
        now.cause or "-",
    )


def table(rows: Iterable[tuple[str, ...]]) -> str:
    """Plain columns, as a terminal shows them."""
    rows = [HEAD, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip()
        for r in rows
    )
