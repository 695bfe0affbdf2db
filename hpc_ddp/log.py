"""Rank-aware output: every line flushed at once, lines from ranks other than 0 prefixed with their rank.

Slurm merges the stdout of all tasks into one file (or one per task with `%t`); without a prefix and an
immediate flush, lines from different ranks interleave and can't be attributed. Rank 0's lines carry no
prefix, so the default run reads like the article it comes from.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO


class RankLog:
    """Print for one rank. `info` is every rank's; `main` only rank 0's."""

    def __init__(self, rank: int, stream: TextIO | None = None) -> None:
        self.rank = rank
        self.stream = stream or sys.stdout
        self.prefix = "" if rank == 0 else f"[rank {rank}] "

    def info(self, message: str) -> None:
        """A line from this rank (prefixed unless rank 0)."""
        for line in message.splitlines() or [""]:
            self.stream.write(f"{_erase(self.stream)}{self.prefix}{line}\n")
        self.stream.flush()

    def main(self, message: str) -> None:
        """A line only global rank 0 prints (progress, results)."""
        if self.rank == 0:
            self.info(message)

    def warn(self, message: str) -> None:
        """A warning from this rank, to stderr."""
        sys.stderr.write(f"{_erase(sys.stderr)}{self.prefix}warning: {message}\n")
        sys.stderr.flush()


def _erase(stream: TextIO) -> str:
    """On a terminal, a line first erases rank 0's live progress line (hpc_ddp.run.records.metrics), which the cursor may
    be at the end of; elsewhere nothing."""
    try:
        return "\r\x1b[K" if stream.isatty() else ""
    except (AttributeError, ValueError):
        return ""


def count(n: int, one: str, many: str | None = None) -> str:
    """`n` and its noun, singular or plural: count(1, "thread") -> '1 thread', count(2, "thread") -> '2 threads'."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def ranks_text(ranks: Sequence[int], sep: str = ", ") -> str:
    """[0, 1, 2, 5] -> '0-2, 5': a rank (or CPU) list short enough for a 1000-rank job."""
    ordered, parts, i = sorted(set(ranks)), [], 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return sep.join(parts)


class TracebackFold:
    """What a person watching sees of a rank's traceback: one line (its last, the exception) naming the log
    that has all of it.

    When one rank fails, its peers fail after it with errors of their own (a closed connection), and a
    restarted attempt may fail again the same way: the supervisor shows the first cause's traceback itself,
    once (the local launcher, the batch shell's `end` step), so the local launcher's console and
    `submit --wait` fold the ranks' own tracebacks instead of repeating N copies of the same stacks."""

    _INSIDE = ("During handling of the above exception", "The above exception was the direct cause")

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.inside = False

    def feed(self, line: str) -> str | None:
        """The console's version of `line`: None while inside a traceback."""
        if line.startswith("Traceback (most recent call last):"):
            self.inside = True
            return None
        if not self.inside:
            return line
        if not line.strip() or line[:1].isspace() or line.startswith(self._INSIDE):
            return None
        self.inside = False
        return f"{line}  (traceback in {self.log_path})"
