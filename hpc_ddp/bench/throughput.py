"""The overhead and scaling sections: the kit's samples/s against hand-written DDP loops, and N ranks
against one (see `python -m hpc_ddp.bench --help`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hpc_ddp.bench.runs import Runner, Settings, median, ratios


def throughput(s: Settings, sections: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The overhead and scaling sections, in one interleaved rotation of runs (they share the kit's runs)."""
    runner = Runner(s)
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[: max(1, len(cpus) // s.world_size)]
    rates: dict[str, list[float]] = {"kit": [], "naive": [], "tuned": [], "one_rank": []}
    runs: dict[str, Callable[[int], float]] = {
        "kit": lambda trial: runner.kit(f"kit-{s.world_size}-ranks", s.world_size, trial),
        "tuned": lambda trial: runner.hand("hand-loop-tuned-threads", "tuned", trial),
        "naive": lambda trial: runner.hand("hand-loop-default-threads", "default", trial),
        "one_rank": lambda trial: runner.kit(f"kit-1-rank-{len(share)}-cpu", 1, trial, cpus=share),
    }
    wanted = (
        ["kit"]
        + (["tuned", "naive"] if "overhead" in sections else [])
        + (["one_rank"] if "scaling" in sections else [])
    )
    for trial in range(s.trials):
        # A B C D, then D C B A: a load that rises or falls during the bench favours no contender. The kit
        # and the tuned loop, the closest pair, run back to back.
        for name in wanted if trial % 2 == 0 else wanted[::-1]:
            rates[name].append(runs[name](trial))
    result: dict[str, dict[str, Any]] = {}
    if "overhead" in sections:
        own = runner.kit_us.get(f"kit-{s.world_size}-ranks", [])
        norm = runner.norm_us.get(f"kit-{s.world_size}-ranks", [])
        result["overhead"] = {
            "kit_own_us_per_step": median(own),
            # Of which: the gradient norm the step records compute without --clip-grad (issue 46), said apart.
            "grad_norm_us_per_step": median(norm),
            "kit_samples_per_s": median(rates["kit"]),
            "naive_samples_per_s": median(rates["naive"]),
            "tuned_samples_per_s": median(rates["tuned"]),
            "kit_vs_naive": median(ratios(rates["kit"], rates["naive"])),
            "kit_vs_tuned": median(ratios(rates["kit"], rates["tuned"])),
            "trials": {
                **{k: rates[k] for k in ("kit", "naive", "tuned")},
                "kit_own_us": own,
                "grad_norm_us": norm,
            },
            "measured": "global samples/s on rank 0 from the end of step 1 to the end of the last step",
            "fair_settings": "kit: --save-every-epochs 0 and --max-steps inside epoch 0 (no checkpoint or "
            "epoch end in the window; its final save comes after it), default "
            "--log-every-s; hand loops: no saves",
            "kit_own": "rank 0's step time less its wait for data and the task's forward, backward (with DDP's "
            "gradient all-reduce) and update: the kit's own work per step (the end record's kit_us_per_step)",
        }
    if "scaling" in sections:
        efficiency = [
            n / (s.world_size * one) if one else float("nan")
            for n, one in zip(rates["kit"], rates["one_rank"], strict=True)
        ]
        result["scaling"] = {
            "ranks": s.world_size,
            "samples_per_s": median(rates["kit"]),
            "one_rank_samples_per_s": median(rates["one_rank"]),
            "one_rank_cpus": len(share),
            "efficiency": median(efficiency),
            "trials": {"ranks": rates["kit"], "one_rank": rates["one_rank"]},
        }
    return result
