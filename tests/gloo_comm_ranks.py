"""One rank of tests/test_run_gloo_comm.py: `python -m gloo_comm_ranks RANK WORLD STORE OUT` joins a gloo group
through a FileStore (no port), checks hpc_ddp.run.strategy.gloo_comm's collectives against gloo's own and
against the sums written out by hand, and writes what it found to OUT as JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from hpc_ddp.run.strategy.gloo_comm import AllToAllReduceScatter, BufferPool, PooledAllGather

SHARD = 4099  # elements of one rank's shard: odd, as a block's shards are after FSDP's padding


def inputs(rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s whole-block gradients, the same wherever they are made."""
    return torch.randn(world * SHARD, generator=torch.Generator().manual_seed(rank))


def _in_fsdp(group: dist.ProcessGroup) -> bool:
    """A two-block FSDP2 model, once with FSDP's collectives and once with `install`'s: the same sharded
    gradients (to rounding), and the second's buffers came from the pool."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpc_ddp.run.strategy import gloo_comm

    mesh = init_device_mesh("cpu", (group.size(),))
    grads, pools = [], []
    for installed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        blocks = [model[0], model[2]]
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if installed:
            assert not gloo_comm.install([*blocks, model], group, torch.device("meta"))
            assert gloo_comm.install([*blocks, model], group, torch.device("cpu"))
            pools.append(blocks[0]._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm.pool)
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(group.rank()))
        model(x).square().mean().backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads, strict=True))
    return same and bool(pools[0].kept)


def main(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    group = dist.group.WORLD
    pool = BufferPool()
    scatter, gather = AllToAllReduceScatter(pool), PooledAllGather(pool)
    found: dict[str, bool] = {}

    # By hand: every rank's part of this rank's shard, added in rank order.
    parts = [inputs(r, world).view(world, SHARD)[rank] for r in range(world)]
    by_hand = parts[0].clone()
    for part in parts[1:]:
        by_hand += part

    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        ours = scatter.allocate((SHARD,), dtype=torch.float32, device=torch.device("cpu"))
        assert scatter(ours, inputs(rank, world), group, op) is None
        gloos = torch.empty(SHARD)
        dist.reduce_scatter_single(gloos, inputs(rank, world), op=op, group=group)
        expected = by_hand if op == dist.ReduceOp.SUM else by_hand / world
        found[f"{name}: the sum in rank order, bit for bit"] = torch.equal(ours, expected)
        found[f"{name}: gloo's reduce-scatter to rounding"] = torch.allclose(
            ours, gloos, rtol=1e-5, atol=1e-6
        )

    # Any other op is gloo's own reduce-scatter (FSDP's PREMUL_SUM, with a custom gradient divide factor).
    premul = (
        dist._make_nccl_premul_sum(0.5) if hasattr(dist, "_make_nccl_premul_sum") else dist.ReduceOp.PRODUCT
    )
    ours, gloos = torch.empty(SHARD), torch.empty(SHARD)
    try:
        scatter(ours, inputs(rank, world), group, premul)
        dist.reduce_scatter_single(gloos, inputs(rank, world), op=premul, group=group)
        found["other ops: gloo's own"] = torch.equal(ours, gloos)
    except (RuntimeError, ValueError) as e:  # gloo refuses the op: the same refusal both ways is the check
        found["other ops: gloo's own"] = "premul" in str(e).lower() or "unsupported" in str(e).lower()

    shard = inputs(rank, world)[:SHARD]
    ours = gather.allocate((world * SHARD,), dtype=torch.float32, device=torch.device("cpu"))
    gather(ours, shard, group)
    gloos = torch.empty(world * SHARD)
    dist.all_gather_single(gloos, shard, group=group)
    found["all-gather: gloo's, bit for bit"] = torch.equal(ours, gloos)

    found["in FSDP: the same gradients as its own collectives, through the pool"] = _in_fsdp(group)
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
