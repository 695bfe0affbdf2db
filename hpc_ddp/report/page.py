"""The report as one self-contained HTML page: every plot inline as a data: URL, no script, no link out."""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Mapping, Sequence

from hpc_ddp.report.recorded import Best, Evaluation, Recorded
from hpc_ddp.report.timeline import Attempt, Summary

CAPTIONS = {
    "loss.png": "Loss (mean over ranks) at each recorded step, one line per attempt.",
    "lr.png": "Learning rate (the optimizer's first parameter group's) at each recorded step, one line per "
    "attempt.",
    "throughput.png": "Samples per second over all ranks, measured from each process's second step.",
    "step-time-heatmap.png": 'Each rank\'s own work per step (data + compute) from the "ranks" records, '
    "every 5 steps (in a long run, the slowest of each window): a rank slower than "
    "the others shows as a bright row. The window of each start's first step (warm-up, on every rank) is "
    'hatched, marked "start" or "restart" and left out of the color scale.',
    "time-breakdown.png": "Where each attempt's time went, from the time before it (a queue wait, or the time "
    'between attempts; not allocated) to its end; "all" sums the attempts.',
    "train-metrics.png": "Each value the task's step returns besides its loss (the mean over the step's "
    "micro-batches and all ranks) at each recorded step, and grad_norm: the gradients' norm before clipping.",
    "evaluation.png": "Each evaluation metric (the mean over every evaluated sample, all ranks) at the step it "
    "was evaluated at; with --keep-best, a star marks the evaluation whose checkpoint checkpoints/best keeps.",
}
# A run without an evaluation set, or whose step returns nothing but its loss, has none: no "missing" line.
OPTIONAL = {"evaluation.png", "train-metrics.png", "lr.png"}

DEFINITIONS = """
<h2>Definitions</h2>
<p>All times are seconds of wall-clock time, from the records' time stamps. An <b>attempt</b> is one start of
the run's processes (job, restart). Its <b>allocated</b> time runs from its processes' start (rank 0's start
record time minus its startup_s) to its end (the supervisor's end line in attempts.jsonl, else its last
record), and is cut into parts that add up to it:</p>
<ul>
<li><b>startup</b>: process start to the first optimizer step;</li>
<li><b>productive</b>: first step to the last step that the run kept (and its save), minus the stalls of
the saves up to it;</li>
<li><b>checkpoint stalls</b>: the time saves held the training thread (each save's stall_s; a final save's
includes the wait until it is durable);</li>
<li><b>lost work</b>: from the attempt's last kept step (the checkpoint the next attempt resumed from, or the
one it ended with) to its last step, minus the stalls there: steps trained and then thrown away after a
failure or preemption, which the next attempt replays;</li>
<li><b>after the last step</b>: from the attempt's last step (its end record, else its last record) to its
end: writing model.pth, teardown, hang detection, exit.</li>
</ul>
<p><b>Goodput</b> = productive / allocated, summed over attempts. The time <b>between attempts</b> (from an
attempt's end to the next one's process start; Slurm's accounting when sacct answers) is shown but is not
allocated time; it is a <b>queue wait</b> where the job waited in Slurm's queue (a requeue), and only the time
between attempts where no queue was (a local run's restart, a new command). A <b>failure</b> is an attempt that ended failed, hung, or with its node
or its processes lost, or that lost steps. The best checkpoint interval is Young/Daly's first-order
optimum <b>&tau; = sqrt(2 &times; C &times; M)</b>, in seconds of training between checkpoints, with C the
mean checkpoint stall (s) and M the mean time between failures = allocated time / failures (s).</p>
"""


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds == 0:
        return "0 s"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.3g} ms"
    if abs(seconds) < 60:
        return f"{seconds:.1f} s"
    if abs(seconds) < 3600:
        return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def steps_text(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"


def number(value: float | None, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


SMOOTHED = (10, 50)  # the headline loss without an evaluation: the mean of the last tenth of the run's steps,
# at least 10 (or all there are) and at most 50 (the last fifty of a 70-step run would still hold its first losses)


def key_metric(run: Recorded) -> tuple[str, str]:
    """The run's headline number, named: the latest evaluation's metrics, or else the training loss smoothed
    over the last SMOOTHED steps, labelled so (a single minibatch's loss, lowest or last, is noise)."""
    evals = run.evaluations()
    if evals:
        latest = evals[-1]
        shown = ", ".join(f"{name} {number(value)}" for name, value in latest.metrics)
        return "latest evaluation", f"{shown} at step {latest.step}"
    least, most = SMOOTHED
    smoothed = run.smoothed_loss(min(most, max(least, run.loss_steps() // 10)))
    if smoothed is None:
        return "smoothed training loss", "n/a"
    mean, n = smoothed
    return "smoothed training loss", f"{number(mean)} (mean of the last {steps_text(n)})"


def headline(s: Summary, key: tuple[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, value) rows of the summary table; the CLI prints some of them on one line. `key`: the headline
    metric (key_metric)."""
    steps = f" (about {s.best_interval_steps} steps)" if s.best_interval_steps else ""
    interval = f"n/a ({s.no_interval})" if s.best_interval_s is None else duration(s.best_interval_s) + steps
    return [
        ("state", s.state),
        ("attempts", str(len(s.attempts))),
        ("steps reached", str(s.steps)),
        *([key] if key is not None else []),
        ("last step's loss", number(s.final_loss)),
        ("goodput", "n/a" if s.goodput is None else f"{s.goodput:.1%}"),
        ("allocated", duration(s.allocated_s)),
        ("productive", duration(s.productive_s)),
        ("startup", duration(s.startup_s)),
        ("checkpoint stalls", f"{duration(s.stalls_s)} in {s.saves} saves"),
        ("lost work", f"{duration(s.lost_s)} ({steps_text(s.lost_steps)} replayed)"),
        ("after the last step", duration(s.after_s)),
        ("queue wait between attempts" if s.queued else "time between attempts", duration(s.queue_s)),
        *(
            [("restarts in place (allocation held)", f"{s.restarts_in_place}: {duration(s.held_s)}")]
            if s.restarts_in_place
            else []
        ),
        ("failures", str(s.failures)),
        ("MTBF", duration(s.mtbf_s)),
        ("checkpoint cost C (mean stall)", duration(s.save_cost_s)),
        ("checkpoint interval as run", duration(s.save_interval_s)),
        ("best checkpoint interval sqrt(2 C M)", interval),
        ("median step time", duration(s.step_time_s)),
    ]


def _attempts_table(s: Summary) -> str:
    head = (
        "#",
        "job",
        "restart",
        "nodes",
        "started",
        "resumed at",
        "last step",
        "lost steps",
        "outcome",
        "decision",
        "reason",
        "allocated",
        "startup",
        "productive",
        "stalls",
        "lost",
        "after",
        "queue before" if s.queued else "between attempts",
    )
    rows = []
    for k, a in enumerate(s.attempts):
        cells = (
            str(k + 1),
            a.job,
            str(a.restart),
            " ".join(a.nodes),
            _clock(a.process_start),
            str(a.resumed_at),
            str(a.last_step),
            str(a.lost_steps),
            a.outcome,
            _decision(a),
            a.reason,
            *(
                duration(x)
                for x in (
                    a.allocated_s,
                    a.startup_s,
                    a.productive_s,
                    a.stalls_s,
                    a.lost_s,
                    a.after_s,
                    a.queue_before_s,
                )
            ),
        )
        rows.append(
            "<tr>"
            + "".join(
                _text_cell(c) if head[i] in ("nodes", "reason") else f"<td>{html.escape(c)}</td>"
                for i, c in enumerate(cells)
            )
            + "</tr>"
        )
    return (
        "<table class=attempts><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def _decision(a: Attempt) -> str:
    """The decision, and for a restart in place (--spare-nodes) what it moved and how long it took."""
    if a.recovery_s is None and not a.left and not a.spares_in:
        return a.decision
    moves = [
        *([f"{','.join(a.left)} left"] if a.left else []),
        *([f"{','.join(a.spares_in)} in"] if a.spares_in else []),
    ]
    took = [f"next step {duration(a.recovery_s)} later"] if a.recovery_s is not None else []
    return f"{a.decision} in place ({'; '.join([', '.join(moves) or 'same nodes', *took])})"


def _text_cell(text: str) -> str:
    """A cell of free text (node names, a reason) that wraps at its spaces only: a word with a character a
    browser may break after (the hyphens of "gpu-node-001", a path's slashes) is kept whole in a span."""
    words = (
        html.escape(w) if w.isalnum() else f"<span class=w>{html.escape(w)}</span>" for w in text.split(" ")
    )
    return f"<td class=text>{' '.join(words)}</td>"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def evaluations_table(evals: Sequence[Evaluation], best: Best | None = None) -> str:
    """The "eval" records as a table: step, epoch, samples, one column per metric; empty without any. With
    --keep-best, a last column marks the evaluation whose checkpoint `checkpoints/best` keeps."""
    if not evals:
        return ""
    names = sorted({name for e in evals for name, _ in e.metrics})
    columns = ("step", "epoch", "samples", *names, *(["kept as best"] if best is not None else []))
    head = "".join(f"<th>{html.escape(h)}</th>" for h in columns)
    rows = []
    for e in evals:
        values = dict(e.metrics)
        cells = [
            str(e.step),
            "" if e.epoch is None else str(e.epoch),
            "" if e.samples is None else str(e.samples),
        ]
        cells += [number(values.get(name)) for name in names]
        if best is not None:
            cells.append(f"\u2605 best {best.metric}" if e.step == best.step else "")
        marked = " class=best" if best is not None and e.step == best.step else ""
        rows.append(f"<tr{marked}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<h2>Evaluations</h2>\n<div class=scroll><table class=evals><tr>{head}</tr>{''.join(rows)}</table></div>"


def png_size(data: bytes) -> tuple[int, int]:
    """A PNG's width and height in pixels (its IHDR chunk)."""
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def render(
    title: str,
    s: Summary,
    pngs: Mapping[str, bytes],
    generated: float,
    read: str,
    evals: Sequence[Evaluation] = (),
    key: tuple[str, str] | None = None,
    best: Best | None = None,
) -> str:
    """The whole page. `pngs`: file name -> PNG bytes, each shown inline in CAPTIONS order at its size in CSS
    pixels (plots.SCALE PNG pixels to one); `read`: what the numbers come from (the files, and sacct when it
    answered); `evals`: the evaluations' table (one a step); `key`: the headline metric (key_metric); `best`:
    --keep-best's kept evaluation."""
    from hpc_ddp.report.plots import SCALE

    goodput = "n/a" if s.goodput is None else f"{s.goodput:.1%}"
    attempts = f"{len(s.attempts)} attempt{'s' * (len(s.attempts) != 1)}"
    metric = f"{key[0]}: {key[1]}" if key is not None else f"last step's loss {number(s.final_loss)}"
    lead = (
        f"Goodput {goodput} &middot; {html.escape(s.state)} &middot; {attempts} &middot; step {s.steps} "
        f"&middot; {html.escape(metric)}"
    )
    rows = [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in headline(s, key)]
    half = (len(rows) + 1) // 2
    tables = f"<table>{''.join(rows[:half])}</table><table>{''.join(rows[half:])}</table>"
    figures = []
    for name, caption in CAPTIONS.items():
        if name in pngs:
            data = base64.b64encode(pngs[name]).decode()
            width, height = (n // SCALE for n in png_size(pngs[name]))
            figures.append(
                f'<figure style="width: {width}px"><img src="data:image/png;base64,{data}" '
                f'width={width} height={height} alt="{html.escape(name)}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
        elif name not in OPTIONAL:
            figures.append(f"<p class=missing>{html.escape(name)}: no records for it in this run.</p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; }}
th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: left; font-size: 14px; white-space: nowrap; }}
td.text, table.attempts th {{ white-space: normal; }}
td.text {{ min-width: 8em; }}
td.text .w {{ white-space: nowrap; }}
th {{ background: #f3f3f3; }}
.grid, .summary {{ display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-start; }}
figure {{ margin: 0; max-width: 100%; }}
figure img {{ max-width: 100%; height: auto; display: block; }}
.scroll {{ overflow-x: auto; max-width: 100%; }}
tr.best td {{ background: #fff4d6; }}
figcaption, .missing {{ font-size: 13px; color: #555; }}
.lead {{ font-size: 20px; font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class=lead>{lead}</p>
<p>Generated {html.escape(_clock(generated))} from {html.escape(read)}.</p>
<div class=summary>{tables}</div>
<div class=grid>{"".join(figures)}</div>
{evaluations_table(evals, best)}
<h2>Attempts</h2>
<div class=scroll>{_attempts_table(s)}</div>
{DEFINITIONS}
</body></html>
"""
