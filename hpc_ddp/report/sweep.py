"""`python -m hpc_ddp.report <sweep folder>`: one page for a sweep (hpc_ddp.launch.sweep): a table of its trials
with their varied values and outcomes, sortable by any column (the loss, say), their loss curves overlaid, each
trial's goodput, and a link to each trial's own report (written beside it, <trial>/report.html).

Every number is read from the trial's own folder, as its own report reads it: its state from its ledger
(hpc_ddp.launch.sweep.state), its losses from metrics.jsonl, its goodput from its own report's summary.
"""

from __future__ import annotations

import base64
import html
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.errors import UsageError
from hpc_ddp.launch.sweep import state, summary
from hpc_ddp.report import plots
from hpc_ddp.run.folder import atomic_write_bytes

CURVES = "sweep-loss.png"
GOODPUT = re.compile(r"goodput (\S+),")


@dataclass(frozen=True)
class TrialRow:
    name: str
    values: dict[str, str]
    now: state.TrialState
    losses: summary.Losses
    goodput: str  # as the trial's own report line says it ("93.1%", "n/a"); "-" without a report
    report: str  # the trial's report, relative to the sweep's page ("" without one)


def is_sweep(folder: Path) -> bool:
    return (folder / state.RECORD).is_file()


def rows(folder: Path, write_report: Callable[[Path], str]) -> list[TrialRow]:
    """Each trial of the sweep's record, its own report written (`write_report`) when it has run."""
    found = []
    for trial in state.read_record(folder).get("trials", []):
        name, values = str(trial.get("name")), trial.get("values") or {}
        where = folder / name
        now = state.read_state(where)
        goodput, link = "-", ""
        if now.state != state.NEW:
            try:
                said = write_report(where)
            except UsageError:  # a trial that never wrote a record: no report of its own
                said = ""
            match = GOODPUT.search(said)
            goodput, link = (match.group(1) if match else "-"), (f"{name}/report.html" if said else "")
        found.append(TrialRow(name, dict(values), now, summary.read_losses(where), goodput, link))
    return found


def curves_png(trials: list[TrialRow]) -> bytes | None:
    """The loss of every trial against its step, one line each."""
    drawn = [t for t in trials if t.losses.curve]
    if not drawn:
        return None
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for t in drawn:
        steps, losses = zip(*t.losses.curve, strict=True)
        ax.plot(steps, losses, label=t.name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log" if all(loss > 0 for t in drawn for _, loss in t.losses.curve) else "linear")
    if len(drawn) <= 12:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return plots._png(fig)


SORT = """<script>
document.querySelectorAll("table.trials th").forEach((th, i) => th.onclick = () => {
  const body = th.closest("table").tBodies[0], rows = [...body.rows], up = th.dataset.up !== "1";
  const key = r => { const t = r.cells[i].dataset.v ?? r.cells[i].textContent; const n = parseFloat(t);
                     return isNaN(n) ? t : n; };
  rows.sort((a, b) => { const x = key(a), y = key(b); return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1); });
  th.dataset.up = up ? "1" : "0"; rows.forEach(r => body.appendChild(r));
});
</script>"""


def render(folder: Path, trials: list[TrialRow], png: bytes | None, generated: float) -> str:
    keys = sorted({k for t in trials for k in t.values})
    head = [
        *keys,
        "state",
        "steps",
        "final loss",
        "best loss",
        "goodput",
        "attempts",
        "first cause",
        "report",
    ]
    body = []
    for t in trials:
        now, seen = t.now, t.losses
        shown = summary.row(t.name, now, seen)
        cells = [
            *(t.values.get(k, "") for k in keys),
            shown[1],
            shown[2],
            shown[3],
            shown[4],
            t.goodput,
            shown[5],
        ]
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        cause = f"<td>{html.escape(now.cause or '-')}</td>"
        link = (
            f'<td><a href="{html.escape(t.report)}">{html.escape(t.name)}</a></td>'
            if t.report
            else "<td>-</td>"
        )
        body.append(f"<tr>{tds}{cause}{link}</tr>")
    ths = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    figure = (
        f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}" style="max-width: 100%" alt="loss">'
        if png
        else "<p>No trial has recorded a step yet.</p>"
    )
    finished = sum(t.now.state == state.FINISHED for t in trials)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(generated))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Sweep {html.escape(folder.resolve().name)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; }}
th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: left; font-size: 14px; }}
th {{ background: #f3f3f3; cursor: pointer; }}
</style></head><body>
<h1>Sweep {html.escape(folder.resolve().name)}</h1>
<p>{len(trials)} trial(s), {finished} finished. Generated {html.escape(stamp)} from each trial's folder
(click a column's head to sort by it).</p>
<table class=trials><thead><tr>{ths}</tr></thead><tbody>{"".join(body)}</tbody></table>
<h2>Loss</h2>
{figure}
{SORT}
</body></html>
"""


def write(folder: Path, out: Path, write_report: Callable[[Path], str]) -> str:
    """The sweep's page at `out` (see the module docstring); the line that says where."""
    trials = rows(folder, write_report)
    png = curves_png(trials)
    try:
        atomic_write_bytes(out, render(folder, trials, png, time.time()).encode())
    except OSError as e:
        raise UsageError(f"cannot write {out} ({e.strerror or e}). Fix: --out a path you can write") from None
    finished = sum(t.now.state == state.FINISHED for t in trials)
    return (
        f"report: {out} (sweep of {len(trials)} trial(s), {finished} finished; each trial's report beside it)"
    )
