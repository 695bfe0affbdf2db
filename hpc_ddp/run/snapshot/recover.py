"""The restart's side of snapshots: resume from memory when every rank can reach a snapshot newer than the
disk's checkpoint (hpc_ddp.run.snapshot.plan decides; this gathers the reports and follows the plan).

A collective, on every rank of a restart (a first start never reads a snapshot: a new job has its own folder,
and a start that is no restart resumes what --resume says). Each rank reports the whole snapshots of its own
node's folder; the plan names, for every rank, who reads its state: itself (its node kept it) or the lowest
rank on a node that holds it (a buddy's replica, or the copy a node holds of another's), which sends the bytes
over the snapshot's gloo group. The state is loaded into the same parts a checkpoint loads into
(Checkpointer.restore), so that a resume from memory is a resume from a checkpoint of that step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.run.checkpoint.part import SHARDED, Part
from hpc_ddp.run.records import reached
from hpc_ddp.run.snapshot import plan, store
from hpc_ddp.run.snapshot.taker import Taker


@dataclass
class Resumed:
    """Where a restart resumed from: "memory" (a snapshot) or "disk", and what it cost."""

    source: str
    step: int
    lost_steps: int | None = None  # the previous attempt's last step, minus this one (None: unknown)
    own: int = 0  # ranks that read their state from their own node's memory
    from_buddies: list[int] = field(default_factory=list)  # ranks whose state came from another node
    lost_nodes: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {
            "from": self.source,
            "step": self.step,
            "lost_steps": self.lost_steps,
            "own": self.own,
            "from_buddies": self.from_buddies,
            "lost_nodes": self.lost_nodes,
        }

    def describe(self) -> str:
        where = f"{self.own} rank(s) from their own node's memory" + (
            f", rank(s) {', '.join(map(str, self.from_buddies))} from a buddy's replica"
            if self.from_buddies
            else ""
        )
        lost = "" if self.lost_steps is None else f", {self.lost_steps} step(s) lost"
        return f"Resuming from memory: the snapshot of step {self.step} ({where}{lost})"


class _Opened:
    """A snapshot read back, as a checkpoint's `Opened`: every part's state is this rank's own. A sharded
    part's shards (saved as this rank's local tensors: taker._local) become the DTensors the strategy lays
    out again, from its own state now (the template: asked on every rank, in the parts' order)."""

    def __init__(self, data: Any) -> None:
        self.meta, self.parts = data["meta"], data["parts"]

    def state_of(self, part: Part, rank: int) -> Any:
        saved = self.parts.get(part.key)
        return _relocal(saved, part.state_dict()) if part.kind == SHARDED and saved is not None else saved


def _relocal(saved: Any, template: Any) -> Any:
    """`saved` with each tensor the template holds as a DTensor made that DTensor again (same mesh,
    placements, global shape and stride; this rank's shard on the template's device)."""
    if (
        isinstance(saved, torch.Tensor)
        and isinstance(template, torch.Tensor)
        and hasattr(template, "to_local")
    ):
        from torch.distributed.tensor import DTensor

        local = saved.to(template.to_local().device)
        mesh, placements = template.device_mesh, template.placements
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=template.shape, stride=template.stride()
        )
    if isinstance(saved, dict) and isinstance(template, dict):
        return {k: _relocal(v, template.get(k)) for k, v in saved.items()}
    if type(saved) in (list, tuple) and isinstance(template, (list, tuple)) and len(saved) == len(template):
        return type(saved)(_relocal(a, b) for a, b in zip(saved, template, strict=True))
    return saved


def find(taker: Taker, disk_step: int, folder: Path) -> tuple[Resumed, Any]:
    """A collective: the snapshot this restart resumes from and this rank's state of it, or Resumed("disk")
    and None (the disk's checkpoint, as without snapshots). Every rank reaches the same verdict."""
    env, log = taker.env, taker.log
    # One rank a node reads and checks the node's snapshots (every byte: a torn one is never offered).
    held = store.inventory(taker.dir, taker.key, taker.job, log.warn) if env.local_rank == 0 else []
    mine = plan.Report(env.node, taker.dir.is_dir(), tuple(held))
    reports: list[Any] = [None] * env.world_size
    dist.all_gather_object(reports, mine)
    reports = [plan.Report(r.node, r.exists, tuple(store.Held(*h) for h in r.held)) for r in reports]
    lost = plan.lost_nodes(reports)
    if lost:
        log.main(f"snapshots: the memory of {', '.join(lost)} is gone (not trusted): their replicas are used")
    choice = plan.choose(reports, disk_step)
    if choice is None:
        return Resumed("disk", max(disk_step, 0), lost_nodes=lost), None
    node = next((r.held for r in reports if r.node == env.node and r.held), ())  # its first rank's report
    payload = _follow(taker, choice, list(node))
    data = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    previous = reached.read(folder) if env.is_main else None
    lost_steps = None if previous is None else max(0, previous[0] - choice.step)
    buddies = choice.from_buddies()
    found = Resumed("memory", choice.step, lost_steps, env.world_size - len(buddies), buddies, lost)
    return found, _Opened(data)


def _follow(taker: Taker, choice: plan.Choice, held: list[store.Held]) -> bytes | memoryview:
    """Read what this rank must read, send what it must send, receive its own state if another rank reads
    it: every message posted before any is waited for, so no order of ranks can deadlock."""
    rank, group = taker.env.rank, taker.group
    mine: bytes | memoryview = b""
    sends: list[tuple[int, bytes]] = []
    for r, source in enumerate(choice.sources):
        if source != rank:
            continue
        path = next(
            h.path
            for h in sorted(held, key=lambda h: h.kind != store.OWN)
            if (h.rank, h.step) == (r, choice.step)
        )
        _, payload = store.read(path)
        if r == rank:
            mine = payload
        else:
            sends.append((r, payload))
    source = choice.sources[rank]
    size = torch.zeros(1, dtype=torch.int64)
    requests = [dist.isend(torch.tensor([len(p)], dtype=torch.int64), r, group=group) for r, p in sends]
    if source != rank:
        requests.append(dist.irecv(size, source, group=group))
    for request in requests:
        request.wait()
    got = torch.empty(int(size.item()), dtype=torch.uint8)
    requests = [
        dist.isend(torch.frombuffer(bytearray(p), dtype=torch.uint8), r, group=group) for r, p in sends
    ]
    if source != rank:
        requests.append(dist.irecv(got, source, group=group))
    for request in requests:
        request.wait()
    return memoryview(got.numpy()) if source != rank else mine


def resume(trainer: Any, start: Path | None) -> Resumed | None:
    """Every rank of a restart with snapshots on: load the snapshot found (`find`) when it is newer than the
    disk's checkpoint `start` (None: none yet), and say where the restart resumes from. None when snapshots
    are off or this is a first start; a Resumed("disk") when the disk's checkpoint stands (the caller loads
    it, as without snapshots)."""
    from hpc_ddp.run.checkpoint import store as disk

    taker = trainer.snapshots
    if taker is None or not trainer.env.is_restart:
        return None
    disk_step = disk.ckpt_step(start) if start is not None else -1
    found, opened = find(taker, disk_step, trainer.folder)
    if opened is None:
        previous = reached.read(trainer.folder) if trainer.env.is_main else None
        found.lost_steps = None if previous is None else max(0, previous[0] - found.step)
        return found
    label = Path(f"{taker.dir}/snapshot of step {found.step}")
    trainer.notes = trainer.checkpointer.restore(opened, label, type(trainer.checkpointer.format))
    return found
