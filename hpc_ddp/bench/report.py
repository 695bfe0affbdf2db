"""The bench's report: the table of figures, the targets and whether each was met (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hpc_ddp.bench.runs import MIN_TRIALS, TASK, Settings


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    op: str  # ">=" or "<="
    threshold: float

    @property
    def met(self) -> bool:
        return self.value >= self.threshold if self.op == ">=" else self.value <= self.threshold

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "op": self.op,
            "threshold": self.threshold,
            "met": self.met,
        }


def targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    found = []
    if "overhead" in results:
        o = results["overhead"]
        found.append(Target("kit / hand loop, default threads", o["kit_vs_naive"], ">=", 1.8))
        found.append(Target("kit / hand loop, tuned threads", o["kit_vs_tuned"], ">=", 0.97))
    if "checkpoint" in results:
        found.append(Target("checkpoint / raw write", results["checkpoint"]["kit_vs_raw"], ">=", 0.8))
    if "launch" in results:
        found.append(Target("launch / torchrun", results["launch"]["local_vs_torchrun"], "<=", 1.0))
    if "watchdog" in results:
        found.append(Target("hang watch on / off", results["watchdog"]["with_vs_without"], ">=", 0.99))
    return found


def rows(results: dict[str, dict[str, Any]], s: Settings) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    if "overhead" in results:
        o = results["overhead"]
        out += [
            (
                "overhead",
                f"kit, submit --local, {s.world_size} ranks",
                f"{o['kit_samples_per_s']:,.0f} samples/s",
            ),
            ("", "hand loop, mp.spawn, default threads", f"{o['naive_samples_per_s']:,.0f} samples/s"),
            ("", "hand loop, mp.spawn, tuned threads", f"{o['tuned_samples_per_s']:,.0f} samples/s"),
            ("", "kit / default-threads loop", f"{o['kit_vs_naive']:.2f}x"),
            ("", "kit / tuned loop", f"{o['kit_vs_tuned']:.2f}x"),
        ]
    if "scaling" in results:
        c = results["scaling"]
        out += [
            (
                "scaling",
                f"kit, 1 rank on {c['one_rank_cpus']} CPU(s)",
                f"{c['one_rank_samples_per_s']:,.0f} samples/s",
            ),
            ("", f"kit, {c['ranks']} ranks", f"{c['samples_per_s']:,.0f} samples/s"),
            ("", f"efficiency, {c['ranks']} ranks / ({c['ranks']} x 1 rank)", f"{c['efficiency']:.2f}"),
        ]
    if "checkpoint" in results:
        k = results["checkpoint"]
        out += [
            (
                "checkpoint",
                f"kit save ({k['bytes'] / 1e6:.1f} MB), call to durable rename",
                f"{k['kit_mb_per_s']:,.0f} MB/s",
            ),
            ("", "raw write + fsync, same bytes and folder", f"{k['raw_mb_per_s']:,.0f} MB/s"),
            ("", "kit / raw", f"{k['kit_vs_raw']:.2f}x"),
            ("", "training stall per save", f"{k['stall_ms']:.1f} ms"),
            ("", "save call to `latest` updated", f"{k['latest_ms']:.1f} ms"),
        ]
    if "launch" in results:
        la = results["launch"]
        out += [
            ("launch", "submit --local: start to first step", f"{la['local_s']:.2f} s"),
            ("", "torchrun --standalone: start to first step", f"{la['torchrun_s']:.2f} s"),
            ("", "submit --local / torchrun", f"{la['local_vs_torchrun']:.2f}x"),
        ]
    if "watchdog" in results:
        w = results["watchdog"]
        out += [
            (
                "watchdog",
                f"on: beacons, backward mark, watchdog, {w['ranks']} ranks",
                f"{w['with_samples_per_s']:,.0f} samples/s",
            ),
            ("", "off: NullBeacon, no mark, no watchdog", f"{w['without_samples_per_s']:,.0f} samples/s"),
            ("", "on / off", f"{w['with_vs_without']:.3f}x"),
            (
                "",
                "rank 0 CPU per step, on / off",
                f"{w['with_cpu_ms_per_step']:.1f} / {w['without_cpu_ms_per_step']:.1f} ms",
            ),
            ("", "CPU on / off", f"{w['cpu_with_vs_without']:.3f}x"),
        ]
    return out


def table(results: dict[str, dict[str, Any]], s: Settings) -> str:
    lines = [f"{a:<11} {b:<46} {c:>18}" for a, b, c in rows(results, s)]
    lines.append("")
    for t in targets(results):
        verdict = "met" if t.met else "MISSED"
        lines.append(f"target  {t.name:<34} {t.value:6.3f}  {t.op} {t.threshold:<5} {verdict}")
    if s.quick:
        lines.append("(--quick: one short trial per figure; this checks the bench, it measures nothing)")
    elif s.trials < MIN_TRIALS:
        lines.append(f"(fewer than {MIN_TRIALS} trials: indicative only on a shared machine)")
    return "\n".join(lines)


def header(s: Settings) -> str:
    return (
        f"hpc_ddp.bench: task {TASK}, {s.world_size} ranks x batch {s.batch_size}, {s.steps} steps, "
        f"{s.trials} interleaved trial(s), {len(os.sched_getaffinity(0))} CPUs"
    )
