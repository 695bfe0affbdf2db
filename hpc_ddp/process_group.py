"""The process group's lifecycle: create the store, join the group, tear it down on every path.

`process_group(env, device)` is a context manager: nccl when the rank's device is CUDA, gloo otherwise (or the
backend asked for), a configurable timeout, NCCL given the device up front (so it binds the right GPU and can
create communicators eagerly), and `destroy_process_group()` in `finally`, also when training raised.

Hangs: a rank waiting in a collective for a peer that died or never came shows nothing until the timeout, then
fails with an error that doesn't say *where* it waited. `hang_watch` arms `faulthandler` to write every thread's
Python stack to this rank's log shortly before the timeout, so a hang can be read afterwards.
"""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hpc_ddp.errors import ClusterConfigError

if TYPE_CHECKING:
    import torch

    from hpc_ddp.cluster import DistEnv


def pick_backend(device: "torch.device", requested: str | None = None) -> str:
    """nccl for CUDA ranks, gloo for CPU ranks, unless the user asked for one."""
    if requested:
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def watch_deadline(timeout_s: float) -> float:
    """When to dump stacks: a little before the collective timeout fires, so the dump lands first."""
    return max(1.0, timeout_s - min(30.0, 0.1 * timeout_s))


@contextmanager
def hang_watch(timeout_s: float) -> Iterator[None]:
    """Dump all Python stacks to stderr (the rank's log) if the block runs longer than about `timeout_s`."""
    faulthandler.dump_traceback_later(watch_deadline(timeout_s), repeat=False, file=sys.stderr, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _store(env: "DistEnv", timeout: timedelta):  # -> torch.distributed.Store
    """Rank 0 hosts the TCP store on MASTER_ADDR:MASTER_PORT; the others connect to it."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.is_main,
                             timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        text = str(e)
        if env.is_main and ("in use" in text or "EADDRINUSE" in text or "bind" in text.lower()):
            raise ClusterConfigError(
                f"rank 0 cannot listen on {env.master_addr}:{env.master_port} ({text.splitlines()[0]}). Another job "
                "on this node may hold the port. Fix: export MASTER_PORT=<a free port below 32768> for this run") from e
        raise ClusterConfigError(
            f"rank {env.rank} could not reach the rendezvous at {env.master_addr}:{env.master_port} within "
            f"{timeout.total_seconds():.0f} s ({text.splitlines()[0] if text else type(e).__name__}). Rank 0 may have "
            "failed to start, or the address resolves differently on this node. Check rank 0's log, and "
            "`python -m hpc_ddp.doctor` under the same launcher") from e


@contextmanager
def process_group(env: "DistEnv", device: "torch.device", backend: str | None = None,
                  timeout_s: float = 600.0) -> Iterator[str]:
    """Join the job's process group for the duration of the block; yields the backend name."""
    import torch.distributed as dist

    name = pick_backend(device, backend)
    timeout = timedelta(seconds=timeout_s)
    with hang_watch(timeout_s):
        if env.launcher == "torchrun":
            # torchrun's agent already hosts the store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE); env://
            # knows to connect to it instead of binding a second one.
            kwargs: dict[str, Any] = {"init_method": "env://"}
        else:
            kwargs = {"store": _store(env, timeout)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(name, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    try:
        yield name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
