"""Which rank's end caused the others' (the local launcher's first cause, before it stops anyone).

When a rank dies, its peers fail on it a moment later (gloo's "Connection closed by peer"). The launcher polls
the ranks in rank order, and under load it can reap a survivor's exit before the dead peer's: a killed
process's teardown (its memory, its threads) can outlast the survivor's error. Judged then, the survivor's
consequence would be recorded as the cause and no node blamed. So a first failure whose exit note says a peer
vanished waits a moment for that peer to be seen, and the ranks that died by a signal the launcher did not send
are named before the launcher's own SIGTERM/SIGKILL make every rank look killed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hpc_ddp.ledger import judge

# How long a rank that failed on a vanished peer waits for that peer's own end to be seen.
SETTLE_S = 2.0


class _Proc(Protocol):
    def poll(self) -> int | None: ...


class _Rank(Protocol):
    rank: int
    proc: _Proc


def on_a_vanished_peer(notes: Sequence[Mapping[str, Any]], rank: int) -> bool:
    """Did `rank` fail only because a peer vanished, by its exit note (written before it exits)?"""
    return any(
        n.get("rank") == rank and judge.secondary(f"{n.get('type')}: {n.get('message')}") for n in notes
    )


def seen_dead(
    ranks: Sequence[_Rank], first: int, notes: Sequence[Mapping[str, Any]]
) -> tuple[tuple[int, str], ...]:
    """(rank, signal name) of the ranks dead by a signal, after `first` failed (and, when it failed on a vanished
    peer, once that peer is seen: settle). Called before the launcher signals any rank: none of these is its."""
    settle(notes, first, ranks)
    return killed_on_their_own(ranks)


def settle(
    notes: Sequence[Mapping[str, Any]], first: int, ranks: Sequence[_Rank], wait_s: float = SETTLE_S
) -> None:
    """`first` failed on a vanished peer: wait up to `wait_s` until another rank is seen dead by a signal, or
    every other rank has ended. Returns at once for any other failure (its own error: the others are stopped)."""
    if not on_a_vanished_peer(notes, first):
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        others = [r.proc.poll() for r in ranks if r.rank != first]
        if any(c is not None and c < 0 for c in others) or all(c is not None for c in others):
            return
        time.sleep(0.02)


def killed_on_their_own(ranks: Sequence[_Rank]) -> tuple[tuple[int, str], ...]:
    """(rank, signal name) of the ranks already dead by a signal, in rank order (called before the launcher
    sends any: so none of these is the launcher's)."""
    return tuple(
        (r.rank, judge.signal_name(-code)) for r in ranks if (code := r.proc.poll()) is not None and code < 0
    )
