"""Which snapshot a restart resumes from, and who gives each rank its state (pure, no torch).

Every rank of the new start reports what its node holds (store.inventory); every rank then decides the same
way from the same reports. The snapshot chosen is the newest step that every rank of the run can reach and
that is newer than the disk's checkpoint: rank r's state at that step must be on some node of the new start,
its own copy or a buddy's replica. Rank r reads it itself when its own node holds it (the surviving nodes);
otherwise the lowest rank on a node that holds it reads it and sends it (a replacement node's ranks). With no
such step the disk's checkpoint is used, as without snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hpc_ddp.run.snapshot.store import OWN, Held


class Report(NamedTuple):
    """One rank's report: its node, whether the node's folder exists, the whole snapshots there (the node's
    first rank reads and checks them for all of its ranks: the others report none)."""

    node: str
    exists: bool
    held: tuple[Held, ...]


class Choice(NamedTuple):
    step: int
    sources: tuple[int, ...]  # for rank r, the rank that reads r's state now (r itself: its own node has it)

    def from_buddies(self) -> list[int]:
        """The ranks whose state comes from another node (a replica, or a copy there)."""
        return [r for r, source in enumerate(self.sources) if source != r]


def choose(reports: Sequence[Report], disk_step: int) -> Choice | None:
    """The newest snapshot step every rank can reach, newer than `disk_step` (-1: no checkpoint), or None."""
    world = len(reports)
    node_holds: dict[str, set[tuple[int, int]]] = {}  # one rank of a node reports what the node holds
    for report in reports:
        node_holds.setdefault(report.node, set()).update(
            (h.rank, h.step) for h in report.held if h.world_size == world and 0 <= h.rank < world
        )
    holders: dict[tuple[int, int], list[int]] = {}  # (rank of the snapshot, step) -> ranks whose node has it
    for now, report in enumerate(reports):
        for held in node_holds[report.node]:
            holders.setdefault(held, []).append(now)
    steps = sorted({step for _, step in holders if step > disk_step}, reverse=True)
    for step in steps:
        reach = [holders.get((r, step), []) for r in range(world)]
        if all(reach):
            return Choice(step, tuple(r if r in ranks else min(ranks) for r, ranks in enumerate(reach)))
    return None


def lost_nodes(reports: Sequence[Report]) -> list[str]:
    """Nodes whose ranks wrote snapshots (named by the replicas elsewhere) but whose memory is gone: in this
    start, with no own snapshot there (its folder deleted or emptied: a node that lost its memory is not
    trusted, its ranks' replicas are used), or no longer in the start at all."""
    origins = {h.origin for r in reports for h in r.held if h.kind != OWN and h.origin}
    here = {r.node for r in reports}
    with_own = {r.node for r in reports if any(h.kind == OWN for h in r.held)}
    return sorted(o for o in origins if o not in with_own or o not in here)


def buddies(nodes: Sequence[str]) -> list[int | None]:
    """For each rank (its node in `nodes`), the rank that keeps its replica: the rank of the same place on
    the next node (cyclically, in the order the nodes first appear), so that losing one node never loses a
    rank's state and its replica together. None for every rank of a single node: there is no other memory."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    ranks_of = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    out: list[int | None] = []
    for rank, node in enumerate(nodes):
        place = ranks_of[node].index(rank)
        nxt = ranks_of[order[(order.index(node) + 1) % len(order)]]
        out.append(nxt[place % len(nxt)])
    return out


def senders(buddy: Sequence[int | None], rank: int) -> list[int]:
    """The ranks whose replica `rank` keeps."""
    return [r for r, b in enumerate(buddy) if b == rank]
