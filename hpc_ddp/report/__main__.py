"""`python -m hpc_ddp.report <folder>`: write the run's report.html (see hpc_ddp.report)."""

from __future__ import annotations

import time
from pathlib import Path

import hpc_ddp.report
from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError, run_main
from hpc_ddp.report import PROG, page, plots, sources, sweep, timeline
from hpc_ddp.run.folder import atomic_write_bytes


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(PROG, hpc_ddp.report.__doc__ or "")
    parser.add_argument("folder", help="the run folder (the run's --folder), or a sweep's (its trials' page)")
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="where to write the HTML (default: <folder>/report.html); the PNGs go beside it",
    )
    parser.add_argument(
        "--no-sacct",
        action="store_true",
        help="do not ask Slurm's accounting for queue waits (use the gaps between attempts)",
    )
    ns = parser.parse_args(argv)
    folder = Path(ns.folder)
    out = Path(ns.out) if ns.out else folder / "report.html"
    if sweep.is_sweep(folder):  # a sweep's folder: its page, and each trial's own report
        print(
            sweep.write(folder, out, lambda trial: write_run(trial, trial / "report.html", not ns.no_sacct))
        )
        return 0
    print(write_run(folder, out, not ns.no_sacct), flush=True)
    return 0


def write_run(folder: Path, out: Path, use_sacct: bool) -> str:
    """Write the run's report to `out` (its PNGs beside it): the line that says where and its headline."""
    run = sources.read_run(folder, use_sacct=use_sacct)  # not a run folder: one line, before anything
    if out.is_dir() or not out.parent.is_dir():
        raise UsageError(
            f"--out {out}: expected a file path in an existing folder. Fix: --out "
            f"{folder / 'report.html'}, or create {out.parent}"
        )
    plots.pyplot()  # matplotlib missing: one line with the install command
    now = time.time()
    drafts = timeline.build_attempts(run.records, run.lines, running=run.running, now=now)
    slurm = sources.plausible(run.slurm, [(a.job, a.restart, a.process_start) for a in drafts])
    summary = timeline.summarize(run.records, run.lines, slurm, run.running, now)
    pngs = plots.draw(run.records, summary)
    title = f"Run {folder.resolve().name}"
    try:
        for name, data in pngs.items():
            atomic_write_bytes(out.with_name(name), data)
        atomic_write_bytes(
            out,
            page.render(
                title,
                summary,
                pngs,
                now,
                sources.described(run, slurm),
                run.records.evaluations(),
                page.key_metric(run.records),
                run.records.best(),
            ).encode(),
        )
    except OSError as e:
        raise UsageError(f"cannot write {out} ({e.strerror or e}). Fix: --out a path you can write") from None
    return line(out, summary, page.key_metric(run.records))


def line(out: Path, s: timeline.Summary, key: tuple[str, str] | None = None) -> str:
    """The one line printed: where the report is and the headline numbers (`key`: page.key_metric)."""
    goodput = "n/a" if s.goodput is None else f"{s.goodput:.1%}"
    best = f"n/a ({s.no_interval})" if s.best_interval_s is None else page.duration(s.best_interval_s)
    attempts = f"{len(s.attempts)} attempt{'s' * (len(s.attempts) != 1)}"
    return (
        f"report: {out} ({s.state}; {attempts}, step {s.steps}, "
        f"{f'{key[0]} {key[1]}' if key else f'last loss {page.number(s.final_loss)}'}, "
        f"goodput {goodput}, lost {page.steps_text(s.lost_steps)}, "
        f"best checkpoint interval {best})"
    )


if __name__ == "__main__":
    run_main(PROG, main)
