"""The fsdp section (`python -m hpc_ddp.bench fsdp`, not in the default run: minutes, gigabytes): the same
model trained by ddp with rank 0's full checkpoints and by fsdp with sharded asynchronous ones, interleaved,
`--world-size` ranks (4 by default) on one node.

Figures: samples/s (fsdp / ddp), peak resident memory per rank (fsdp / ddp, the largest rank of each; the task
writes each rank's `ru_maxrss` twice a second), the loop's stall per periodic checkpoint (the "save" records' stall_s,
sharded async / rank-0 full) and the background write time against the checkpoint interval.

The model is built whole on every rank before it is sharded (no meta-device init in the kit), so fsdp's peak
includes one full copy of the parameters at start.

On CPU, fsdp's RSS is mostly not its shards. Every step it frees and reallocates each block's gathered
parameters and gradients, and glibc keeps the freed blocks resident for the next step's (its mmap threshold
rises to their size): a cache several times the size of the shards. Measured here at 25 M parameters, 4 ranks:
fsdp's peak RSS 1.0-1.2 GB a rank with glibc's defaults, 0.55-0.67 GB with MALLOC_MMAP_THRESHOLD_=4194304 (freed
blocks go back at once; ddp 0.92-1.03 GB), at about half fsdp's speed. The bench runs both contenders with
glibc's defaults, as users would.
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
    while True:
        try:
            path.write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))  # Linux: KiB
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


def _measure(s: Settings, runner: Runner, strategy: str, trial: int) -> dict[str, float]:
    folder = runner.folder(strategy)
    run_cmd(_cmd(s, folder, strategy), folder.with_suffix(".log"), timeout=1800)
    records = read_records(folder / "metrics.jsonl")
    end = [r for r in records if r.get("event") == "end"]
    saves = [r for r in records if r.get("event") == "save" and not r.get("final")]
    steps = [r["step_time_s"] for r in records if r.get("event") == "step" and r.get("step", 0) > 1]
    rss = [int(p.read_text()) for p in folder.glob(RSS_FILE.format(rank="*"))]
    if not end or not saves or len(rss) != s.world_size:
        raise RunFailed(f"{folder}: no end record, periodic save or every rank's peak memory")
    figures = {
        "samples_per_s": float(end[0]["samples_per_s"]),
        "peak_rss_bytes": float(max(rss)),
        "stall_s": median([r["stall_s"] for r in saves]),
        "write_s": median([r["write_s"] or 0.0 for r in saves]),
        "interval_s": SAVE_EVERY * median(steps),
    }
    runner.done(
        trial, strategy, f"{figures['samples_per_s']:,.1f} samples/s, {max(rss) / 2**20:,.0f} MiB peak"
    )
    return figures


def fsdp_section(s: Settings) -> dict[str, Any]:
    runner = Runner(s)
    trials: dict[str, list[dict[str, float]]] = {"ddp": [], "fsdp": []}
    for trial in range(s.trials):  # interleaved: a load that comes and goes hits both
        for strategy in ("ddp", "fsdp"):
            trials[strategy].append(_measure(s, runner, strategy, trial))

    def ratio(key: str) -> tuple[float, list[float]]:
        per_trial = ratios([t[key] for t in trials["fsdp"]], [t[key] for t in trials["ddp"]])
        return median(per_trial), per_trial

    out: dict[str, Any] = {"ranks": s.world_size, "params": (WIDTH + 1) * WIDTH * DEPTH + WIDTH + 1}
    if s.quick:
        out["params"] = (QUICK[0] + 1) * QUICK[0] * QUICK[1] + QUICK[0] + 1
    for key in ("samples_per_s", "peak_rss_bytes", "stall_s"):
        out[f"{key}_ratio"], out.setdefault("trials", {})[key] = ratio(key)
    for strategy in ("ddp", "fsdp"):
        for key in ("samples_per_s", "peak_rss_bytes", "stall_s", "write_s", "interval_s"):
            out[f"{strategy}_{key}"] = median([t[key] for t in trials[strategy]])
    return out
