"""The process group's lifecycle: create the store, join the group, tear it down on every path.

`process_group(env, device)` is a context manager: nccl when the rank's device is CUDA, gloo otherwise (or the
backend asked for), a configurable timeout, NCCL given the device up front (so it binds the right GPU and can
create communicators eagerly), and `destroy_process_group()` in `finally`, also when training raised.

Hangs: a rank waiting in a collective for a peer that died or never came shows nothing until the timeout, then
fails with an error that doesn't say *where* it waited. `hang_watch` arms `faulthandler` to write every thread's
Python stack to this rank's log shortly before the timeout and end the process (exit 1), so a hang can be read
afterwards and never outlives the timeout, even when the stuck thread holds the GIL (faulthandler's timer is a
C thread that needs no interpreter).

Teardown order: nothing that holds the group may outlive it. A DDP module's C++ Reducer owns a reference to the
group; freed after `destroy_process_group()`, it runs the gloo group's destructor at that moment, which can
deadlock on a mutex while holding the GIL (seen in the test suite: pytest stuck for good in
`~ProcessGroupGloo` under `~Reducer`). Objects that hold the group register with `hold()`; the teardown
collects garbage and refuses to destroy the group while any of them is still alive (`GroupLifetimeError`),
so the mistake is an error at once instead of a rare hang later. `Trainer.close()` releases its DDP first.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hpc_ddp.cluster import settings
from hpc_ddp.errors import ClusterConfigError

if TYPE_CHECKING:
    import torch

    from hpc_ddp.cluster.env import DistEnv


TEARDOWN_S = 60.0  # destroy_process_group() that takes longer than this is a hang: stacks, then exit 1

_holders: list[weakref.ref[Any]] = []


class GroupLifetimeError(RuntimeError):
    """An object that holds the process group (a DDP module) is still alive when the group is torn down."""


def hold(obj: Any) -> None:
    """Register `obj` (a DDP module) as holding the process group: it must be gone before the group is."""
    _holders.append(weakref.ref(obj))


def live_holders() -> list[Any]:
    """Registered group holders still alive after a garbage collection (reference cycles freed first)."""
    gc.collect()
    _holders[:] = [ref for ref in _holders if ref() is not None]
    return [obj for obj in (ref() for ref in _holders) if obj is not None]


def nccl_defaults(environ: Mapping[str, str], folder: str) -> dict[str, str]:
    """The NCCL/torch settings a user would want on GPU, for the variables the user did not set (pure):

    - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed or timed-out collective aborts the communicator and raises,
      instead of leaving the rank blocked in the CUDA stream;
    - TORCH_NCCL_TRACE_BUFFER_SIZE=2000: PyTorch's flight recorder keeps the last 2,000 collectives per rank;
    - TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<folder>/nccl-trace/rank: on a timeout
      each rank dumps that record into the run folder (a post-mortem beside the watchdog's hang.json)."""
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, "nccl-trace", "rank"),
    }
    return {k: v for k, v in wanted.items() if k not in environ}


def pick_backend(device: torch.device, requested: str | None = None) -> str:
    """nccl for CUDA ranks, gloo for CPU ranks, unless the user asked for one."""
    if requested:
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def watch_deadline(timeout_s: float) -> float:
    """When to dump stacks: a little before the collective timeout fires, so the dump lands first."""
    return max(1.0, timeout_s - min(30.0, 0.1 * timeout_s))


@contextmanager
def hang_watch(timeout_s: float) -> Iterator[None]:
    """If the block runs longer than about `timeout_s`: dump every thread's Python stack to stderr (the rank's
    log) and exit 1. Its deadline comes a little before the collective timeout, so the dump is never lost."""
    faulthandler.dump_traceback_later(watch_deadline(timeout_s), repeat=False, file=sys.stderr, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _store(env: DistEnv, timeout: timedelta):  # -> torch.distributed.Store
    """Rank 0 hosts the TCP store on MASTER_ADDR:MASTER_PORT; the others connect to it."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.is_main,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        text = str(e)
        if env.is_main and ("in use" in text or "EADDRINUSE" in text or "bind" in text.lower()):
            raise ClusterConfigError(
                f"rank 0 cannot listen on {env.master_addr}:{env.master_port} ({text.splitlines()[0]}). Another job "
                "on this node may hold the port. Fix: export MASTER_PORT=<a free port below 32768> for this run"
            ) from e
        raise ClusterConfigError(
            f"rank {env.rank} could not reach the rendezvous at {env.master_addr}:{env.master_port} within "
            f"{timeout.total_seconds():.0f} s ({text.splitlines()[0] if text else type(e).__name__}). Rank 0 may have "
            "failed to start, or the address resolves differently on this node. Check rank 0's log, and "
            "`python -m hpc_ddp.doctor` under the same launcher"
        ) from e


def _torchrun_store(env: DistEnv, timeout: timedelta):  # -> torch.distributed.Store
    """The store of this torchrun round: torch's env:// store, under a prefix of its own per round.

    torchrun's agent hosts one TCP store on MASTER_PORT for every round of a run (TORCHELASTIC_USE_AGENT_STORE;
    the c10d rendezvous shares it unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and env:// connects to it with
    no prefix per round. The keys of the round before stay there: after a restart, a rank that asks for its
    peer's gloo address before that peer has written the new one gets the dead round's address at once, and
    gloo's connectFullMesh fails with "connection refused" (a plain script that joins at once wins that race;
    a rank that prepares its run folder first loses it). The prefix names the round, so no round reads
    another's keys. Where rank 0 hosts the store itself (no agent store), each round's store is new anyway."""
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout))
    return dist.PrefixStore(f"hpc_ddp/round-{env.restart}", store)


@contextmanager
def process_group(
    env: DistEnv,
    device: torch.device,
    backend: str | None = None,
    timeout_s: float = 600.0,
    store: Any = None,
) -> Iterator[str]:
    """Join the job's process group for the duration of the block; yields the backend name.

    `store`: an existing torch.distributed Store to rendezvous through (the doctor's, which already holds
    MASTER_PORT) instead of creating one; give it a prefix of its own if others use it too."""
    import torch.distributed as dist

    name = pick_backend(device, backend)
    timeout = timedelta(seconds=timeout_s)
    if env.is_main:  # settings that only fail a large job: said on every start, the small ones first
        for line in settings.warnings(os.environ, env.world_size, name, timeout_s):
            print(f"hpc_ddp: warning: {line}", file=sys.stderr, flush=True)
    with hang_watch(timeout_s):
        if store is not None:
            kwargs: dict[str, Any] = {"store": store}
        elif env.launcher == "torchrun":
            kwargs = {"store": _torchrun_store(env, timeout)}
        else:
            kwargs = {"store": _store(env, timeout)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(name, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    try:
        yield name
    finally:
        _teardown()


def _teardown() -> None:
    """Destroy the group, after making sure nothing that holds it survives (see the module docstring)."""
    import torch.distributed as dist

    alive = live_holders()
    if alive:
        names = ", ".join(sorted({type(obj).__name__ for obj in alive}))
        # Destroying now would leave the holder to run the group's destructor later, where it can deadlock;
        # keeping the group is harmless in a task, which ends with os._exit.
        raise GroupLifetimeError(
            f"internal error: {names} still alive when the process group is torn down; "
            "the group is left in place to avoid a deadlock in its destructor. Close the "
            "Trainer (or drop the DDP module) before leaving process_group()"
        )
    if dist.is_initialized():
        with hang_watch(TEARDOWN_S):
            dist.destroy_process_group()
