"""The fsdp section (`python -m hpc_ddp.bench fsdp`, not in the default run: minutes, gigabytes): the same
model trained by ddp with rank 0's full checkpoints and by fsdp with sharded asynchronous ones, interleaved,
`--world-size` ranks (4 by default) on one node.

Figures: samples/s (fsdp / ddp), peak resident memory per rank (fsdp / ddp, the largest rank of each; the task
writes each rank's `ru_maxrss` twice a second), the loop's stall per periodic checkpoint (the "save" records' stall_s,
sharded async / rank-0 full) and the background write time against the checkpoint interval.

Memory is measured twice, in runs of their own. On CPU with glibc's defaults, fsdp's RSS is mostly not its
shards: every step it frees and reallocates each block's gathered parameters and gradients, glibc raises its
mmap threshold to their size and keeps the freed blocks in its heap, where later long-lived tensors fragment
it (measured at 100 M parameters, 4 ranks: fsdp 2.4-2.7 GB a rank, ddp 3.2 GB). So each trial runs both
contenders once more with `MALLOC_MMAP_THRESHOLD_` fixed at 4 MiB: a freed block of that size or more goes back
to the system at once, and the peak RSS is what the rank held (fsdp 1.1-1.4 GB, ddp 2.7-3.1 GB). That ratio is
the one the target applies to; it is the CPU stand-in for a GPU's allocated-memory peak, where the caching
allocator's reserve is not the strategy's either. Those runs are 2-3 times slower (every gather faults fresh
pages), so the speed and stall figures come from the runs with glibc's defaults, as users run them.

The model is built whole on every rank before it is sharded (no meta-device init in the kit), so fsdp's peak
includes one full copy of the parameters at start.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_ddp.bench.runs import RunFailed, Runner, Settings, median, ratios, read_records, run_cmd

WIDTH, DEPTH = 2048, 24  # 24 blocks of Linear(2048, 2048): about 100.7 M parameters
QUICK = (128, 2)
SAVE_EVERY = 3
RSS_FILE = "bench-rss-{rank}.txt"
# Blocks of 4 MiB or more (each gathered 2048 x 2048 weight is 16 MiB) are mmapped and unmapped when freed;
# setting it also stops glibc from raising the threshold by itself.
RETURNED = {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**20)}


def wide(config: Any) -> Any:
    """The bench's model: blocks in an nn.ModuleList (what fsdp shards), AdamW (two states per parameter)."""
    import torch
    from torch import nn

    from hpc_ddp.run.tasks import Task

    width, depth = QUICK if config.task.endswith("_quick") else (WIDTH, DEPTH)

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)
            )
            self.out = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    folder, rank = Path(config.folder), os.environ.get("RANK", "0")
    # The kit's ranks leave with os._exit (no atexit): a thread writes the peak so far twice a second.
    threading.Thread(target=_watch_rss, args=(folder / RSS_FILE.format(rank=rank),), daemon=True).start()
    gen = torch.Generator().manual_seed(config.seed)
    x = torch.randn(512, width, generator=gen)
    return Task(
        model=Wide(),
        dataset=torch.utils.data.TensorDataset(x, x.mean(dim=1, keepdim=True)),
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
    )


wide_quick = wide


def _watch_rss(path: Path) -> None:
    # Written aside, then renamed: a rank that leaves (os._exit) during a write leaves the last whole figure.
    temp = path.with_suffix(".tmp")
    while True:
        try:
            temp.write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))  # Linux: KiB
            os.replace(temp, path)
        except OSError:
            pass
        time.sleep(0.5)


TASK = "hpc_ddp.bench.sharding:wide"


def batch(s: Settings) -> int:
    """Samples per rank per step: at most 4 (a step of the 100 M model on CPU takes seconds)."""
    return min(s.batch_size, 4)


def steps(s: Settings) -> int:
    """At least two periodic saves."""
    return max(s.steps, 2 * SAVE_EVERY)


def _cmd(s: Settings, folder: Path, strategy: str) -> list[str]:
    task = TASK + ("_quick" if s.quick else "")
    return [
        sys.executable, "-m", "hpc_ddp.submit", "--local", "--nodes", "1",
        "--tasks-per-node", str(s.world_size), "--task", task, "--strategy", strategy,
        "--batch-size", str(batch(s)), "--max-steps", str(steps(s)),
        "--save-every-steps", str(SAVE_EVERY), "--save-every-epochs", "0", "--folder", str(folder),
        "--log-every-s", "0",
    ]  # fmt: skip


def _peak_rss(s: Settings, folder: Path) -> float:
    rss = [int(p.read_text()) for p in folder.glob(RSS_FILE.format(rank="*"))]
    if len(rss) != s.world_size:
        raise RunFailed(f"{folder}: {len(rss)} of {s.world_size} ranks wrote their peak memory")
    return float(max(rss))


def _measure(s: Settings, runner: Runner, strategy: str, trial: int) -> dict[str, float]:
    """One run with glibc's defaults: speed, stall, write time and the peak RSS users would see."""
    folder = runner.folder(strategy)
    run_cmd(_cmd(s, folder, strategy), folder.with_suffix(".log"), timeout=1800)
    records = read_records(folder / "metrics.jsonl")
    end = [r for r in records if r.get("event") == "end"]
    saves = [r for r in records if r.get("event") == "save" and not r.get("final")]
    steps = [r["step_time_s"] for r in records if r.get("event") == "step" and r.get("step", 0) > 1]
    if not end or not saves:
        raise RunFailed(f"{folder}: no end record or periodic save")
    figures = {
        "samples_per_s": float(end[0]["samples_per_s"]),
        "peak_rss_bytes": _peak_rss(s, folder),
        "stall_s": median([r["stall_s"] for r in saves]),
        "write_s": median([r["write_s"] or 0.0 for r in saves]),
        "interval_s": SAVE_EVERY * median(steps),
    }
    runner.done(
        trial,
        strategy,
        f"{figures['samples_per_s']:,.1f} samples/s, {figures['peak_rss_bytes'] / 2**20:,.0f} MiB peak",
    )
    return figures


def _measure_held(s: Settings, runner: Runner, strategy: str, trial: int) -> float:
    """One run with freed blocks returned at once (RETURNED): the peak RSS is what the rank held."""
    folder = runner.folder(f"{strategy}-returned")
    run_cmd(_cmd(s, folder, strategy), folder.with_suffix(".log"), timeout=1800, extra_env=RETURNED)
    peak = _peak_rss(s, folder)
    runner.done(trial, f"{strategy}, freed memory returned", f"{peak / 2**20:,.0f} MiB peak")
    return peak


def fsdp_section(s: Settings) -> dict[str, Any]:
    runner = Runner(s)
    trials: dict[str, list[dict[str, float]]] = {"ddp": [], "fsdp": []}
    for trial in range(s.trials):  # interleaved: a load that comes and goes hits both
        for strategy in ("ddp", "fsdp"):
            trials[strategy].append(_measure(s, runner, strategy, trial))
        for strategy in ("ddp", "fsdp"):
            trials[strategy][-1]["held_rss_bytes"] = _measure_held(s, runner, strategy, trial)

    def ratio(key: str) -> tuple[float, list[float]]:
        per_trial = ratios([t[key] for t in trials["fsdp"]], [t[key] for t in trials["ddp"]])
        return median(per_trial), per_trial

    out: dict[str, Any] = {"ranks": s.world_size, "params": (WIDTH + 1) * WIDTH * DEPTH + WIDTH + 1}
    if s.quick:
        out["params"] = (QUICK[0] + 1) * QUICK[0] * QUICK[1] + QUICK[0] + 1
    out["returned_env"] = dict(RETURNED)
    keys = ("samples_per_s", "peak_rss_bytes", "held_rss_bytes", "stall_s")
    for key in keys:
        out[f"{key}_ratio"], out.setdefault("trials", {})[key] = ratio(key)
    for strategy in ("ddp", "fsdp"):
        for key in (*keys, "write_s", "interval_s"):
            out[f"{strategy}_{key}"] = median([t[key] for t in trials[strategy]])
    return out
