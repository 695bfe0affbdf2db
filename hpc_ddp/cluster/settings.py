"""torch's settings that only hurt at scale, checked at every start (pure): docs/scale.md says why each.

A wrong one costs nothing on 2 nodes and fails a 1,000-node job after its queue wait, in its first minutes, so
rank 0 says it on the first small run instead (`warnings`, printed once as `hpc_ddp: warning: ...`):

- TORCH_DIST_INIT_BARRIER=1: init_process_group then waits in a barrier through the TCP store, every rank
  polling one key: "unscalable. Large jobs today fail because of it" (pytorch PR #99937); torch's default is 0.
- USE_LIBUV=0: torch's old TCP store backend, which timed out after 30 min at 96k ranks where libuv took 100 s
  (PyTorch's TCPStore libuv tutorial). The kit's own store is always libuv; a torchrun rendezvous follows this.
- TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (or the old NCCL_ASYNC_ERROR_HANDLING=0) on NCCL: a failed or timed-out
  collective leaves its rank blocked in the CUDA stream instead of aborting the communicator; at 8,000 GPUs one
  bad link then holds the job until the hang watchdog ends it (the kit sets 1 when unset).
- --timeout-s below what the group's start takes at that size: the timeout bounds the rendezvous and the first
  collective too, and gloo's init of 8k ranks took 85 s even after its fix (pytorch/gloo PR #408): at 1,024
  ranks or more, a timeout under `MIN_TIMEOUT_S` fails the start before anything hung.
"""

from __future__ import annotations

from collections.abc import Mapping

LARGE_RANKS = 1024  # from here on, the start of the group itself takes minutes
MIN_TIMEOUT_S = 300.0  # at LARGE_RANKS or more: the group's own start fits several times over


def warnings(environ: Mapping[str, str], world_size: int, backend: str, timeout_s: float) -> list[str]:
    """One line per setting that would fail or slow a job at scale (pure)."""
    found = []
    if environ.get("TORCH_DIST_INIT_BARRIER", "0").strip() not in ("", "0"):
        found.append(
            "TORCH_DIST_INIT_BARRIER=1: the process group's start waits in a barrier through the TCP store, "
            "which fails large jobs (pytorch #99937). Fix: unset it (torch's default is 0)"
        )
    if environ.get("USE_LIBUV", "1").strip() == "0":
        found.append(
            "USE_LIBUV=0: torch's old TCP store backend timed out at scale where libuv took 100 s (96k ranks). "
            "Fix: unset USE_LIBUV"
        )
    if backend == "nccl":
        for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
            if environ.get(name, "").strip() == "0":
                found.append(
                    f"{name}=0: a failed NCCL collective leaves its rank blocked instead of raising; at scale one "
                    f"bad link holds every GPU of the job until the hang watchdog ends it. Fix: unset {name}"
                )
    if world_size >= LARGE_RANKS and timeout_s < MIN_TIMEOUT_S:
        found.append(
            f"--timeout-s {timeout_s:g} at {world_size} ranks: it bounds the group's own start too, which takes "
            f"minutes at this size (gloo: 85 s at 8k ranks). Fix: --timeout-s {MIN_TIMEOUT_S:.0f} or more"
        )
    return found
