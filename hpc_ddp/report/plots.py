"""The report's plots as PNG bytes, drawn with matplotlib's headless Agg backend (no display, no window)."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.report.records import heat_map, segments
from hpc_ddp.report.timeline import Summary

MAX_COLUMNS = 1000  # of the heat map; more "ranks" records are drawn by windows
INSTALL = "pip install 'hpc-ddp[report]' (or: pip install matplotlib; env/setup.sh installs it)"
# One color per part of the time breakdown, in the order the parts are stacked.
PARTS = (
    ("queue", "queue wait before", "#7f7f7f"),
    ("startup", "startup", "#1f77b4"),
    ("productive", "productive", "#2ca02c"),
    ("stalls", "checkpoint stalls", "#ff7f0e"),
    ("lost", "lost work", "#d62728"),
    ("after", "after the last step", "#9467bd"),
)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or UsageError with the install line."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            f"matplotlib is not installed; the report draws its plots with it. Fix: {INSTALL}"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    fig.clf()
    pyplot().close(fig)
    return buf.getvalue()


Series = list[tuple[list[float], list[float], list[float]]]


def _by_attempt(records: Sequence[Mapping[str, Any]], event: str, key: str, positive: bool = False) -> Series:
    """(steps, times, values) of `event` records with a finite `key` (> 0 if `positive`), one triple per
    process start."""
    found = []
    for seg in segments(records):
        rows = [
            (r["step"], r["time"], r[key])
            for r in seg.records
            if r.get("event") == event
            and isinstance(r.get("step"), int)
            and isinstance(r.get(key), (int, float))
            and math.isfinite(r[key])
            and (r[key] > 0 or not positive)
        ]
        if rows:
            found.append(([s for s, _, _ in rows], [t for _, t, _ in rows], [v for _, _, v in rows]))
    return found


def loss_png(records: Sequence[Mapping[str, Any]]) -> bytes | None:
    runs = _by_attempt(records, "step", "loss") or _by_attempt(records, "epoch", "loss")
    if not runs:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    marker = "." if sum(len(run[0]) for run in runs) < 60 else None  # dots only where they are few
    for k, (steps, _, values) in enumerate(runs):
        ax.plot(steps, values, marker=marker, label=f"attempt {k + 1}")
    if min(v for run in runs for v in run[2]) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("Loss")
    if len(runs) > 1:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def throughput_png(records: Sequence[Mapping[str, Any]]) -> bytes | None:
    runs = _by_attempt(records, "step", "samples_per_s", positive=True)  # a process's first step has no rate
    if not runs:
        return None
    t0 = min(run[1][0] for run in runs)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    marker = "." if sum(len(run[0]) for run in runs) < 60 else None
    for k, (_, times, values) in enumerate(runs):
        ax.plot([(t - t0) / 60 for t in times], values, marker=marker, label=f"attempt {k + 1}")
    ax.set_xlabel("minutes since the first record")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title("Throughput")
    ax.set_ylim(bottom=0)
    if len(runs) > 1:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def heatmap_png(records: Sequence[Mapping[str, Any]]) -> bytes | None:
    steps, rows = heat_map(records, MAX_COLUMNS)
    if not steps:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 1.4 + 0.25 * min(len(rows), 32)))
    # From 0 ms: ranks within a few percent of each other look alike; one at 1.5x the others stands out.
    image = ax.imshow(
        [[v * 1000 for v in row] for row in rows],
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=0,
        extent=(-0.5, len(steps) - 0.5, len(rows) - 0.5, -0.5),
    )
    ticks = sorted({round(i) for i in [k * (len(steps) - 1) / 5 for k in range(6)]})
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    if len(rows) <= 16:
        ax.set_yticks(range(len(rows)))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("rank")
    ax.set_title("Step time per rank (ms): a straggler is a bright row")
    fig.colorbar(image, ax=ax, label="ms")
    fig.tight_layout()
    return _png(fig)


def breakdown_png(summary: Summary) -> bytes | None:
    if not summary.attempts:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 1.6 + 0.45 * (len(summary.attempts) + 1)), layout="constrained")
    labels = [f"attempt {k + 1}" for k in range(len(summary.attempts))] + ["all"]
    parts = {
        name: [getattr(a, "queue_before_s" if name == "queue" else f"{name}_s") for a in summary.attempts]
        + [getattr(summary, f"{name}_s")]
        for name, _, _ in PARTS
    }
    scale, unit = (60, "minutes") if summary.allocated_s + summary.queue_s > 180 else (1, "seconds")
    left = [0.0] * len(labels)
    for name, label, color in PARTS:
        values = [v / scale for v in parts[name]]
        ax.barh(labels, values, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    goodput = f"{summary.goodput:.1%}" if summary.goodput is not None else "n/a"
    ax.set_title(f"Where the time went (goodput {goodput})")
    fig.legend(fontsize="small", ncol=3, loc="outside lower center")
    return _png(fig)


def draw(records: Sequence[Mapping[str, Any]], summary: Summary) -> dict[str, bytes]:
    """Every plot there is data for, by file name (a run without "ranks" records has no heat map)."""
    pngs = {
        "loss.png": loss_png(records),
        "throughput.png": throughput_png(records),
        "step-time-heatmap.png": heatmap_png(records),
        "time-breakdown.png": breakdown_png(summary),
    }
    return {name: png for name, png in pngs.items() if png is not None}
