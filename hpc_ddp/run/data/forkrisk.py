"""Whether this Python can deadlock a forked DataLoader worker at its start, and the line that says so (pure).

CPython gh-112275: a child forked while another thread of the parent holds the interpreter's thread-state
lock (HEAD_LOCK) waits for it forever in `PyOS_AfterFork_Child`. A rank has threads (the watchdog, the
checkpoint writer, torch's and gloo's callbacks into Python), and DataLoader workers are forked from it, a
stream's at every epoch: measured here on Python 3.11.7, about one run in six of a 2-rank, 2-worker stream
test had a worker that never started. Nothing is lost (the hang watchdog names it after half of --timeout-s
and the run restarts from its checkpoint, bit for bit), but a run stalls for minutes, so it is said at start.
Fixed in 3.12 and in the later releases of the older branches that carry the fix (FIXED below)."""

from __future__ import annotations

# The first release of each branch with gh-112275's fix (3.11: its last bug-fix releases; 3.8-3.10: the
# security releases of September 2024). 3.12 and later have it.
FIXED = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}


def at_risk(version: tuple[int, int, int], implementation: str = "cpython") -> bool:
    """True for a CPython release before its branch's fix."""
    major, minor, micro = version
    if implementation != "cpython" or (major, minor) >= (3, 12):
        return False
    return micro < FIXED.get((major, minor), 10**6)


def note(version: tuple[int, int, int], workers: int, implementation: str = "cpython") -> str | None:
    """The start line for a rank with `workers` DataLoader workers on this Python, or None."""
    if workers <= 0 or not at_risk(version, implementation):
        return None
    major, minor, _ = version
    fixed = FIXED.get((major, minor))
    upgrade = f"Python {major}.{minor}.{fixed} or 3.12" if fixed is not None else "Python 3.12"
    return (
        f"Python {'.'.join(map(str, version))} can deadlock a forked DataLoader worker at its start (CPython "
        "gh-112275): the watchdog then restarts the run from its checkpoint after half of --timeout-s, "
        f"nothing lost. Fix: {upgrade}, or --num-workers 0"
    )
