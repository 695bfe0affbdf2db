"""Open a run's report the way a person would, and check what they would see.

`check_report(folder, shot)` runs `python -m hpc_ddp.report <folder>`, checks the page is self-contained (no
http(s) URL, no script; every plot an inline PNG that decodes and is not blank), opens it in headless Chromium
(Debian's package, env/chromium.sh; no network: every host name resolves to nothing) and checks that the
screenshot shows the plots. It returns the numbers the report computed, for a test to compare with what the
run's records say. Any run folder works: a plain local run, or one with preemptions and failures.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import die_with_test, run_module

from hpc_ddp.ledger import attempts as attempts_record
from hpc_ddp.report import timeline
from hpc_ddp.report.sources import read_run
from hpc_ddp.run.records.metrics import read_records

CHROMIUM_TIMEOUT_S = 90
IMAGES = ("loss.png", "lr.png", "throughput.png", "step-time-heatmap.png", "time-breakdown.png")


@dataclass(frozen=True)
class Checked:
    line: str  # what the command printed
    page: str  # the HTML
    images: dict[str, float]  # inline image (by its alt text) -> share of pixels that are not white
    colorful: float  # share of the screenshot's pixels in saturated colors (plots; the page itself is gray)
    summary: timeline.Summary  # the numbers, recomputed from the folder as the command did (without sacct)


def rgb(png: bytes):  # -> numpy array (height, width, 3) of floats in [0, 1]
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]


def not_white(png: bytes) -> float:
    return float((rgb(png).min(axis=2) < 0.9).mean())


def saturated(png: bytes) -> float:
    image = rgb(png)
    return float((image.max(axis=2) - image.min(axis=2) > 0.3).mean())


IMG = r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" width=(\d+) height=(\d+) alt="([^"]+)"'


def inline_images(page: str) -> dict[str, bytes]:
    return {alt: base64.b64decode(data) for data, _, _, alt in re.findall(IMG, page)}


def png_size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def shown_sizes(page: str) -> dict[str, tuple[int, int]]:
    """Each inline image's size on the page, in CSS pixels (its width and height attributes)."""
    return {alt: (int(w), int(h)) for _, w, h, alt in re.findall(IMG, page)}


def chromium() -> str:
    """Debian's chromium, or skip (fail when env/test.sh installed it: HPC_DDP_REQUIRE_CHROMIUM=1)."""
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("HPC_DDP_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not on PATH although env/chromium.sh installed it")
        pytest.skip("no chromium (bash env/chromium.sh installs Debian's package; needs root)")
    return path


def run_chromium(page: Path, *args: str) -> str:
    """Headless Chromium on `page` (a local file) with `args`, no network; its stdout. Killed on every path."""
    profile = Path(tempfile.mkdtemp(prefix="hpc_ddp-chromium-"))
    argv = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        "--no-default-browser-check",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        f"--user-data-dir={profile}",
        *args,
        page.resolve().as_uri(),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_test,
    )
    try:
        out, _ = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s"
    finally:
        try:  # its whole process group: the browser leaves zygote and utility processes behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    return out


def screenshot(page: Path, shot: Path, width: int = 1280, height: int = 1800) -> None:
    """A headless Chromium screenshot of `page` (a local file), with no network; killed on every path."""
    out = run_chromium(page, f"--window-size={width},{height}", f"--screenshot={shot}")
    assert shot.is_file(), f"no screenshot: {out[-2000:]}"


# Injected into a copy of the page (the report itself has no script): every word of every table cell whose
# pieces lie on more than one line is broken inside; the list of them is written into the DOM for --dump-dom.
BROKEN_WORDS_JS = """
<script>
const broken = [];
for (const cell of document.querySelectorAll("td, th")) {
  const texts = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let node = texts.nextNode(); node; node = texts.nextNode()) {
    let at = 0;
    for (const word of node.textContent.split(" ")) {
      if (word) {
        const range = document.createRange();
        range.setStart(node, at);
        range.setEnd(node, at + word.length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) broken.push(word);
      }
      at += word.length + 1;
    }
  }
}
const out = document.createElement("pre");
out.id = "broken-words";
out.textContent = JSON.stringify(broken);
document.body.appendChild(out);
</script>
"""


# Injected like BROKEN_WORDS_JS: each image's size as laid out against the pixels its PNG holds, and whether a
# table sticks out of the page (it must fit, or scroll inside its own box).
LAYOUT_JS = """
<script>
const found = {images: [], overflow: []};
for (const img of document.querySelectorAll("img")) {
  const r = img.getBoundingClientRect();
  found.images.push([img.alt, r.width, r.height, img.naturalWidth, img.naturalHeight]);
}
const page = document.documentElement.clientWidth;
for (const table of document.querySelectorAll("table")) {
  const box = table.parentElement.classList.contains("scroll") ? table.parentElement : table;
  if (box.getBoundingClientRect().right > page + 1) found.overflow.push(table.className || "table");
}
found.pageScrolls = document.documentElement.scrollWidth > page + 1;
const out = document.createElement("pre");
out.id = "layout";
out.textContent = JSON.stringify(found);
document.body.appendChild(out);
</script>
"""


def layout(page: Path, width: int, height: int = 1200) -> dict:
    """How Chromium lays the page out at this window width (LAYOUT_JS)."""
    probe = page.with_name("layout-probe.html")
    probe.write_text(page.read_text().replace("</body>", LAYOUT_JS + "</body>"))
    try:
        dom = run_chromium(probe, "--dump-dom", f"--window-size={width},{height}")
    finally:
        probe.unlink()
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert found, f"no result from the page's script: {dom[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def broken_words(page: Path, width: int = 1600, height: int = 1200) -> list[str]:
    """The words of the page's table cells that Chromium, at this window size, breaks over two lines."""
    probe = page.with_name("broken-words-probe.html")
    probe.write_text(page.read_text().replace("</body>", BROKEN_WORDS_JS + "</body>"))
    try:
        dom = run_chromium(probe, "--dump-dom", f"--window-size={width},{height}")
    finally:
        probe.unlink()
    found = re.search(r'<pre id="broken-words">(.*?)</pre>', dom, re.S)
    assert found, f"no result from the page's script: {dom[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def check_report(folder: Path, shot: Path, *args: str, expect_heatmap: bool | None = None) -> Checked:
    """Run the report on `folder` and check the page and its screenshot (see the module docstring).
    `expect_heatmap`: None: required when the run wrote "ranks" records."""
    pytest.importorskip("matplotlib")
    proc = run_module("hpc_ddp.report", str(folder), "--no-sacct", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = folder / "report.html"
    page = out.read_text()
    assert not re.search(r"https?://|<script|<link|@import", page, re.I), "the page must be self-contained"
    run = read_run(folder, use_sacct=False)
    summary = timeline.summarize(run.records, run.lines, run.slurm, run.running)
    if expect_heatmap is None:
        expect_heatmap = any(r.get("event") == "ranks" for r in read_records(folder / "metrics.jsonl"))
    expected = [n for n in IMAGES if expect_heatmap or n != "step-time-heatmap.png"]
    # A step's own values, and its gradient norm (every step record's since issue 46), are drawn in their own.
    steps = [r for r in read_records(folder / "metrics.jsonl") if r.get("event") == "step"]
    if any(r.get("grad_norm") is not None or r.get("metrics") for r in steps):
        expected.append("train-metrics.png")
    images = inline_images(page)
    assert sorted(images) == sorted(expected), sorted(images)
    shares = {}
    sizes = shown_sizes(page)
    for name, png in images.items():
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and png == out.with_name(name).read_bytes(), name
        shares[name] = not_white(png)
        assert shares[name] > 0.02, f"{name} is blank ({shares[name]:.1%} of its pixels are not white)"
        # Drawn for the size it is shown at, with two pixels per CSS pixel: crisp on a 2x screen, never
        # stretched (the train metrics' 288 px PNG was shown 640 px wide).
        width, height = png_size(png)
        assert (width, height) == (2 * sizes[name][0], 2 * sizes[name][1]), (
            name,
            (width, height),
            sizes[name],
        )
    # As a browser 960 px wide lays it out: every figure at its own size (the widest is 614 px), and the tables
    # wider than that (the attempts') scroll inside their own box instead of running past the page's edge.
    laid = layout(out, 960)
    for name, w, h, natural_w, natural_h in laid["images"]:
        assert (round(w), round(h)) == sizes[name] and (natural_w, natural_h) == png_size(images[name]), name
    assert laid["overflow"] == [] and not laid["pageScrolls"], laid
    screenshot(out, shot)
    colorful = saturated(shot.read_bytes())
    # The page's own text, tables and lines are black and gray: colored pixels can only come from the plots.
    assert colorful > 0.005, f"the screenshot shows no plot ({colorful:.2%} of its pixels are colored)"
    return Checked(proc.stdout.strip(), page, shares, colorful, summary)


def page_attempts(page: str) -> list[dict[str, str]]:
    """The page's attempts table as a person reads it: one {column heading: cell text} per row."""
    (table,) = re.findall(r"<table class=attempts>(.*?)</table>", page, re.S)
    rows = [
        [
            html.unescape(re.sub(r"<[^>]+>", "", c))
            for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)
        ]
        for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)
    ]
    return [dict(zip(rows[0], row, strict=False)) for row in rows[1:]]


@dataclass(frozen=True)
class RecordFacts:
    """What a run's files say, read straight from them (not through the report's code)."""

    steps: int  # the highest step of any metrics record
    final_loss: float | None  # the loss of the last "step" record: the last step trained
    best_loss: float | None
    starts: int  # "start" records in metrics.jsonl (0 before they existed)
    attempts: int  # attempts in attempts.jsonl (0 without one)
    lost_steps: int | None  # attempts.jsonl: sum of step - checkpoint over attempts that did not complete
    recorded: tuple[
        attempts_record.Attempt, ...
    ] = ()  # attempts.jsonl as the kit reads it (ledger.attempts.read)


def record_facts(folder: Path) -> RecordFacts:
    metrics = read_records(folder / "metrics.jsonl")
    steps = [r for r in metrics if r.get("event") == "step" and isinstance(r.get("loss"), float)]
    last = steps[-1] if steps else None  # the last step trained (a run that went back: not its highest)
    lines = read_records(folder / "attempts.jsonl")
    ends = [r for r in lines if r.get("event") == "end"]
    lost = sum(
        max(0, (r.get("step") or 0) - (r.get("checkpoint") or 0))
        for r in ends
        if r.get("outcome") != "completed"
    )
    return RecordFacts(
        steps=max((r["step"] for r in metrics if isinstance(r.get("step"), int)), default=0),
        final_loss=last["loss"] if last else None,
        best_loss=min((r["loss"] for r in steps), default=None),
        starts=sum(r.get("event") == "start" for r in metrics),
        attempts=len({(r.get("job"), r.get("restart")) for r in lines}),
        lost_steps=lost if ends else None,
        recorded=tuple(attempts_record.read(folder)),
    )


def assert_report_matches_records(checked: Checked, folder: Path) -> RecordFacts:
    """The report's steps, losses, attempts and lost steps are the ones the run's files hold; with an
    attempts.jsonl, the page's attempts table says, row by row, what hpc_ddp.ledger.attempts reads from it."""
    facts = record_facts(folder)
    s = checked.summary
    assert (s.steps, s.final_loss, s.best_loss) == (facts.steps, facts.final_loss, facts.best_loss)
    if facts.attempts:
        assert len(s.attempts) == facts.attempts
    elif facts.starts:
        assert len(s.attempts) == facts.starts
    if facts.lost_steps is not None:
        assert s.lost_steps == facts.lost_steps
    if facts.recorded and all(a.outcome != attempts_record.RUNNING for a in facts.recorded):
        shown = [
            (
                row["job"],
                int(row["restart"]),
                int(row["resumed at"]),
                int(row["last step"]),
                int(row["lost steps"]),
                row["outcome"],
                row["decision"],
            )
            for row in page_attempts(checked.page)
        ]
        recorded = [
            (a.job, a.restart, a.resumed_from or 0, a.step, a.lost_steps, a.outcome, a.decision)
            for a in facts.recorded
        ]
        assert shown == recorded, (shown, recorded)
        assert sum(a.lost_steps for a in facts.recorded) == s.lost_steps
    lost = f"lost {s.lost_steps} step{'s' * (s.lost_steps != 1)}"
    assert f"step {facts.steps}, " in checked.line and lost in checked.line, checked.line
    return facts
