"""The fsdp section (`python -m hpc_ddp.bench fsdp`, not in the default run: minutes, gigabytes): the same
model, given as a factory (fsdp builds it on the meta device), trained by ddp with rank 0's full checkpoints
and by fsdp with sharded asynchronous ones, written by a thread (`--async-save thread`) and by DCP's saving
processes (`process`), interleaved, `--world-size` ranks (4 for the README's figures) on one node.

Figures: samples/s (fsdp / ddp), peak resident memory per rank (fsdp / ddp, the largest rank of each; the task
writes each rank's `ru_maxrss` twice a second), the loop's stall per periodic checkpoint (the "save" records'
stall_s: sharded async / rank-0 full, and thread / process), the background write time against the
checkpoint interval, and the step time while a write is in the background against the step time without one
(`writes`: what each kind of write costs training besides its stall).

Memory is measured twice. The runs with the kit's settings are what users get: the local launcher starts
every rank with glibc's tunables of hpc_ddp.cluster.allocator (blocks of 4 MiB or more mapped on their own, on
huge pages; without them fsdp's RSS is mostly freed blocks kept in fragmented heaps: 2.6-3.0 GB a rank against
1.1 GB, measured at 100 M parameters, 4 ranks, load 8-12). Then ddp and fsdp run once more with freed memory
returned and nothing else (`RETURNED`: the same threshold, no huge pages): the peak RSS is what the rank held,
the CPU stand-in for a GPU's allocated-memory peak. Those runs are slower (every gather faults in 4 KiB pages),
so the speed and stall figures come from the runs with the kit's settings.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_ddp.bench.runs import (
    RunFailed,
    Runner,
    Settings,
    drop_weights,
    median,
    median_of_measured,
    ratios,
    read_records,
    run_cmd,
)

WIDTH, DEPTH = 2048, 24  # 24 blocks of Linear(2048, 2048): about 100.7 M parameters
QUICK = (128, 2)
SAVE_EVERY = 3
RSS_FILE = "bench-rss-{rank}.txt"
# Blocks of 4 MiB or more (each gathered 2048 x 2048 weight is 16 MiB) are mapped on their own and unmapped when
# freed, in 4 KiB pages (GLIBC_TUNABLES given: the launcher adds none of its own).
RETURNED = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304"}


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
        model=Wide,  # a factory: fsdp builds it on the meta device, each rank allocating only its shards
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
    """Samples per rank per step: at most 16. Fewer, and a CPU step of the 100 M model is mostly gloo moving
    parameters, which measures gloo, not the strategies: fsdp moves them three times a step (two all-gathers, a
    reduce-scatter), ddp once (an all-reduce), on loopback at the cost of CPU (16 MiB over 4 ranks, quiet:
    all-gather 16-17 ms, all-reduce 23-24 ms, the reduce-scatter 13 ms as run/strategy/gloo_comm does it, 33-36
    ms as gloo does). A GPU step is compute-bound well before either."""
    return min(s.batch_size, 16)


def steps(s: Settings) -> int:
    """At least three periodic saves: the first of a process-based save also starts the saving processes, so
    the per-save figures come from the others."""
    return max(s.steps, 3 * SAVE_EVERY)


# The contenders of the runs with the kit's settings: ddp, and fsdp with either kind of background write.
CONTENDERS = {"ddp": ("ddp", ()), "fsdp": ("fsdp", ("--async-save", "thread"))}
CONTENDERS["fsdp-process"] = ("fsdp", ("--async-save", "process"))


def _cmd(s: Settings, folder: Path, contender: str) -> list[str]:
    task = TASK + ("_quick" if s.quick else "")
    strategy, options = CONTENDERS[contender]
    return [
        sys.executable, "-m", "hpc_ddp.submit", "--local", "--nodes", "1",
        "--tasks-per-node", str(s.world_size), "--task", task, "--strategy", strategy, *options,
        "--batch-size", str(batch(s)), "--max-steps", str(steps(s)),
        "--save-every-steps", str(SAVE_EVERY), "--save-every-epochs", "0", "--folder", str(folder),
        "--log-every-s", "0",
    ]  # fmt: skip


def _peak_rss(s: Settings, folder: Path) -> float:
    rss = [int(p.read_text()) for p in folder.glob(RSS_FILE.format(rank="*"))]
    if len(rss) != s.world_size:
        raise RunFailed(f"{folder}: {len(rss)} of {s.world_size} ranks wrote their peak memory")
    return float(max(rss))


def writes(records: list[dict[str, Any]]) -> dict[str, float]:
    """What the periodic saves of one run cost the loop (pure, from its metrics.jsonl records): the stall per
    save and the background write's time (medians over the saves after the first), the first save's write
    (a process-based save starts its saving processes then), and the median step time of the steps that ran
    while a later write was in the background against that of the steps that ran with none (the first step,
    warm-up, and those during the first write left out). A save follows the step of its number: its write runs
    from that step's end plus the stall, for write_s seconds; a step runs for step_time_s up to its record's
    time."""
    steps = {r["step"]: r for r in records if r.get("event") == "step"}
    saves = [r for r in records if r.get("event") == "save" and not r.get("final")]
    windows = []
    for save in saves:
        begin = steps[save["step"]]["time"] + save["stall_s"]
        windows.append((begin, begin + (save["write_s"] or 0.0)))
    during, quiet = [], []
    for number, step in steps.items():
        end, start = step["time"], step["time"] - step["step_time_s"]
        overlaps = [a < end and start < b for a, b in windows]
        if number <= 1 or (overlaps and overlaps[0]):  # warm-up; the first write (a process's start)
            continue
        (during if any(overlaps) else quiet).append(step["step_time_s"])
    later = saves[1:] or saves
    return {
        "stall_s": median([r["stall_s"] for r in later]),
        "write_s": median([r["write_s"] or 0.0 for r in later]),
        "first_write_s": float(saves[0]["write_s"] or 0.0) if saves else float("nan"),
        "step_s_during_write": median(during),
        "step_s_quiet": median(quiet),
    }


def _measure(s: Settings, runner: Runner, contender: str, trial: int) -> dict[str, float]:
    """One run with the kit's settings: speed, the saves' costs and the peak RSS users would see."""
    folder = runner.folder(contender)
    run_cmd(_cmd(s, folder, contender), folder.with_suffix(".log"), timeout=1800)
    records = read_records(folder / "metrics.jsonl")
    end = [r for r in records if r.get("event") == "end"]
    steps_s = [r["step_time_s"] for r in records if r.get("event") == "step" and r.get("step", 0) > 1]
    if not end or not any(r.get("event") == "save" and not r.get("final") for r in records):
        raise RunFailed(f"{folder}: no end record or periodic save")
    figures = {
        "samples_per_s": float(end[0]["samples_per_s"]),
        "peak_rss_bytes": _peak_rss(s, folder),
        "interval_s": SAVE_EVERY * median(steps_s),
        **writes(records),
    }
    drop_weights(folder)
    runner.done(
        trial,
        contender,
        f"{figures['samples_per_s']:,.1f} samples/s, {figures['peak_rss_bytes'] / 2**20:,.0f} MiB peak, "
        f"stall {figures['stall_s'] * 1e3:,.0f} ms",
    )
    return figures


def _measure_held(s: Settings, runner: Runner, contender: str, trial: int) -> float:
    """One run with freed blocks returned at once (RETURNED): the peak RSS is what the rank held."""
    folder = runner.folder(f"{contender}-returned")
    run_cmd(_cmd(s, folder, contender), folder.with_suffix(".log"), timeout=1800, extra_env=RETURNED)
    peak = _peak_rss(s, folder)
    drop_weights(folder)
    runner.done(trial, f"{contender}, freed memory returned", f"{peak / 2**20:,.0f} MiB peak")
    return peak


def fsdp_section(s: Settings) -> dict[str, Any]:
    runner = Runner(s)
    trials: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    for trial in range(s.trials):  # interleaved A B C, C B A, ...: a load that comes and goes hits every one
        order = list(CONTENDERS) if trial % 2 == 0 else list(reversed(CONTENDERS))
        for contender in order:
            trials[contender].append(_measure(s, runner, contender, trial))
        for contender in ("ddp", "fsdp"):
            trials[contender][-1]["held_rss_bytes"] = _measure_held(s, runner, contender, trial)

    def ratio(key: str, a: str = "fsdp", b: str = "ddp") -> tuple[float, list[float]]:
        per_trial = ratios([t[key] for t in trials[a]], [t[key] for t in trials[b]])
        return median(per_trial), per_trial

    out: dict[str, Any] = {"ranks": s.world_size, "params": (WIDTH + 1) * WIDTH * DEPTH + WIDTH + 1}
    if s.quick:
        out["params"] = (QUICK[0] + 1) * QUICK[0] * QUICK[1] + QUICK[0] + 1
    out["returned_env"] = dict(RETURNED)
    keys = ("samples_per_s", "peak_rss_bytes", "held_rss_bytes", "stall_s")
    for key in keys:
        out[f"{key}_ratio"], out.setdefault("trials", {})[key] = ratio(key)
    out["process_stall_s_ratio"], out["trials"]["process_stall_s"] = ratio("stall_s", "fsdp-process", "fsdp")
    for contender, runs in trials.items():
        prefix = contender.replace("-", "_")
        for key in runs[0]:
            # None where no trial measured it: a short run (--quick) may have had no step during a later write.
            out[f"{prefix}_{key}"] = median_of_measured([t[key] for t in runs])
    return out
