"""The hand-written DDP loop `hpc_ddp.bench` measures the kit against: what users write from the tutorial.

    python -m hpc_ddp.bench.hand --threads default --world-size 2 --steps 60 --out result.json

It trains the kit's built-in `mlp` task (the same model, data, per-rank batch, SGD and learning rate) with
plain `torch.distributed`, started the plain way with `torch.multiprocessing.spawn`, and nothing else: no
checkpoints, no loss reduction, no signal handling. The variants differ only in their thread settings:

  - `default`: torch's defaults, as `mp.spawn` leaves them: every rank starts one intra-op thread per CPU of
    the machine, so N ranks run N x CPUs threads on the CPUs.
  - `tuned`: the threads set right by hand: `torch.set_num_threads(cpus // N)` and one inter-op thread per
    rank (what torchrun's OMP_NUM_THREADS=1 amounts to on this machine). `--pin` also pins each rank to its
    own CPUs, as the kit does (it measured the same here, so the bench leaves it off).

Throughput is measured the way the kit's `metrics.jsonl` "end" record does it: on rank 0, from the end of the
first optimizer step to the end of the last, over all ranks' samples.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

THREADS = ("default", "tuned")


def tune_threads(rank: int, world_size: int, pin: bool) -> int:
    """cpus // ranks intra-op threads and one inter-op thread (with `pin`: on this rank's own CPUs)."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // world_size)
    if pin:
        os.sched_setaffinity(0, cpus[(rank * share) % len(cpus) :][:share])
    torch.set_num_threads(share)
    torch.set_num_interop_threads(1)
    return share


def rate(step_ends: list[float], samples_per_step: int) -> dict[str, float]:
    """Global samples/s from the end of the first step to the end of the last, and the median step time."""
    times = sorted(b - a for a, b in itertools.pairwise(step_ends))
    window = step_ends[-1] - step_ends[0] if len(step_ends) > 1 else 0.0
    return {
        "samples_per_s": samples_per_step * len(times) / window if window > 0 else 0.0,
        "median_step_time_s": times[len(times) // 2] if times else 0.0,
    }


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One rank of the hand-written loop (the target of `mp.spawn`)."""
    import torch

    if args.threads == "tuned":
        tune_threads(rank, args.world_size, args.pin)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.tasks import mlp

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    cfg = TrainConfig(task="mlp", batch_size=args.batch_size, seed=args.seed)
    torch.manual_seed(cfg.seed)
    task = mlp(cfg)
    model = DDP(task.model)
    sampler: DistributedSampler[Any] = DistributedSampler(
        task.dataset, num_replicas=args.world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    loader = DataLoader(task.dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    step_ends: list[float] = []
    epoch = 0
    while len(step_ends) < args.steps:
        sampler.set_epoch(epoch)
        for inputs, target in loader:
            loss = task.loss_fn(model(inputs), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step_ends.append(time.monotonic())
            if len(step_ends) >= args.steps:
                break
        epoch += 1
    if rank == 0:
        result: dict[str, Any] = rate(step_ends, cfg.batch_size * args.world_size)
        result.update(
            steps=len(step_ends),
            threads=torch.get_num_threads(),
            world_size=args.world_size,
            variant=args.threads,
            pinned=args.pin,
        )
        Path(args.out).write_text(json.dumps(result) + "\n")
    # DDP's Reducer holds the group: freed after destroy_process_group(), the gloo group's destructor can
    # deadlock (hpc_ddp.cluster.group). Drop it first, as the kit's Trainer.close() does.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_ddp.bench.hand",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--threads", choices=THREADS, default="default", help="thread settings (see above)")
    parser.add_argument("--pin", action="store_true", help="tuned: also pin each rank to its own CPUs")
    parser.add_argument("--world-size", type=int, default=2, help="ranks on this machine (default: 2)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps, at least 2 (default: 60)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, data and order (default: 0)")
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON result here")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.world_size < 1 or args.batch_size < 1:
        parser.error("--steps must be at least 2, --world-size and --batch-size at least 1")
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args, free_port()), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
