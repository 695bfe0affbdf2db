"""The report's plots as PNG bytes, drawn with matplotlib's headless Agg backend (no display, no window)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.report.recorded import Recorded
from hpc_ddp.report.timeline import Summary

MAX_COLUMNS = 1000  # of the heat map; more "ranks" records are drawn by windows
INSTALL = "pip install 'hpc-ddp[report]' (or: pip install matplotlib; env/setup.sh installs it)"
# One color per part of the time breakdown, in the order the parts are stacked.
PARTS = (
    ("queue", "queue wait before", "#7f7f7f"),  # "between attempts" where no queue was (a local run)
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


# The page shows a figure at its size in CSS pixels (96 to an inch, as matplotlib's figsize is meant) and the PNG
# holds twice as many in each direction: crisp on a 2x screen, never stretched (page.py sets each image's size
# from its PNG: width / SCALE). Without bbox "tight", a figure's pixels are exactly figsize x DPI.
CSS_DPI = 96
SCALE = 2
DPI = CSS_DPI * SCALE


def _png(fig: Any) -> bytes:
    width, height = fig.get_size_inches()  # to whole CSS pixels: the PNG is then exactly SCALE x them
    fig.set_size_inches(round(width * CSS_DPI) / CSS_DPI, round(height * CSS_DPI) / CSS_DPI)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    fig.clf()
    pyplot().close(fig)
    return buf.getvalue()


MAX_POINTS = 4000  # drawn per line: a longer series is thinned to each bucket's lowest and highest point


def thin(
    xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS
) -> tuple[list[float], list[float]]:
    """At most about `limit` points of a line (pure): in each of limit / 2 buckets, its lowest and highest
    point in x order, so that a spike survives; the last point is always kept."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    size = -(-n // (limit // 2))
    keep: list[int] = []
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        low = min(range(lo, hi), key=ys.__getitem__)
        high = max(range(lo, hi), key=ys.__getitem__)
        keep += sorted({low, high})
    if keep[-1] != n - 1:
        keep.append(n - 1)
    return [xs[i] for i in keep], [ys[i] for i in keep]


def time_unit(span_s: float) -> tuple[float, str]:
    """(seconds per unit, unit) for a time axis of `span_s` seconds: s up to 2 min, min up to 2 h, then h."""
    if span_s <= 120:
        return 1.0, "seconds"
    if span_s <= 7200:
        return 60.0, "minutes"
    return 3600.0, "hours"


def loss_png(run: Recorded) -> bytes | None:
    losses = run.losses()
    if not losses:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    marker = "." if sum(len(s) for s in losses) < 60 else None  # dots only where they are few
    for k, series in enumerate(losses):
        ax.plot(*thin(series.steps, series.values), marker=marker, label=f"attempt {k + 1}")
    if min(min(s.values) for s in losses) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("Loss")
    if len(losses) > 1:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def lr_png(run: Recorded) -> bytes | None:
    """The learning rate (the first parameter group's) at each recorded step, one line per attempt."""
    lrs = run.lrs()
    if not lrs:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    marker = "." if sum(len(s) for s in lrs) < 60 else None
    for k, series in enumerate(lrs):
        ax.plot(*thin(series.steps, series.values), marker=marker, label=f"attempt {k + 1}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate (first group)")
    ax.set_title("Learning rate")
    ax.set_ylim(bottom=0)
    if len(lrs) > 1:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def throughput_axes(ax: Any, run: Recorded) -> bool:
    """Draw samples/s against the time since the first point on `ax`; False if the run has no rate at all."""
    rates = run.rates()  # a process's first step has no rate; a run without step records: its epochs'
    if not rates:
        return False
    t0 = min(s.times[0] for s in rates)
    scale, unit = time_unit(max(s.times[-1] for s in rates) - t0)
    marker = "." if sum(len(s) for s in rates) < 60 else None
    for k, series in enumerate(rates):
        ax.plot(
            *thin([(t - t0) / scale for t in series.times], series.values),
            marker=marker,
            label=f"attempt {k + 1}",
        )
    ax.set_xlabel(f"{unit} since the first record")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title("Throughput")
    ax.set_ylim(bottom=0)
    if len(rates) > 1:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return True


def throughput_png(run: Recorded) -> bytes | None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    if not throughput_axes(ax, run):
        plt.close(fig)
        return None
    fig.tight_layout()
    return _png(fig)


def restart_columns(run: Recorded, max_columns: int = MAX_COLUMNS) -> list[tuple[int, str]]:
    """(column, "start" or "restart") of the heat map's columns that hold a process's first "ranks" record:
    its window has the process's first step, which pays for warm-up (DDP's buckets, the allocator, a resume's
    load) on every rank: slow, and no straggler."""
    found: dict[int, str] = {}
    for k, seg in enumerate(run.segments):
        if seg.first_ranks is not None:
            found.setdefault(run.heat.column(seg.first_ranks, max_columns), "restart" if k else "start")
    return sorted(found.items())


def heatmap_axes(fig: Any, ax: Any, run: Recorded) -> bool:
    """Draw the per-rank step times on `ax`; the columns of a (re)start's warm-up are hatched, labelled and
    left out of the color scale (so that a real straggler, not a warm-up, sets it). False without "ranks"
    records."""
    steps, rows = run.heat.grid(MAX_COLUMNS)
    if not steps:
        return False
    restarts = restart_columns(run)
    skip = {i for i, _ in restarts}
    others = [v for row in rows for i, v in enumerate(row) if i not in skip and not math.isnan(v)]
    vmax = max(others, default=None)
    # From 0 ms: ranks within a few percent of each other look alike; one at 1.5x the others stands out.
    image = ax.imshow(
        [[v * 1000 for v in row] for row in rows],
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=0,
        vmax=None if vmax is None else vmax * 1000,
        extent=(-0.5, len(steps) - 0.5, len(rows) - 0.5, -0.5),
    )
    for i, label in restarts:
        ax.axvspan(i - 0.5, i + 0.5, facecolor="white", alpha=0.55, hatch="//", edgecolor="#555", linewidth=0)
        ax.text(i, -0.5, label, rotation=90, fontsize=7, ha="center", va="bottom", color="#333")
    ticks = sorted({round(i) for i in [k * (len(steps) - 1) / 5 for k in range(6)]})
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    if len(rows) <= 16:
        ax.set_yticks(range(len(rows)))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("rank")
    ax.set_title("Step time per rank (ms): a straggler is a bright row", pad=30 if restarts else 6)
    fig.colorbar(image, ax=ax, label="ms")
    return True


def heatmap_png(run: Recorded) -> bytes | None:
    plt = pyplot()
    rows = max(len(run.heat.rows), 1)
    fig, ax = plt.subplots(figsize=(6.0, 1.6 + 0.25 * min(rows, 32)))
    if not heatmap_axes(fig, ax, run):
        plt.close(fig)
        return None
    fig.tight_layout()
    return _png(fig)


def breakdown_png(summary: Summary) -> bytes | None:
    if not summary.attempts:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 1.6 + 0.45 * (len(summary.attempts) + 1)), layout="constrained")
    labels = [f"attempt {k + 1}" for k in range(len(summary.attempts))] + ["all"]
    parts = {
        name: [getattr(a, "queue_before_s" if name == "queue" else f"{name}_s") for a in summary.attempts]
        + [getattr(summary, f"{name}_s")]
        for name, _, _ in PARTS
    }
    scale, unit = time_unit(summary.allocated_s + summary.queue_s)
    left = [0.0] * len(labels)
    for name, label, color in PARTS:
        label = label if name != "queue" or summary.queued else "between attempts"
        values = [v / scale for v in parts[name]]
        ax.barh(labels, values, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    goodput = f"{summary.goodput:.1%}" if summary.goodput is not None else "n/a"
    ax.set_title(f"Where the time went (goodput {goodput})")
    fig.legend(fontsize="small", ncol=3, loc="outside lower center")
    return _png(fig)


MAX_EVAL_PANELS = 6  # evaluation metrics drawn (in name order); the table has them all


def evaluation_png(run: Recorded) -> bytes | None:
    """Each evaluation metric against the step, one panel each; None for a run without evaluations. With
    --keep-best, the evaluation whose checkpoint `checkpoints/best` names is starred on its metric's panel."""
    best = run.best()
    return _panels(run.eval_series(), "eval", (best.metric, best.step) if best is not None else None)


def train_metrics_png(run: Recorded) -> bytes | None:
    """Each value a Task.step returns besides its loss, against the step; None for a run without any."""
    return _panels(run.extra_series(), "train")


def _panels(
    by_name: dict[str, tuple[list[int], list[float]]], kind: str, star: tuple[str, int] | None = None
) -> bytes | None:
    series = list(by_name.items())[:MAX_EVAL_PANELS]
    if not series:
        return None
    plt = pyplot()
    columns = min(len(series), 3)
    rows = -(-len(series) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(series) :]:
        ax.set_visible(False)
    for ax, (name, (steps, values)) in zip(axes.flat, series, strict=False):
        ax.plot(steps, values, marker="." if len(steps) < 60 else None)
        if star is not None and star[0] == name and star[1] in steps:
            at = steps.index(star[1])
            ax.plot([steps[at]], [values[at]], marker="*", markersize=14, color="#d62728", linestyle="none")
            ax.annotate("best (kept)", (steps[at], values[at]), textcoords="offset points", xytext=(6, 6))
        ax.set_title(f"{kind} {name}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def draw(run: Recorded, summary: Summary) -> dict[str, bytes]:
    """Every plot there is data for, by file name (a run without "ranks" records has no heat map)."""
    pngs = {
        "loss.png": loss_png(run),
        "lr.png": lr_png(run),
        "throughput.png": throughput_png(run),
        "step-time-heatmap.png": heatmap_png(run),
        "time-breakdown.png": breakdown_png(summary),
        "train-metrics.png": train_metrics_png(run),
        "evaluation.png": evaluation_png(run),
    }
    return {name: png for name, png in pngs.items() if png is not None}
