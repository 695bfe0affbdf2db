"""FSDP2's collectives on CPU ranks (gloo): the reduce-scatter as one all-to-all and a sum, and the block-sized
buffers they move through reused instead of allocated afresh for every block.

Both answer what a CPU step of fsdp spends beyond ddp's (`python -m hpc_ddp.bench fsdp`: 24 blocks of
16 MiB, 4 ranks on loopback). Nothing changes on a GPU: NCCL's collectives are the fast path there, and
`install` only acts where the sharding group's backend is gloo.

- **The reduce-scatter.** gloo's own takes longer than an all-reduce of the same block (33-36 ms against
  23-24 ms, per 16 MiB block), where a reduce-scatter moves half the bytes. The same reduction as
  `all_to_all_single` (each rank sends every peer that peer's part, with no ring to wait along) and one sum of
  the parts received takes 13 ms. FSDP reduce-scatters each block's gradients once a step.
  The sum runs in rank order, the same on every run of the same world size, so a resumed run still matches an
  uninterrupted one bit for bit; it differs from gloo's in the last bits (the same sums in another order), as
  fsdp's gradients already differ from ddp's all-reduce.
- **The buffers.** The ranks run with glibc's tunables of hpc_ddp.cluster.allocator: a freed block of 4 MiB or
  more goes back to the system at once, which keeps fsdp's memory at what it holds, but every fresh block then
  faults in zeroed pages. Each step allocates a whole block's all-gather output twice per block (forward and
  backward), and a reduce-scatter's input and exchange buffer once. `BufferPool` keeps two of each size and
  hands one out only when nothing else holds its storage, so the same pages are used again and no buffer
  is ever shared while in use. The strategy releases the pool when training ends (`Strategy.trained`): kept
  through the final save and model.pth, its two blocks' worth of idle buffers raised rank 0's peak in the
  400 M memory proof from 1,285 to 1,427 MiB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # a torch without FSDP2's custom collectives: `install` leaves FSDP's own
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]

_SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
# torch 2.13 renamed them (the old names warn); older releases have only the old ones.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
Key = tuple[int, torch.dtype, torch.device]


def _holders(buffer: torch.Tensor) -> int:
    """How many tensors share `buffer`'s storage, plus one for the storage object made to ask."""
    return int(torch._C._storage_Use_Count(buffer.untyped_storage()._cdata))


class BufferPool:
    """Block-sized buffers kept for reuse: `take` gives a view of a kept buffer that nothing else holds (the
    pool's own tensor is its only holder), else a fresh buffer, kept while fewer than `per_size` of its size
    are. Always a new view, never the kept tensor itself: a caller's view is what makes the buffer held."""

    def __init__(self, per_size: int = 2) -> None:
        self.per_size = per_size
        self.kept: dict[Key, list[torch.Tensor]] = {}

    def take(
        self, size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        shape = [int(s) for s in size]
        kept = self.kept.setdefault((math.prod(shape), dtype, device), [])
        for buffer in kept:
            if _holders(buffer) <= 2:  # the kept tensor and the asking storage object: free
                return buffer.view(shape)
        buffer = torch.empty(math.prod(shape), dtype=dtype, device=device)
        if len(kept) < self.per_size:
            kept.append(buffer)
        return buffer.view(shape)

    def release(self) -> None:
        """Let go of every kept buffer and keep none from now on: training is over, and the final save and
        model.pth come next, where two blocks' worth of idle buffers would only raise the rank's peak (a
        gather after this, such as a final check's, allocates its own and frees it)."""
        self.per_size = 0
        self.kept.clear()


class PooledAllGather(AllGather):
    """gloo's all-gather into a buffer from the pool."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.pool.take(size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class AllToAllReduceScatter(ReduceScatter):
    """The reduce-scatter as all_to_all and a sum in rank order (SUM, or AVG: FSDP's mean of the gradients);
    any other op (FSDP asks for PREMUL_SUM with a custom gradient divide factor) is gloo's own."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # The input (a whole block's gradients, freed by FSDP after the next block's reduce-scatter) and the
        # output (this rank's shard of them: it becomes the sharded gradient, held until zero_grad).
        return self.pool.take(size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        world = group.size()
        if op not in _SUMS or async_op or input_tensor.numel() != world * output_tensor.numel():
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)  # type: ignore[arg-type]
        parts = self.pool.take(input_tensor.shape, input_tensor.dtype, input_tensor.device)
        # After the exchange, row r holds rank r's gradients for this rank's shard.
        dist.all_to_all_single(parts, input_tensor, group=group)
        torch.sum(parts.view(world, -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def install(
    modules: Iterable[nn.Module], group: dist.ProcessGroup, device: torch.device
) -> BufferPool | None:
    """Give every FSDP module in `modules` these collectives when `group` runs on gloo with CPU tensors; the
    pool their buffers come from (`release` it when training ends), or None where it did not (not on NCCL,
    not on one rank, not on a torch without the hooks)."""
    modules = list(modules)
    if device.type != "cpu" or dist.get_backend(group) != "gloo" or group.size() < 2:
        return None
    if not hasattr(torch._C, "_storage_Use_Count") or not all(
        hasattr(m, "set_custom_reduce_scatter") and hasattr(m, "set_custom_all_gather") for m in modules
    ):
        return None
    pool = BufferPool()
    gather, scatter = PooledAllGather(pool), AllToAllReduceScatter(pool)
    for module in modules:
        module.set_custom_all_gather(gather)  # type: ignore[operator]
        module.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
    return pool
