"""`python -m hpc_ddp.bench scale`: the kit's control plane at thousands of simulated ranks (docs/scale.md).

    python -m hpc_ddp.bench scale                           # 1,024 to 8,192 ranks, every part
    python -m hpc_ddp.bench scale --ranks 256,512 --parts hang,judge --json s.json
    python -m hpc_ddp.bench scale --real 2x2                # also a real local run and a SIGSTOPped rank

No training: threads of this one process play each rank's control-plane part, through the kit's own code.
Parts: rendezvous (N store clients join rank 0's store), hang (N
ranks' watchdogs, one rank silent: the verdict must name it), judge (N exit notes, one real first cause among
"a peer went": read and judged), files (what each rank adds to the run folder per attempt), report (`python -m
hpc_ddp.report` over N ranks' records), slurm (Slurm commands per look of `submit --wait`). Each figure at each
size, and its growth: the exponent k of a least-squares fit of figure = c x N^k (1: linear).

What one process cannot show: a cluster's ranks run in parallel, on their own CPUs and connections; here they
share this machine's cores and one interpreter's lock, so a part whose ranks each do work (the hang's reports)
takes longer here, rank after rank, than on a cluster. Its figures say so (`reports_spread_s`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError

PROG = "python -m hpc_ddp.bench scale"
PARTS = ("rendezvous", "hang", "judge", "files", "report", "slurm")
DEFAULT_RANKS = (1024, 2048, 4096, 8192)
# (part, figure, at most, what the issue asks): judged at the largest size measured
TARGETS = (
    ("rendezvous", "seconds", 30.0, "rendezvous of 8,192 clients <= 30 s"),
    ("hang", "verdict_after_limit_s", 15.0, "verdict <= 15 s after the limit, the silent rank named"),
    ("judge", "judge_s", 1.0, "judge <= 1 s"),
    ("report", "seconds", 60.0, "report <= 60 s"),
)
# The figures whose growth is fitted, per part
GROWTH = {
    "rendezvous": ("seconds", "seconds_less_stalls"),
    "hang": ("verdict_after_limit_s", "reports_spread_s", "cpu_ms_per_rank", "hang_json_bytes"),
    "judge": ("read_s", "judge_s", "note_bytes"),
    "files": ("start_files_per_rank", "start_bytes_per_rank"),
    "report": ("seconds", "metrics_bytes", "attempts_bytes"),
    "slurm": ("calls_running", "calls_failed"),
}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser(PROG, __doc__ or "")
    parser.add_argument(
        "--ranks",
        default=",".join(str(n) for n in DEFAULT_RANKS),
        help="simulated world sizes, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="parts to run (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON here")
    parser.add_argument(
        "--folder",
        metavar="DIR",
        help="where the simulated run folders go (default: a temporary folder in /dev/shm when there is one, "
        "removed at the end: a shared file system's own cost is measured by pointing this at it)",
    )
    parser.add_argument(
        "--real",
        metavar="NODESxRANKS",
        help="also a real local run of NODES x RANKS ranks, and one with a rank SIGSTOPped (e.g. 8x16)",
    )
    ns = parser.parse_args(argv)
    try:
        ns.sizes = sorted({int(x) for x in ns.ranks.split(",") if x.strip()})
    except ValueError:
        ns.sizes = []
    if not ns.sizes or min(ns.sizes) < 4:
        raise UsageError(f"--ranks {ns.ranks}: expected world sizes of 4 or more, e.g. --ranks 1024,2048")
    ns.chosen = [p.strip() for p in ns.parts.split(",") if p.strip()]
    unknown = [p for p in ns.chosen if p not in PARTS]
    if unknown or not ns.chosen:
        raise UsageError(f"--parts {ns.parts}: choose from {', '.join(PARTS)}")
    if ns.folder and not Path(ns.folder).is_dir():
        raise UsageError(f"--folder {ns.folder}: no such folder. Fix: create it, or leave --folder out")
    if ns.json and not Path(ns.json).resolve().parent.is_dir():
        raise UsageError(f"--json {ns.json}: its folder does not exist. Fix: create it or write it elsewhere")
    if ns.real is not None:
        from hpc_ddp.bench.scale_real import shape

        ns.real = shape(ns.real)
    return ns


def exponent(sizes: Sequence[int], values: Sequence[float | None]) -> float | None:
    """k of the least-squares fit of value = c x size^k over the positive values (pure); None with fewer
    than 2, or when every value is the same size of zero."""
    pairs = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v and v > 0]
    if len(pairs) < 2:
        return None
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    return round(sum((x - mx) * (y - my) for x, y in pairs) / sxx, 2) if sxx else None


def _part(name: str, folder: Path, n: int) -> dict[str, Any]:
    from hpc_ddp.bench import scale_hang, scale_parts

    where = folder / f"{name}-{n}"
    where.mkdir(parents=True, exist_ok=True)
    run: dict[str, Callable[[], dict[str, Any]]] = {
        "rendezvous": lambda: scale_parts.rendezvous(n),
        "hang": lambda: scale_hang.hang(where, n),
        "judge": lambda: scale_parts.notes_and_judge(where, n),
        "files": lambda: scale_parts.files_per_rank(where, n),
        "report": lambda: scale_parts.report(where, n),
        "slurm": lambda: scale_parts.slurm_calls(n),
    }
    try:
        return run[name]()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def measure(sizes: Sequence[int], parts: Sequence[str], folder: Path, say: Callable[[str], None] = print):
    """Every part at every size: {part: {"sizes": [...], "runs": [figures...], "growth": {figure: k}}}."""
    results: dict[str, dict[str, Any]] = {}
    for name in parts:
        runs = []
        for n in sizes:
            begun = time.monotonic()
            figures = _part(name, folder, n)
            figures["wall_s"] = round(time.monotonic() - begun, 2)
            say(
                f"scale: {name} at {n} ranks: "
                + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "ranks")
            )
            runs.append(figures)
        growth = {f: exponent(sizes, [r.get(f) for r in runs]) for f in GROWTH[name]}
        results[name] = {"sizes": list(sizes), "runs": runs, "growth": growth}
    return results


def verdicts(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target, at the largest size its part ran (pure)."""
    out = []
    for part, figure, most, text in TARGETS:
        if part not in results:
            continue
        last = results[part]["runs"][-1]
        value = last.get(figure)
        met = value is not None and value <= most
        if part == "hang":
            met = met and last.get("named") == [last.get("silent")]
        out.append({"target": text, "ranks": last["ranks"], "value": value, "met": met})
    return out


def table(results: dict[str, dict[str, Any]], judged: list[dict[str, Any]]) -> str:
    lines = []
    for part, found in results.items():
        for figure in GROWTH[part]:
            values = "  ".join(f"{r['ranks']}: {r.get(figure)}" for r in found["runs"])
            lines.append(f"{part:<11}{figure:<26}{values}   growth N^{found['growth'][figure]}")
    for t in judged:
        lines.append(
            f"target: {t['target']}: {t['value']} at {t['ranks']} ranks: {'met' if t['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(argv)
    base = ns.folder or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    folder = Path(tempfile.mkdtemp(prefix="hpc_ddp-scale-", dir=base))
    try:
        results = measure(ns.sizes, ns.chosen, folder)
        if ns.real is not None:
            from hpc_ddp.bench.scale_real import real

            results["real"] = real(folder, *ns.real)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    judged = verdicts(results)
    print(table({k: v for k, v in results.items() if k in PARTS}, judged), flush=True)
    for what, figures in results.get("real", {}).items():
        print(f"real {what}: " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"results": results, "targets": judged}, indent=1) + "\n")
    return 0
