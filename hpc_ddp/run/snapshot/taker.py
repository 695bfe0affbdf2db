"""The loop's side of snapshots: every --snapshot-every-steps N steps, each rank's whole state into its node's
memory and a replica into its buddy's (hpc_ddp.run.snapshot).

The parts are the checkpoint's own (hpc_ddp.run.checkpoint.parts, through the Checkpointer: `parts` and `meta`), so a
snapshot holds exactly what a checkpoint holds and resumes the same way. On the training thread only the copy
out of the tensors happens (content.to_cpu, as the disk's async save does): that is the loop's stall. A thread
of the snapshot's own then serializes the copy, writes it (store.write: checksummed, renamed into place) and
swaps replicas with the buddies over a gloo group of its own (created once at start by every rank), so that
its messages never mix with the training thread's collectives. Every rank sends its buddy a length (0 when its
own write failed) and then its bytes, so the exchange is symmetric and never waits for a message that will not
come. A failed snapshot is said and skipped: the disk's checkpoints stay the run's record.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run.checkpoint import content
from hpc_ddp.run.checkpoint.part import Part
from hpc_ddp.run.snapshot import plan, store
from hpc_ddp.run.snapshot.options import memory_limit

JOIN_S = 60.0  # after the final save, the longest wait for the snapshot in flight (every peer is there)
CLOSE_S = 5.0  # on any other way out: a peer may be gone, and its replica is not worth a slower restart


class Taker:
    """One rank's snapshots: `due(step)`, `take(step)` on the training thread, `finish()` once the final save
    is durable (removes what this rank wrote), `close()` on every path."""

    def __init__(
        self,
        every: int,
        env: DistEnv,
        folder: Path,
        parts: Sequence[Part],
        meta: Callable[[], Mapping[str, Any]],
        log: RankLog,
        environ: Mapping[str, str],
        timeout_s: float,
    ) -> None:
        self.every, self.env, self.parts, self.meta, self.log = every, env, list(parts), meta, log
        self.job = env.job_id or f"pid{os.getppid()}"
        self.base = store.root(environ)
        self.dir = store.node_dir(self.base, self.job, env.node)
        self.key = store.run_key(folder)
        # Collectives, on every rank alike (every rank has the same --snapshot-every-steps).
        self.nodes: list[str] = [""] * env.world_size
        dist.all_gather_object(self.nodes, env.node)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.buddy = plan.buddies(self.nodes)
        self.senders = plan.senders(self.buddy, env.rank)
        self.thread: threading.Thread | None = None
        self.stalls: list[float] = []  # the training thread's time in each `take`
        self.waits: list[float] = []  # the part of it spent waiting for the previous snapshot's write
        self.writes: list[float] = []  # each snapshot's write and exchange, on its thread
        self.taken = 0
        self.buffers: Any = None  # the last copy: its tensors take the next one (`take`)
        self.fixed: dict[str, Any] = {}  # the checkpointer's meta (world size, config, version): constant

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    # ----- at start ---------------------------------------------------------------------------------------
    def check_memory(self, limit: str, trainable_bytes: int) -> int:
        """A collective: the memory one node's snapshots take (two generations of its ranks' own and of the
        replicas they keep), refused in one line over --snapshot-memory-limit. Returns the bytes."""
        own = sum(_nbytes(p.state_dict()) for p in self.parts)
        if not any(_nbytes(p.state_dict()) for p in self.parts if p.key == "optimizer"):
            own += 2 * trainable_bytes  # the optimizer's state comes with its first step (Adam: two moments)
        mine = own * (1 + len(self.senders)) * store.GENERATIONS
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, (self.env.node, mine, _available(self.base)))
        per_node: dict[str, int] = {}
        for node, need, _ in everyone:
            per_node[node] = per_node.get(node, 0) + need
        node, need = max(per_node.items(), key=lambda kv: kv[1])
        allowed = min(memory_limit(limit, avail) or 0 for _, _, avail in everyone)
        if need > allowed:
            raise UsageError(
                f"--snapshot-every-steps {self.every}: node {node}'s snapshots would take {_gib(need)} (two "
                f"generations of its ranks' states and of the replicas it keeps), over --snapshot-memory-limit "
                f"{limit} ({_gib(allowed)}). Fix: a larger --snapshot-memory-limit, more nodes, or "
                "--snapshot-every-steps 0"
            )
        return need

    # ----- every N steps ----------------------------------------------------------------------------------
    def take(self, step: int) -> float:
        """Copy this rank's state out of its tensors (the loop waits for this only), then write it and swap
        replicas in the background. Returns the stall in seconds."""
        began = time.monotonic()
        self.wait()  # at most one in flight: a slow snapshot holds the loop back, never piles up copies
        self.waits.append(time.monotonic() - began)
        state = {p.key: _local(p.state_dict()) for p in self.parts}
        # The first copy is made whole (and checked: what a checkpoint may hold); later ones are copied into
        # its tensors, free again once the previous snapshot is written: no fresh pages to fault in each time.
        copy = self.buffers = (
            _copy_into(state, self.buffers)
            if self.buffers is not None
            else content.to_cpu(state, "the snapshot")
        )
        meta = self.fixed = self.fixed or dict(self.meta())  # the same all run long: made once
        stall = time.monotonic() - began
        self.stalls.append(stall)
        self.thread = threading.Thread(
            target=self._write, args=(step, copy, meta), name="hpc_ddp-snapshot", daemon=True
        )
        self.thread.start()
        return stall

    def _write(self, step: int, copy: Any, meta: Mapping[str, Any]) -> None:
        began = time.monotonic()
        payload: bytes | memoryview = b""
        try:
            buffer = io.BytesIO()
            torch.save({"parts": copy, "meta": meta}, buffer)
            payload = buffer.getbuffer()
            store.rotate(self.dir, self.key, store.OWN, self.env.rank, store.GENERATIONS - 1)
            store.write(self.dir, self.key, self._header(store.OWN, self.env.rank, step), payload)
        except Exception as e:  # the disk's checkpoints are the record: said, and training goes on
            self.log.warn(f"snapshot of step {step} not written ({type(e).__name__}: {e}); training goes on")
            payload = b""
        try:
            self._swap(step, payload)
        except Exception as e:
            self.log.warn(f"snapshot of step {step}: the replicas were not exchanged ({e})")
        self.writes.append(time.monotonic() - began)
        self.taken += 1

    def _swap(self, step: int, payload: bytes | memoryview) -> None:
        """Send this rank's bytes to its buddy, keep the replicas of the ranks whose buddy it is."""
        buddy, group = self.buddy[self.env.rank], self.group
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in self.senders}
        requests = [dist.irecv(sizes[s], s, group=group) for s in self.senders]
        if buddy is not None:
            requests.append(dist.isend(torch.tensor([len(payload)], dtype=torch.int64), buddy, group=group))
        for request in requests:
            request.wait()
        got = {s: torch.empty(int(n.item()), dtype=torch.uint8) for s, n in sizes.items() if n.item()}
        requests = [dist.irecv(t, s, group=group) for s, t in got.items()]
        if buddy is not None and len(payload):
            requests.append(dist.isend(torch.frombuffer(payload, dtype=torch.uint8), buddy, group=group))
        for request in requests:
            request.wait()
        for sender, tensor in got.items():
            store.rotate(self.dir, self.key, store.COPY, sender, store.GENERATIONS - 1)
            header = {**self._header(store.COPY, sender, step), "node": self.nodes[sender]}
            store.write(self.dir, self.key, header, memoryview(tensor.numpy()))

    def _header(self, kind: str, rank: int, step: int) -> dict[str, Any]:
        return {
            "job": self.job,
            "node": self.env.node,
            "holder": self.env.node,
            "rank": rank,
            "step": step,
            "world_size": self.env.world_size,
            "kind": kind,
        }

    # ----- end of life ------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.thread = None

    def finish(self) -> dict[str, Any]:
        """The run's final save was made: once every rank is past it (a barrier over the snapshot's group: the
        full format's rank 0 writes while the others go on), this rank's snapshots are not needed any more;
        gone (what an earlier start left on this node too), with the node's and the job's folders once empty. Returns the summary for the record."""
        self.wait(JOIN_S)
        try:
            dist.barrier(group=self.group)
        except Exception as e:  # a peer is gone: keep them (the supervisor removes the job's at its end)
            self.log.warn(f"snapshots kept in {self.dir}: not every rank finished its final save ({e})")
            return self.summary()
        store.remove_run(self.dir, self.key)  # every rank of the node is past its final save
        return self.summary()

    def close(self) -> None:
        """Every path: the snapshot in flight ends (its peers may be gone: not waited for long). What was
        written stays for a restart; the supervisor removes the job's folder when the job ends."""
        self.wait(CLOSE_S)

    def summary(self) -> dict[str, Any]:
        """For the record: how many snapshots, the loop's mean stall and the background work's mean time."""
        n = len(self.stalls)
        return {
            "every": self.every,
            "taken": n,
            "stall_s": round(sum(self.stalls) / n, 6) if n else None,
            "waited_s": round(sum(self.waits) / n, 6) if n else None,
            "write_s": round(sum(self.writes) / len(self.writes), 6) if self.writes else None,
        }


def _local(obj: Any) -> Any:
    """A state with every DTensor (a sharded strategy's) replaced by this rank's shard: a snapshot is this
    rank's own, and its shard is what it loads back (recover.relocal)."""
    if hasattr(obj, "to_local") and isinstance(obj, torch.Tensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_local(v) for v in obj)
    return obj


def _copy_into(state: Any, previous: Any) -> Any:
    """`state` copied to CPU like content.to_cpu, into `previous`'s tensor of the same place, shape and dtype
    where there is one (the model's and the optimizer's: the bulk); anything else copied afresh."""
    if isinstance(state, torch.Tensor):
        if (
            isinstance(previous, torch.Tensor)
            and previous.shape == state.shape
            and previous.dtype == state.dtype
            and previous.device.type == "cpu"
        ):
            return previous.copy_(state.detach())
        return content.to_cpu(state)
    if isinstance(state, dict) and isinstance(previous, dict):
        return {k: _copy_into(v, previous.get(k)) for k, v in state.items()}
    if type(state) in (list, tuple) and type(previous) is type(state) and len(previous) == len(state):
        return type(state)(_copy_into(a, b) for a, b in zip(state, previous, strict=True))
    return content.to_cpu(state, "the snapshot")


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _available(base: Path) -> int:
    """What this node can hold: its available memory, and no more than the free space where the snapshots go
    (a tmpfs has a size of its own)."""
    import psutil

    free = psutil.virtual_memory().available
    probe = base
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    with contextlib.suppress(OSError):
        free = min(free, shutil.disk_usage(probe).free)
    return int(free)


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size / 4:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} bytes"


def for_run(cfg: Any, env: DistEnv, checkpointer: Any, model: torch.nn.Module, log: RankLog) -> Taker | None:
    """The run's snapshots (--snapshot-every-steps), checked against --snapshot-memory-limit on every rank
    (a collective), or None when off. The parts and the meta are the checkpointer's: what a checkpoint holds."""
    if not cfg.snapshot_every_steps:
        return None
    taker = Taker(
        cfg.snapshot_every_steps,
        env,
        checkpointer.folder,
        checkpointer.parts,
        checkpointer.meta,
        log,
        os.environ,
        cfg.timeout_s,
    )
    trainable = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
    need = taker.check_memory(cfg.snapshot_memory_limit, trainable)
    alone = "; one node: no buddy to keep a replica (a lost node falls back to the disk)"
    log.main(
        f"snapshots every {taker.every} step(s) in {taker.base}, {_gib(need)} a node at most"
        + (alone if taker.buddy[env.rank] is None else ", a replica on the next node")
    )
    return taker


def after_step(taker: Taker | None, step: int, skipped: bool) -> None:
    """The loop's hook after each step's decisions (and its periodic save): a snapshot when one is due, not
    while the newest update was skipped (--nonfinite-loss skip: as a save, it waits for a finite step)."""
    if taker is not None and taker.due(step) and not skipped:
        taker.take(step)
