"""What the report shows for a default run (issue 21 item 5): a throughput plot for every run that trained, the
final loss of the last step trained, time axes in the unit that fits, table cells that never break inside a
word (in headless Chromium), restart columns marked as restarts in the heat map, and "between attempts" where
no queue was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_module
from report_check import broken_words, page_attempts
from test_report import METRICS, attempt_lines, ranks, start, step, summary, write_fixture

from hpc_ddp.report import page, plots, timeline
from hpc_ddp.report.recorded import compile_records


def epoch(t: float, s: int, loss: float, rate: float) -> dict[str, Any]:
    return {"event": "epoch", "time": t, "epoch": s // 32, "step": s, "loss": loss, "samples_per_s": rate}


def test_a_run_with_only_epoch_records_has_a_throughput_plot() -> None:
    """A short run of an older version with the default --log-every-s 30: no "step" record, only its epochs'.
    Their samples/s make the plot ("no records for it in this run" before)."""
    pytest.importorskip("matplotlib")
    records = [start(100, 0, 0, 2)] + [epoch(100 + 4 * k, 32 * k, 1.0 / k, 900.0 + k) for k in range(1, 4)]
    run = compile_records(records)
    pngs = plots.draw(run, timeline.summarize(run, running=False))
    assert {"loss.png", "throughput.png", "time-breakdown.png"} <= set(pngs)


def test_the_final_loss_is_the_last_step_trained() -> None:
    """Attempt 1 reached step 50 and failed; attempt 2 resumed at 40 and was stopped at 45: the run's weights
    are step 45's, and so is its final loss (it read step 50's, the highest step)."""
    records = [start(10, 0, 0, 1)] + [step(10 + k, k, 1.0 + k) for k in range(1, 51)]
    records += [start(100, 1, 40, 1)] + [step(100 + k, 40 + k, 2.0 + k) for k in range(1, 6)]
    s = timeline.summarize(records, running=False)
    assert (s.steps, s.final_loss, s.best_loss, s.best_step) == (50, 7.0, 2.0, 1)


@pytest.mark.parametrize(
    "span, unit", [(12, "seconds"), (120, "seconds"), (600, "minutes"), (7200, "minutes"), (93_600, "hours")]
)
def test_time_axes_are_in_the_unit_that_fits(span: float, unit: str) -> None:
    assert plots.time_unit(span)[1] == unit


def test_a_12_second_runs_throughput_axis_is_in_seconds() -> None:
    """(It was in minutes: 0.00 to 0.20.)"""
    plt = plots.pyplot()
    run = compile_records([start(100, 0, 0, 2)] + [step(100 + k, k, 1.0, rate=500.0) for k in range(1, 13)])
    fig, ax = plt.subplots()
    try:
        assert plots.throughput_axes(ax, run)
        assert ax.get_xlabel() == "seconds since the first record"
        assert max(max(line.get_xdata()) for line in ax.get_lines()) == pytest.approx(11.0)
    finally:
        plt.close(fig)


def test_a_restarts_first_window_is_marked_as_a_restart_not_a_straggler() -> None:
    """Two starts; the first "ranks" window after each pays for warm-up on every rank (1 s a step), a real
    straggler (rank 2, 0.4 s) is elsewhere: those columns are hatched, labelled "start" and "restart" and left
    out of the color scale, whose top is the straggler's (it was the warm-up's, and the straggler was dim)."""
    plt = plots.pyplot()
    warm = {"event": "ranks", "time": 0, "epoch": 0, "step": 0, "step_time_s": [1.0] * 4, "data_s": [0.0] * 4}
    records = [start(100, 0, 0, 2), dict(warm, time=101, step=5)]
    records += [ranks(101 + k, 5 + 5 * k, slow=2 if k == 3 else None) for k in range(1, 6)]
    records += [start(200, 1, 30, 2), dict(warm, time=201, step=35)]
    records += [ranks(201 + k, 35 + 5 * k) for k in range(1, 4)]
    run = compile_records(records)
    assert plots.restart_columns(run) == [(0, "start"), (6, "restart")]
    fig, ax = plt.subplots()
    try:
        assert plots.heatmap_axes(fig, ax, run)
        assert ax.get_images()[0].get_clim() == (0, pytest.approx(400.0))  # ms: the straggler's
        labels = [(round(t.get_position()[0]), t.get_text()) for t in ax.texts]
        assert labels == [(0, "start"), (6, "restart")]
    finally:
        plt.close(fig)


def local_lines() -> list[dict[str, Any]]:
    """The fixture's attempts as the local launcher records them: restarts, no requeue."""
    return [
        dict(line, decision="restart") if line.get("decision") == "requeue" else line
        for line in attempt_lines()
    ]


@pytest.mark.parametrize("lines, queued", [(attempt_lines, True), (local_lines, False)])
def test_between_attempts_where_no_queue_was(
    lines: Any, queued: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requeue waited in Slurm's queue: "queue wait"; a local run's restarts did not: "between attempts"
    (the time a user took to type the command again is no queue wait)."""
    s = summary(write_fixture(tmp_path / "run", attempts=lines()))
    assert s.queued == queued and s.queue_s == 86
    html = page.render("Run x", s, {}, 0.0, "metrics.jsonl")
    name = "queue wait between attempts" if queued else "time between attempts"
    assert f"<tr><th>{name}</th><td>1 min 26 s</td></tr>" in html
    assert ("queue before" if queued else "between attempts") in page_attempts(html)[0]
    figures: list[Any] = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    plots.breakdown_png(s)
    [legend] = figures[0].legends
    assert [t.get_text() for t in legend.get_texts()][0] == (
        "queue wait before" if queued else "between attempts"
    )


@pytest.mark.slow  # headless Chromium: 3-10 s
@pytest.mark.deadline(120)
def test_table_cells_never_break_inside_a_word_in_chromium(tmp_path: Path) -> None:
    """The attempts table of a run of 4 attempts on 8 nodes with long reasons, at 1100 px: no word of any cell
    is cut over two lines ("outco me", "11071 86" at 1600 px before); the long text wraps at its spaces."""
    pytest.importorskip("matplotlib")
    long = (
        "rank 5 failed first: RuntimeError: CUDA error: an illegal memory access was encountered at "
        "/home/someone/projects/model/src/layers/attention_with_a_long_name.py:1107186 (see its log)"
    )
    lines = [
        dict(line, reason=long, nodes=[f"gpu-node-{k:03d}" for k in range(8)]) for line in attempt_lines()
    ]
    folder = write_fixture(tmp_path / "run", metrics=METRICS, attempts=lines)
    proc = run_module("hpc_ddp.report", str(folder), "--no-sacct", timeout=120)
    assert proc.returncode == 0, proc.stderr
    words = broken_words(folder / "report.html", width=1100)
    assert words == [], words


def evaluation(t: float, s: int, **metrics: Any) -> dict[str, Any]:
    return {"event": "eval", "time": t, "step": s, "epoch": s // 32, "samples": 37, "metrics": metrics}


def test_evaluations_are_compiled_one_a_step_the_replayed_one_kept_and_garbage_left_out() -> None:
    """Attempt 1 evaluated at 10 and 20, then failed; attempt 2 resumed at 10 and evaluated 20 again (other
    weights: the replayed steps): the table and the plot have each step once, the kept line's value."""
    records = [start(10, 0, 0, 1), step(11, 1, 2.0), evaluation(12, 10, loss=1.5, accuracy=0.5)]
    records += [evaluation(13, 20, loss=1.2, accuracy=0.6), {"event": "eval", "time": 14, "step": 25}]
    records += [start(100, 1, 10, 1), evaluation(101, 20, loss=1.1, accuracy="x", f1=None)]
    records += [evaluation(102, 30, loss=1.0, accuracy=0.7), {**evaluation(103, 0, loss=9.0), "step": "bad"}]
    run = compile_records(records)
    table = run.evaluations()
    assert [(e.step, e.epoch, e.samples) for e in table] == [(10, 0, 37), (20, 0, 37), (30, 0, 37)]
    assert table[1].metrics == (("loss", 1.1),)  # attempt 2's; its non-numbers left out
    assert run.eval_series() == {"accuracy": ([10, 30], [0.5, 0.7]), "loss": ([10, 20, 30], [1.5, 1.1, 1.0])}
    html_table = page.evaluations_table(table)
    assert "<th>step</th><th>epoch</th><th>samples</th><th>accuracy</th><th>loss</th>" in html_table
    assert "<tr><td>20</td><td>0</td><td>37</td><td>n/a</td><td>1.1</td></tr>" in html_table
    assert page.evaluations_table([]) == ""


def test_the_page_shows_an_evaluation_plot_and_table_only_for_a_run_that_evaluated() -> None:
    pytest.importorskip("matplotlib")
    records = [start(10, 0, 0, 1)] + [step(10 + k, k, 1.0 / k) for k in range(1, 9)]
    plain = compile_records(records)
    s = timeline.summarize(plain, running=False)
    assert "evaluation.png" not in plots.draw(plain, s)
    html = page.render("r", s, plots.draw(plain, s), 0.0, "metrics.jsonl", plain.evaluations())
    assert "Evaluations" not in html and "evaluation.png" not in html
    evaluated = compile_records(records + [evaluation(20, 4, loss=0.5), evaluation(21, 8, loss=0.25)])
    pngs = plots.draw(evaluated, s)
    assert pngs["evaluation.png"].startswith(b"\x89PNG")
    html = page.render("r", s, pngs, 0.0, "metrics.jsonl", evaluated.evaluations())
    assert "<h2>Evaluations</h2>" in html and 'alt="evaluation.png"' in html and "<td>0.25</td>" in html


def test_a_steps_own_values_are_compiled_one_a_step_and_drawn_only_when_there_are_some() -> None:
    """Issue 19 item 3: the values a Task.step returns besides its loss ("step" records' `metrics`) reach the
    report: one point a step (a resume's replayed step keeps the later value), non-numbers left out."""
    pytest.importorskip("matplotlib")
    records = [start(10, 0, 0, 1)] + [
        dict(step(10 + k, k, 1.0), metrics={"acc": k / 10}) for k in range(1, 5)
    ]
    records += [start(100, 1, 2, 1), dict(step(101, 3, 1.0), metrics={"acc": 0.9, "tag": "x", "f1": None})]
    records += [dict(step(102, 4, 1.0), metrics="garbage")]
    run = compile_records(records)
    assert run.extra_series() == {"acc": ([1, 2, 3, 4], [0.1, 0.2, 0.9, 0.4])}
    s = timeline.summarize(run, running=False)
    pngs = plots.draw(run, s)
    assert pngs["train-metrics.png"].startswith(b"\x89PNG")
    html = page.render("r", s, pngs, 0.0, "metrics.jsonl", run.evaluations())
    assert 'alt="train-metrics.png"' in html
    plain = compile_records([start(10, 0, 0, 1)] + [step(10 + k, k, 1.0) for k in range(1, 5)])
    assert plain.extra_series() == {}
    drawn = plots.draw(plain, timeline.summarize(plain, running=False))
    assert "train-metrics.png" not in drawn
    html = page.render("r", s, drawn, 0.0, "metrics.jsonl", plain.evaluations())
    assert "train-metrics.png" not in html


def test_the_headline_is_the_latest_evaluation_or_a_smoothed_loss_never_one_minibatch() -> None:
    """The headline was "best loss": the lowest single minibatch's, noise (issue 37 item 6)."""
    noisy = [step(10 + k, k, 1.0 if k % 10 else 0.01) for k in range(1, 101)]  # one lucky minibatch a 10
    run = compile_records([start(10, 0, 0, 1), *noisy])
    assert page.key_metric(run) == ("smoothed training loss", "0.901 (mean of the last 10 steps)")
    records = [
        start(10, 0, 0, 1),
        *noisy,
        evaluation(60, 50, loss=0.8, accuracy=0.7),
        evaluation(120, 100, loss=0.6, accuracy=0.75),
    ]
    assert page.key_metric(compile_records(records)) == (
        "latest evaluation",
        "accuracy 0.75, loss 0.6 at step 100",
    )
    rows = dict(page.headline(timeline.summarize(run, running=False), page.key_metric(run)))
    assert "best loss" not in rows and rows["smoothed training loss"].startswith("0.901")


def test_a_new_best_is_marked_and_the_learning_rate_plotted() -> None:
    """--keep-best's "best" records: the kept evaluation is marked in the table (and starred in its plot);
    the "step" records' lr makes a plot of its own (issue 37 items 5 and 6)."""
    pytest.importorskip("matplotlib")
    steps = [{**step(10 + k, k, 1.0), "lr": 0.1 * (1 - k / 100)} for k in range(1, 101)]
    best = {
        "event": "best",
        "time": 61,
        "epoch": 0,
        "step": 50,
        "metric": "accuracy",
        "value": 0.8,
        "mode": "max",
    }
    records = [
        start(10, 0, 0, 1),
        *steps,
        evaluation(60, 50, loss=0.5, accuracy=0.8),
        best,
        evaluation(120, 100, loss=0.6, accuracy=0.75),
    ]
    run = compile_records(records)
    assert run.best() is not None and (run.best().step, run.best().metric) == (50, "accuracy")  # type: ignore[union-attr]
    table = page.evaluations_table(run.evaluations(), run.best())
    assert "<th>kept as best</th>" in table and table.count("class=best") == 1
    assert "<tr class=best><td>50</td>" in table and "\u2605 best accuracy" in table
    pngs = plots.draw(run, timeline.summarize(run, running=False))
    assert {"lr.png", "evaluation.png"} <= set(pngs)
    for name, png in pngs.items():  # drawn at twice the CSS pixels they are shown at (crisp on a 2x screen)
        width, height = page.png_size(png)
        assert width % 2 == 0 and height % 2 == 0, name
    shown = page.render("r", timeline.summarize(run, running=False), pngs, 0.0, "x", run.evaluations())
    assert f"width={page.png_size(pngs['lr.png'])[0] // 2} " in shown
