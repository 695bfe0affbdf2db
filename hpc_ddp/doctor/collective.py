"""`doctor --collective`: an all-reduce benchmark over message sizes, reported the way nccl-tests does.

For a message of S bytes taking t seconds: algbw = S / t, and the bus bandwidth of an all-reduce is
busbw = algbw * 2 (n - 1) / n, since a ring all-reduce moves 2 (n - 1) / n of the data over each link; busbw
compares across rank counts and with the hardware's link speed. As with nccl-tests' default (`-a 1`), t is
the mean of the ranks' times.

Outliers: in an all-reduce every rank waits for the others, so a rank's time mostly measures how long it was
kept waiting. A rank far from the median in either direction arrived late (shorter time: it waited least) or
was held up in the middle (longer): both point at that rank's host, GPU or link.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_ddp.doctor.rules import FAIL, OUTLIER_FACTOR, PASS, WARN, Check, ranks_text

if TYPE_CHECKING:
    import torch

KB, MB = 1024, 1024 * 1024
GPU_SIZES = tuple(4 * KB * 4**i for i in range(8))  # 4 KB .. 64 MB
CPU_SIZES = (4 * KB, 64 * KB, 1 * MB, 4 * MB)  # gloo on a few cores: 64 MB would take seconds per call


def sizes(gpu: bool) -> tuple[int, ...]:
    return GPU_SIZES if gpu else CPU_SIZES


def iterations(size: int) -> int:
    """Timed calls per size: many for small messages (latency-bound, noisy), few for large. Every rank must
    compute the same number, or the collectives would not match."""
    return 20 if size <= 64 * KB else 10 if size <= 4 * MB else 5


def bus_bandwidth(size: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes, as nccl-tests) of an all-reduce of `size` bytes."""
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world


def outlier_ranks(
    totals: Mapping[int, float], factor: float = OUTLIER_FACTOR, floor_s: float = 1e-3
) -> list[int]:
    """Ranks whose total time is `factor` away from the median (either way), and by more than `floor_s`."""
    if len(totals) < 3:  # with two ranks there is no majority to be an outlier from
        return []
    median = statistics.median(totals.values())
    return sorted(
        r
        for r, t in totals.items()
        if abs(t - median) > floor_s and (t > median * factor or t * factor < median)
    )


def table(times: Mapping[int, Mapping[int, float]], world: int) -> list[tuple[int, float, float, float]]:
    """Rows of (size, mean time s, algbw, busbw) from times[rank][size]."""
    rows = []
    for size in sorted({s for per_rank in times.values() for s in per_rank}):
        mean = statistics.fmean(per_rank[size] for per_rank in times.values())
        rows.append((size, mean, *bus_bandwidth(size, mean, world)))
    return rows


def verdict(
    times: Mapping[int, Mapping[int, float]],
    correct: Mapping[int, bool],
    hosts: Mapping[int, str],
    world: int,
) -> Check:
    """The benchmark's line in the doctor's verdict, from times[rank][size] and each rank's sum check."""
    wrong = sorted(r for r, ok in correct.items() if not ok)
    if wrong:
        return Check(
            FAIL,
            "collective",
            f"all-reduce returned wrong sums on rank {ranks_text(wrong)}",
            "a broken GPU, driver or NCCL install on that node: run nccl-tests there and report it",
        )
    totals = {r: sum(per_rank.values()) for r, per_rank in times.items()}
    odd = outlier_ranks(totals)
    if odd:
        r, median = odd[0], statistics.median(totals.values())
        return Check(
            WARN,
            "collective",
            f"rank {ranks_text(odd)} is an outlier: rank {r} on "
            f"{hosts.get(r, '?')} took {totals[r] / median:.2f}x the median",
            "look at that node: load (top), GPU clocks (nvidia-smi -q -d CLOCK), its network link",
        )
    rows = table(times, world)
    if world == 1 or not rows:
        return Check(PASS, "collective", f"{len(rows)} sizes timed; one rank: nothing crosses a link")
    size, _, _, busbw = max(rows, key=lambda row: row[3])
    return Check(
        PASS,
        "collective",
        f"{len(rows)} sizes on {world} ranks; peak bus bandwidth "
        f"{busbw:.2f} GB/s at {human_size(size)}; no outlier rank",
    )


def human_size(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def run(device: torch.device, rank: int, world: int) -> tuple[dict[int, float], bool]:
    """Inside an initialized process group: this rank's mean seconds per all-reduce by size, and whether a
    known sum came back right."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[int, float] = {}
    for size in sizes(device.type == "cuda"):
        # Zeros stay zeros however often they are summed: no overflow, no denormals slowing the CPU path.
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connections, buffers, NCCL's first-call setup
            dist.all_reduce(x)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations(size)):
            dist.all_reduce(x)
        sync()
        times[size] = (time.perf_counter() - start) / iterations(size)
    y = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(y)
    correct = bool((y == world * (world + 1) / 2).all().item())
    return times, correct
