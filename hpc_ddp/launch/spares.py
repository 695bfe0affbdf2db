"""Which nodes a job step runs on, inside an allocation that holds spare nodes (`--spare-nodes K`), pure.

A job with spares allocates N + K nodes and trains on N of them. When a step fails and the kit judges it a
failure worth another attempt (hpc_ddp.ledger.decision), the batch shell starts the next step inside the same
allocation instead of requeueing the job (hpc_ddp.launch.slurm.inplace): `after` says on which nodes.

- The nodes of the failed step that are neither blamed nor gone from the allocation stay (a code error blames
  no node: the next step runs on the same nodes, no spare spent).
- Each blamed or lost node is replaced by a spare: a node of the allocation that no step uses.
- No spare left: the step goes on with fewer nodes when `least` allows it (--min-nodes, with a sharded
  checkpoint resharded: hpc_ddp.launch.slurm.min_nodes), else there is no placement (None) and the job takes
  today's path (a requeue away from the blamed nodes, or a stop).

The batch shell's own node is the spare taken last (and is kept out of the first step when a spare allows):
losing it ends the job whatever runs there (Slurm's requeue then, hpc_ddp.launch.slurm.lost), while the
loss of any other node, rank 0's included, is survived in place: a step's rank 0 runs on its first node, and
every step picks its rendezvous host among its own nodes (hpc_ddp.cluster.env: SLURM_STEP_NODELIST).

Ranks follow the step's nodes in the allocation's order (Slurm's), `per_node` ranks on each: the step's first
node hosts rank 0 and its rendezvous, which hpc_ddp.cluster.env derives from the step's node list.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpc_ddp.ledger.decision import Placement as Placement  # a step's nodes: a fact the decision takes


def _ordered(nodes: Sequence[str], allocation: Sequence[str]) -> tuple[str, ...]:
    index = {n: i for i, n in enumerate(allocation)}
    return tuple(sorted(dict.fromkeys(nodes), key=lambda n: (index.get(n, len(index)), n)))


def _spares_first(candidates: Sequence[str], batch_host: str) -> list[str]:
    """Candidates in the order they are taken: the batch shell's node last."""
    return [n for n in candidates if n != batch_host] + [n for n in candidates if n == batch_host]


def first(allocation: Sequence[str], spares: int, batch_host: str = "") -> Placement:
    """The first step of an allocation: all its nodes but `spares` of them, the batch shell's node kept as a
    spare when there is one (pure). A spare count that leaves no node (an allocation already shrunk by
    --min-nodes) runs on every node: nothing is held back."""
    nodes = list(dict.fromkeys(allocation))
    wanted = len(nodes) - spares if 0 < spares < len(nodes) else len(nodes)
    chosen = _spares_first(nodes, batch_host)[:wanted]
    step = _ordered(chosen, nodes)
    return Placement(step, spares=tuple(n for n in nodes if n not in step))


def after(
    allocation: Sequence[str], ran_on: Sequence[str], blamed: Sequence[str], least: int, batch_host: str = ""
) -> Placement | None:
    """The next step after one on `ran_on` failed, inside an allocation that now holds `allocation` (Slurm
    removed the nodes it lost), with `blamed` the nodes blamed so far in this job: the same size with spares in
    place of what left; fewer nodes, down to `least`, when the spares ran out; None below that (pure)."""
    usable = [n for n in dict.fromkeys(allocation) if n not in blamed]
    kept = [n for n in ran_on if n in usable]
    left = tuple(n for n in ran_on if n not in kept)
    unused = [n for n in usable if n not in ran_on]
    taken = _spares_first(unused, batch_host)[: len(ran_on) - len(kept)]
    nodes = _ordered([*kept, *taken], allocation)
    if not nodes or len(nodes) < min(max(least, 1), len(ran_on)):
        return None
    return Placement(
        nodes,
        left=left,
        spares_in=_ordered(taken, allocation),
        spares=tuple(n for n in usable if n not in nodes),
    )


KILLED = "signal SIGKILL"  # hpc_ddp.launch.retry's signature of a rank killed by SIGKILL


def to_leave(blamed: Sequence[str], signature: str, node: str | None) -> tuple[str, ...]:
    """The blamed nodes the next step leaves out (pure): all of them, but the node of a rank SIGKILLed there.
    SIGKILL comes from outside the process (the OOM killer, a user's kill), not from the node's hardware: the
    node is blamed as ever (a requeue still avoids it) but the next step in the allocation spends no spare on
    it, and the same death again without a newer checkpoint is a crash loop that stops. A segfault or a bus
    error (bad memory, maybe) leaves its node out."""
    return tuple(n for n in blamed if not (signature == KILLED and n == node))
