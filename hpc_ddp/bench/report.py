"""The bench's report: the table of figures, the targets and the verdict on each (pure).

A target is judged on the median of its per-trial ratios. A median that misses is "noisy: rerun on a quiet
machine" only when its trials straddle the threshold (some met it, some did not), with their range, spread and
the machine's load: a rerun could meet it. When every trial misses, it is MISSED, whatever the load: a busy
machine is no excuse for a target no trial reached (issue 41: a kit 0.80x against 0.97x, every trial below
0.82x, was called noise).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.bench import sweeping
from hpc_ddp.bench.runs import MIN_TRIALS, TASK, Settings, ratios

NOISY = "noisy: rerun on a quiet machine"


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    op: str  # ">=" or "<="
    threshold: float
    trials: tuple[float, ...] = field(default=())  # the per-trial ratios `value` is the median of
    unit: str = "x"  # how a trial's figure is written: a ratio, or " us" for a time

    @property
    def met(self) -> bool:
        return self.meets(self.value)

    def meets(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    @property
    def spread(self) -> float | None:
        """(highest - lowest) / median of the per-trial ratios; None with fewer than 2 trials."""
        if len(self.trials) < 2 or not self.value > 0:
            return None
        return (max(self.trials) - min(self.trials)) / self.value

    def noisy(self, load: float, cpus: int) -> bool:
        """A miss that a rerun could turn into a hit: some trial met the target (the trials straddle it). Not
        the load: when every trial misses, it is a miss."""
        return not self.met and any(self.meets(x) for x in self.trials)

    def verdict(self, load: float, cpus: int) -> str:
        if self.met:
            return "met"
        if not self.noisy(load, cpus):
            every = (
                f" (every trial: {min(self.trials):.2f}-{max(self.trials):.2f}{self.unit})"
                if len(self.trials) > 1
                else ""
            )
            return f"MISSED{every}"
        trials = f"trials {min(self.trials):.2f}-{max(self.trials):.2f}{self.unit}, " if self.trials else ""
        spread = f"spread {self.spread:.0%}; " if self.spread is not None else ""
        return f"{NOISY} ({trials}{spread}load {load:.1f} on {cpus} CPUs)"

    def as_dict(self, load: float, cpus: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "op": self.op,
            "threshold": self.threshold,
            "met": self.met,
            "trials": list(self.trials),
            "spread": self.spread,
            "verdict": "met" if self.met else "noisy" if self.noisy(load, cpus) else "missed",
        }


def targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    found = []

    def target(
        name: str, value: float, op: str, threshold: float, trials: list[float], unit: str = "x"
    ) -> None:
        found.append(Target(name, value, op, threshold, tuple(x for x in trials if math.isfinite(x)), unit))

    if "overhead" in results:
        o, t = results["overhead"], results["overhead"].get("trials", {})
        naive, tuned = (
            ratios(t.get("kit", []), t.get("naive", [])),
            ratios(t.get("kit", []), t.get("tuned", [])),
        )
        target("kit / hand loop, default threads", o["kit_vs_naive"], ">=", 1.8, naive)
        target("kit / hand loop, tuned threads", o["kit_vs_tuned"], ">=", 0.97, tuned)
        if "kit_own_us_per_step" in o:  # since issue 41
            own = o["kit_own_us_per_step"]
            target("kit's own work per step, us", own, "<=", 500.0, t.get("kit_own_us", []), " us")
    if "checkpoint" in results:
        k, t = results["checkpoint"], results["checkpoint"].get("trials", {})
        target(
            "checkpoint / raw write",
            k["kit_vs_raw"],
            ">=",
            0.8,
            ratios(t.get("raw_s", []), t.get("kit_s", [])),
        )
    if "launch" in results:
        la, t = results["launch"], results["launch"].get("trials", {})
        trials = ratios(t.get("local", []), t.get("torchrun", []))
        target("launch / torchrun", la["local_vs_torchrun"], "<=", 1.0, trials)
        trials = ratios(t.get("local_cpu", []), t.get("torchrun_cpu", []))
        target("launch CPU / torchrun", la["local_vs_torchrun_cpu"], "<=", 0.75, trials)
        trials = ratios(t.get("import_rank", []), t.get("import_plain", []))
        target("rank import CPU paused / plain", la["import_rank_vs_plain"], "<=", 0.95, trials)
    if "fsdp" in results:
        f, t = results["fsdp"], results["fsdp"].get("trials", {})
        target(
            "fsdp / ddp peak memory per rank, freed memory returned",
            f["held_rss_bytes_ratio"],
            "<=",
            0.3,
            t.get("held_rss_bytes", []),
        )
        target(
            "fsdp / ddp peak memory per rank, the kit's settings",
            f["peak_rss_bytes_ratio"],
            "<=",
            0.5,
            t.get("peak_rss_bytes", []),
        )
        target("fsdp / ddp samples/s", f["samples_per_s_ratio"], ">=", 0.85, t.get("samples_per_s", []))
        target("fsdp async / ddp rank-0 save stall", f["stall_s_ratio"], "<=", 0.1, t.get("stall_s", []))
    if "memory" in results.get("recovery", {}):
        _memory_targets(results["recovery"]["memory"], target)
    if "recovery" in results and "skipped" not in results["recovery"]:
        r, t = results["recovery"], results["recovery"].get("trials", {})
        target("recovery in place, s", r["in_place_s"], "<=", 15.0, t.get("in_place", []))
        trials = ratios(t.get("in_place", []), t.get("requeue", []))
        target("recovery in place / requeue", r["in_place_vs_requeue"], "<=", 0.3, trials)
    if "watchdog" in results:
        w, t = results["watchdog"], results["watchdog"].get("trials", {})
        trials = ratios(t.get("with", []), t.get("without", []))
        target("hang watch on / off", w["with_vs_without"], ">=", 0.99, trials)
    if "resume" in results:  # since issue 42
        rc, t = results["resume"], results["resume"].get("trials", {})
        target("resume check / its budget", rc["check_vs_budget"], "<=", 1.0, t.get("check_vs_budget", []))
    return found


def rows(results: dict[str, dict[str, Any]], s: Settings) -> list[tuple[str, str, str]]:
    """The table's rows (section, what, figure), the sections in the bench's order."""
    out: list[tuple[str, str, str]] = []
    for section, section_rows in ROWS.items():
        if section in results:
            out += section_rows(results[section], s)
    return out


def _overhead_rows(o: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return (
        [
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
        + (
            [("", "kit's own work per step (rank 0)", f"{o['kit_own_us_per_step']:,.0f} us")]
            if "kit_own_us_per_step" in o
            else []
        )
        + (
            [("", "  of which the gradient norm for the records", f"{o['grad_norm_us_per_step']:,.0f} us")]
            if "grad_norm_us_per_step" in o
            else []
        )
    )


def _scaling_rows(c: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return [
        (
            "scaling",
            f"kit, 1 rank on {c['one_rank_cpus']} CPU(s)",
            f"{c['one_rank_samples_per_s']:,.0f} samples/s",
        ),
        ("", f"kit, {c['ranks']} ranks", f"{c['samples_per_s']:,.0f} samples/s"),
        ("", f"efficiency, {c['ranks']} ranks / ({c['ranks']} x 1 rank)", f"{c['efficiency']:.2f}"),
    ]


def _checkpoint_rows(k: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return [
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


def _launch_rows(la: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return [
        ("launch", "submit --local: start to first step", f"{la['local_s']:.2f} s"),
        ("", "torchrun --standalone: start to first step", f"{la['torchrun_s']:.2f} s"),
        ("", "submit --local / torchrun", f"{la['local_vs_torchrun']:.2f}x"),
        ("", "submit --local: CPU, the whole run", f"{la['local_cpu_s']:.2f} CPU s"),
        ("", "torchrun --standalone: CPU, the whole run", f"{la['torchrun_cpu_s']:.2f} CPU s"),
        ("", "CPU submit --local / torchrun", f"{la['local_vs_torchrun_cpu']:.2f}x"),
        ("", "rank's torch import, collector paused", f"{la['import_rank_cpu_s']:.2f} CPU s"),
        ("", "the same imports, plainly", f"{la['import_plain_cpu_s']:.2f} CPU s"),
        ("", "paused / plain", f"{la['import_rank_vs_plain']:.2f}x"),
    ]


def _fsdp_rows(f: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return [
        (
            "fsdp",
            f"ddp, {f['ranks']} ranks, {f['params'] / 1e6:.1f} M parameters, AdamW",
            f"{f['ddp_samples_per_s']:,.1f} samples/s",
        ),
        ("", "fsdp, sharded async checkpoints", f"{f['fsdp_samples_per_s']:,.1f} samples/s"),
        ("", "samples/s fsdp / ddp", f"{f['samples_per_s_ratio']:.2f}x"),
        (
            "",
            "peak RSS per rank, ddp / fsdp (the kit's settings)",
            f"{f['ddp_peak_rss_bytes'] / 2**20:,.0f} / {f['fsdp_peak_rss_bytes'] / 2**20:,.0f} MiB",
        ),
        ("", "peak RSS fsdp / ddp (the kit's settings)", f"{f['peak_rss_bytes_ratio']:.2f}x"),
        (
            "",
            "peak RSS per rank, ddp / fsdp (freed memory returned)",
            f"{f['ddp_held_rss_bytes'] / 2**20:,.0f} / {f['fsdp_held_rss_bytes'] / 2**20:,.0f} MiB",
        ),
        ("", "peak RSS fsdp / ddp (freed memory returned)", f"{f['held_rss_bytes_ratio']:.2f}x"),
        (
            "",
            "loop stall per save, ddp full / fsdp sharded",
            f"{f['ddp_stall_s'] * 1e3:,.0f} / {f['fsdp_stall_s'] * 1e3:,.0f} ms",
        ),
        ("", "stall fsdp / ddp", f"{f['stall_s_ratio']:.3f}x"),
        (
            "",
            "fsdp background write / save interval",
            f"{f['fsdp_write_s']:.2f} / {f['fsdp_interval_s']:.2f} s",
        ),
        (
            "",
            "--async-save thread / process: loop stall per save",
            f"{f['fsdp_stall_s'] * 1e3:,.0f} / {f['fsdp_process_stall_s'] * 1e3:,.0f} ms",
        ),
        (
            "",
            "--async-save thread / process: background write",
            f"{f['fsdp_write_s']:.2f} / {f['fsdp_process_write_s']:.2f} s",
        ),
        (
            "",
            "step time during a write / without one, thread",
            f"{_s(f['fsdp_step_s_during_write'])} / {_s(f['fsdp_step_s_quiet'])} s",
        ),
        (
            "",
            "step time during a write / without one, process",
            f"{_s(f['fsdp_process_step_s_during_write'])} / {_s(f['fsdp_process_step_s_quiet'])} s",
        ),
        (
            "",
            "process: first save's write (starts the saving processes)",
            f"{f['fsdp_process_first_write_s']:.2f} s",
        ),
    ]


def _recovery_rows(r: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    rows = _memory_rows(r["memory"]) if "memory" in r else []
    if "skipped" in r:
        return rows + [("recovery" if not rows else "", "skipped", r["skipped"])]
    return rows + [
        ("" if rows else "recovery", "node lost -> next step, requeue (2 nodes)", f"{r['requeue_s']:.1f} s"),
        ("", "node lost -> next step, in place (2 + 1 spare)", f"{r['in_place_s']:.1f} s"),
        ("", "in place / requeue", f"{r['in_place_vs_requeue']:.2f}x"),
    ]


def _memory_targets(m: dict[str, Any], target: Callable[..., None]) -> None:
    """The memory path's targets (hpc_ddp.bench.memory): at most 1 step lost, a stall of at most 1 % of a
    step, recovery no slower than from disk."""
    t = m.get("trials", {})
    # A trial whose resumed attempt took no snapshot before the run ended (a --quick run's last steps) has no
    # stall figure: left out of the trials, and the figure is nan (not measured), never a crash of the table.
    per = {
        k: [trial[k] for trial in t.get("memory", []) if trial.get(k) is not None]
        for k in ("lost_steps", "stall_fraction")
    }
    target("recovery from memory: steps lost (worst)", m["memory_lost_steps"], "<=", 1.0, per["lost_steps"])
    target("snapshot stall / step time", m["stall_fraction"], "<=", 0.01, per["stall_fraction"])
    to = {k: [trial["to_next_step_s"] for trial in t.get(k, [])] for k in ("memory", "disk")}
    target(
        "recovery from memory / from disk, s",
        m["memory_vs_disk"],
        "<=",
        1.0,
        ratios(to["memory"], to["disk"]),
    )


def _memory_rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (
            "recovery",
            f"rank + its memory lost ({m['task']}), steps lost: disk every 50",
            f"{m['disk_lost_steps']:.0f}",
        ),
        ("", "steps lost: snapshots every step (worst)", f"{m['memory_lost_steps']:.0f}"),
        (
            "",
            "kill -> next step, from disk / from memory",
            f"{m['disk_to_next_step_s']:.1f} / {m['memory_to_next_step_s']:.1f} s",
        ),
        ("", "snapshot stall / step time", f"{100 * m['stall_fraction']:.2f} %"),
    ]


def _watchdog_rows(w: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return [
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


def _resume_rows(rc: dict[str, Any], s: Settings) -> list[tuple[str, str, str]]:
    return [
        (
            "resume",
            f"doctor resume: {rc['steps']} steps, {rc['ranks']} ranks, every kind",
            f"{rc['check_s']:.1f} s",
        ),
        ("", "the same options, uninterrupted", f"{rc['uninterrupted_s']:.1f} s"),
        ("", "restarts: its stops + the finished rerun", f"{rc['restarts']:.0f}"),
        ("", "start-up of one run (start to first step)", f"{rc['startup_s']:.1f} s"),
        ("", "check / (3 x run + restarts x start-up)", f"{rc['check_vs_budget']:.2f}x"),
    ]


# Each section's rows, in the table's order.
ROWS: dict[str, Callable[[dict[str, Any], Settings], list[tuple[str, str, str]]]] = {
    "overhead": _overhead_rows,
    "scaling": _scaling_rows,
    "checkpoint": _checkpoint_rows,
    "launch": _launch_rows,
    "fsdp": _fsdp_rows,
    "recovery": _recovery_rows,
    "resume": _resume_rows,
    "sweep": sweeping.rows,
    "watchdog": _watchdog_rows,
}


def table(results: dict[str, dict[str, Any]], s: Settings, load: float = 0.0, cpus: int = 0) -> str:
    """The figures and a line per target; `load`: the machine's load before the bench, on `cpus` CPUs."""
    cpus = cpus or len(os.sched_getaffinity(0))
    lines = [f"{a:<11} {b:<46} {c:>18}" for a, b, c in rows(results, s)]
    lines.append("")
    for t in targets(results):
        verdict = t.verdict(load, cpus)
        lines.append(f"target  {t.name:<34} {t.value:6.3f}  {t.op} {t.threshold:<5} {verdict}")
    if s.quick:
        lines.append("(--quick: one short trial per figure; this checks the bench, it measures nothing)")
    elif s.trials < MIN_TRIALS:
        lines.append(f"(fewer than {MIN_TRIALS} trials: indicative only on a shared machine)")
    return "\n".join(lines)


def header(s: Settings, sections: Sequence[str] = ()) -> str:
    """The settings line. The fsdp and resume sections run their own model and batch (bench/sharding.py,
    bench/resuming.py), so a run of one alone names those, and a run with others says that its rows name
    theirs."""
    runs = f"{s.trials} interleaved trial(s), {len(os.sched_getaffinity(0))} CPUs"
    if sections and set(sections) == {"fsdp"}:
        from hpc_ddp.bench import sharding

        return (
            f"hpc_ddp.bench: task {sharding.TASK}, {s.world_size} ranks x batch {sharding.batch(s)}, "
            f"{sharding.steps(s)} steps, {runs}"
        )
    if sections and set(sections) == {"resume"}:
        from hpc_ddp.bench import resuming

        return (
            f"hpc_ddp.bench: task {resuming.TASK_SPEC}, {s.world_size} ranks, {resuming.steps(s)} steps, "
            f"{runs}"
        )
    others = [name for name in ("fsdp", "resume") if name in sections]
    each = "its" if len(others) == 1 else "each its"
    other = f" ({', '.join(others)}: {each} own model and batch, in its rows)" if others else ""
    return f"hpc_ddp.bench: task {TASK}, {s.world_size} ranks x batch {s.batch_size}, {s.steps} steps{other}, {runs}"


def _s(seconds: float | None) -> str:
    """A step time in seconds, or "n/a" where no trial measured it (hpc_ddp.bench.runs.median_of_measured)."""
    return "n/a" if seconds is None else f"{seconds:.2f}"
