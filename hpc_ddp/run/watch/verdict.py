"""The hang verdict: from the reports of the ranks that still answer, one line that names the culprit.

Pure: reports in, text and a record out (`run/watch/watchdog.py` gathers the reports through the run folder).
A report is what one rank says about itself once its watchdog fired: rank, host, pid, phase, step, seconds
in that phase, whether the phase is a collective (waiting for others), its innermost user frame and its
stacks. The rules, in order:

0. Ranks that answered that they are busy within their own limit (a long phase: a save, an evaluation's
   start; run/watch/watchdog.py), while every other rank reported too: no hang; the others wait for them.
1. Ranks that sent nothing within the collection window are unresponsive (stopped, frozen in native code
   holding the GIL, or their node is gone): they are the culprits.
2. Otherwise, when every rank (two or more) reported from the same line of the task's own code, in the same
   phase at the same step, none waiting in a collective: no rank and no node is to blame. The task's code is slow (or stuck)
   there on every rank, a periodic callback in `step` say; the line names it, and how to mark long work
   (hpc_ddp.long_work) or raise the limit.
3. Otherwise the ranks that are *not* waiting in a collective are the culprits (stuck in data loading, in
   forward and backward, in the optimizer, in a save); the ranks in a collective wait for them. One rank stuck
   alone is named at its limit, whatever its line.
4. Otherwise, every rank waits in a collective: if they wait in different ones (or at different steps) the
   collectives do not match and no single rank is to blame; if all wait in the same one, no rank is to
   blame either (a peer outside the job, the network).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpc_ddp import log


def ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> '0-2,4,6-7'."""
    return log.ranks_text(ranks, sep=",")


def _who(rank: int, host: str, pid: int | None) -> str:
    return f"rank {rank} ({host}, pid {pid})" if pid else f"rank {rank} ({host})"


def _where(frame: Mapping[str, Any] | None) -> str:
    if not frame:
        return ""
    return f'File "{frame["file"]}", line {frame["line"]}, in {frame["function"]}'


@dataclass
class _Seen:
    """What the reports say, sorted once for the rules."""

    by_rank: dict[int, Mapping[str, Any]]
    missing: list[int]  # ranks without a report: unresponsive
    waiting: list[int]  # ranks waiting in a collective
    working: list[int]  # ranks that are not
    step: int | None
    head: str  # "hang at step S: "
    record: dict[str, Any]

    def waiters(self, culprits: Sequence[int]) -> str:
        """ "; ranks 1-3 wait for it in <phases>", or nothing when no other rank waits."""
        others = [r for r in self.waiting if r not in culprits]
        if not others:
            return ""
        phases = sorted({str(self.by_rank[r]["phase"]) for r in others})
        who = f"rank {others[0]} waits" if len(others) == 1 else f"ranks {ranks_text(others)} wait"
        return f"; {who} for {'it' if len(culprits) == 1 else 'them'} in " + " / ".join(phases)

    def names(self, ranks: Sequence[int]) -> str:
        return ", ".join(_who(r, str(self.by_rank[r]["host"]), self.by_rank[r].get("pid")) for r in ranks)


def decide(
    reports: Sequence[Mapping[str, Any]], world_size: int, peers: Sequence[tuple[str, int]], window_s: float
) -> dict[str, Any]:
    """The verdict record: `line` (one line for humans), `culprits`, `unresponsive`, `waiting`, `phase` and
    `step` of the first culprit (what a requeue decision needs), and `reason` (which rule applied)."""
    by_rank = {int(r["rank"]): r for r in reports}
    missing = [r for r in range(world_size) if r not in by_rank]
    waiting = sorted(r for r, rep in by_rank.items() if rep["collective"])
    working = sorted(r for r, rep in by_rank.items() if not rep["collective"])
    steps = [int(r["step"]) for r in reports]
    step = min(steps) if steps else None
    head = f"hang at step {step}: " if step is not None else "hang: "
    record = {
        "step": step,
        "unresponsive": missing,
        "waiting": waiting,
        "culprits": [],
        "phase": None,
        "host": None,
    }
    seen = _Seen(by_rank, missing, waiting, working, step, head, record)
    return (
        _busy(seen)
        or _unresponsive(seen, peers, window_s)
        or _user_code(seen, reports, world_size)
        or _stuck(seen)
        or _all_waiting(seen, reports)
    )


def _busy(seen: _Seen) -> dict[str, Any] | None:
    """Rule 0: ranks busy within their own limit, every other rank reporting: no hang (yet)."""
    by_rank = seen.by_rank
    busy = sorted(r for r, rep in by_rank.items() if rep.get("busy"))
    if not busy or seen.missing:
        return None
    first = by_rank[busy[0]]
    wait_s = max(0.0, max(float(by_rank[r]["limit_s"]) - float(by_rank[r]["stalled_s"]) for r in busy))
    line = (
        f"no hang at step {seen.step}: {seen.names(busy)} {'is' if len(busy) == 1 else 'are'} in "
        f"{first['phase']} for {float(first['stalled_s']):.0f} s, within "
        f"{'its' if len(busy) == 1 else 'their'} limit of {float(first['limit_s']):.0f} s"
        f"{seen.waiters(busy)}; judged again in {wait_s:.0f} s"
    )
    return {**seen.record, "line": line, "reason": "busy", "busy": busy, "wait_s": round(wait_s, 1)}


def _unresponsive(seen: _Seen, peers: Sequence[tuple[str, int]], window_s: float) -> dict[str, Any] | None:
    """Rule 1: the ranks that sent nothing are the culprits."""
    missing = seen.missing
    if not missing:
        return None
    hosts = [peers[r][0] if r < len(peers) else "?" for r in missing]
    names = ", ".join(
        _who(r, h, peers[r][1] if r < len(peers) else None) for r, h in zip(missing, hosts, strict=True)
    )
    verb = "is" if len(missing) == 1 else "are"
    line = (
        f"{seen.head}{names} {verb} unresponsive: no report within {window_s:g} s (stopped, frozen in native "
        f"code, or its node is gone)" + seen.waiters(missing)
    )
    if seen.working:
        line += f". Also not waiting: ranks {ranks_text(seen.working)}"
    return {**seen.record, "culprits": missing, "reason": "unresponsive", "host": hosts[0], "line": line}


def _user_code(seen: _Seen, reports: Sequence[Mapping[str, Any]], world_size: int) -> dict[str, Any] | None:
    """Rule 2: two ranks or more at one line of the task's code (a single rank stuck alone is named, rule 3)."""
    same = {(str(r["phase"]), int(r["step"]), _where(r.get("user_frame"))) for r in reports}
    one_line = len(same) == 1 and _where(reports[0].get("user_frame"))
    if not (world_size > 1 and seen.working and not seen.waiting and one_line):
        return None
    phase, _, where = same.pop()
    stalled = max(float(r["stalled_s"]) for r in reports)
    line = (
        f"{seen.head}every rank ({world_size}) has been in {phase} for {stalled:.0f} s at the same line of the "
        f"task's code: {where}. No rank or node is to blame: that code is slow, or stuck, on every rank. "
        'Fix: mark long legitimate work with `with hpc_ddp.long_work("what", limit_s=...)`, or raise '
        "--hang-timeout-s"
    )
    frame = reports[0].get("user_frame")
    return {**seen.record, "reason": "user-code", "phase": phase, "user_frame": frame, "line": line}


def _stuck(seen: _Seen) -> dict[str, Any] | None:
    """Rule 3: the ranks not waiting in a collective are the culprits; the others wait for them."""
    working = seen.working
    if not working:
        return None
    first = seen.by_rank[working[0]]
    verb = "has" if len(working) == 1 else "have"
    line = (
        f"{seen.head}{seen.names(working)} {verb} been in {first['phase']} for "
        f"{float(first['stalled_s']):.0f} s" + seen.waiters(working)
    )
    where = _where(first.get("user_frame"))
    if where:
        line += f". Rank {first['rank']}'s stack: ... {where}"
    record = {**seen.record, "culprits": working, "reason": "stuck"}
    return {**record, "phase": first["phase"], "host": first["host"], "line": line}


def _all_waiting(seen: _Seen, reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Rule 4: every rank waits in a collective: in different ones (mismatched), or all in the same one."""
    spots = sorted({(str(r["phase"]), int(r["step"])) for r in reports})
    if len(spots) > 1:
        groups = "; ".join(
            f"ranks {ranks_text([r for r, rep in seen.by_rank.items() if (rep['phase'], rep['step']) == spot])}"
            f" in {spot[0]} at step {spot[1]}"
            for spot in spots
        )
        line = (
            f"{seen.head}no single rank is to blame: the ranks wait in different collectives ({groups}); a "
            "collective that only some ranks call (rank-dependent code) deadlocks like this"
        )
        return {**seen.record, "line": line, "reason": "mismatched"}
    line = (
        f"{seen.head}no single rank is to blame: every rank waits in {spots[0][0]} (a peer outside this job, "
        "or the network between the nodes)"
    )
    return {**seen.record, "line": line, "reason": "all-waiting"}
