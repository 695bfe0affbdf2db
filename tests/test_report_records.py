"""The report on the folders a real life leaves: one it may not write, one whose line of training was started
over, a very long run, records that end between two progress records, and garbage (issue 22, items 8-12, and
the report parts of issue 21 item 5). The numbers of an ordinary run are test_report.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, clean_environ, run_module
from test_report import JOB, METRICS, attempt_lines, step, summary, write_fixture
from test_report_run import local_run

from hpc_ddp.report import plots, timeline
from hpc_ddp.report.sources import read_run
from hpc_ddp.run.checkpoint import resume
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.folder import hold_folder, is_held
from hpc_ddp.run.records.metrics import read_records


def untouched(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry of `folder` (itself included) with its mtime, after setting them all to a second long ago:
    a file created, written or removed in it (even one removed again at once) shows as a change."""
    entries = [folder, *sorted(folder.rglob("*"))]
    for path in entries:
        os.utime(path, ns=(1_000_000_000, 1_000_000_000), follow_symlinks=False)
    return listing(folder)


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in [folder, *sorted(folder.rglob("*"))]
    }


# ----- 22.8: reading a run never writes into it --------------------------------------------------------------


def test_looking_at_the_lock_writes_nothing_into_the_folder(tmp_path: Path) -> None:
    """is_held on a folder with no run.lock, and on one a live run holds: the folder is as it was (the probe
    file that measured the lock's age by the file system's clock was created and removed in it)."""
    folder = write_fixture(tmp_path / "run")
    before = untouched(folder)
    assert not is_held(folder)
    assert listing(folder) == before
    lock = hold_folder(folder, "launcher", None, 0)
    try:
        before = untouched(folder)
        assert is_held(folder)
        assert listing(folder) == before
    finally:
        lock.release()


def test_the_report_with_out_elsewhere_writes_nothing_into_the_run_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = write_fixture(tmp_path / "run")
    (tmp_path / "web").mkdir()
    before = untouched(folder)
    proc = run_module("hpc_ddp.report", str(folder), "--out", str(tmp_path / "web" / "r.html"), "--no-sacct")
    assert proc.returncode == 0, proc.stderr
    assert listing(folder) == before
    assert (tmp_path / "web" / "r.html").is_file()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to become nobody"
)
def test_a_user_who_may_not_write_the_folder_reads_it_with_out_elsewhere() -> None:
    """The report as user nobody on a folder only root may write (root's chmod would not stop root): it
    crashed with PermissionError on the lock check's probe file."""
    pytest.importorskip("matplotlib")
    base = Path(tempfile.mkdtemp(prefix="hpc_ddp-readonly-"))  # not pytest's tmp: it is root's alone (0700)
    try:
        base.chmod(0o755)
        folder = write_fixture(base / "run")  # 0755 and 0644: nobody reads, only root writes
        out = base / "out"
        out.mkdir(mode=0o777)
        out.chmod(0o777)
        env = clean_environ(HOME=str(out), MPLCONFIGDIR=str(out / "matplotlib"))
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m"]
        proc = subprocess.run(
            [*argv, "hpc_ddp.report", str(folder), "--no-sacct", "--out", str(out / "r.html")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if "No module named" in proc.stderr or "Permission denied: '" + str(ROOT) in proc.stderr:
            pytest.skip(f"user nobody cannot read this checkout: {proc.stderr[-300:]}")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout.startswith(f"report: {out / 'r.html'} (finished; 3 attempts")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ----- 22.9: a new line's report shows the new line only ------------------------------------------------------


def test_overwrite_moves_the_records_of_the_line_it_deletes_aside(tmp_path: Path) -> None:
    folder = write_fixture(tmp_path / "run")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "ckpt-00000080.pt").write_bytes(b"x")
    said: list[str] = []
    resume.apply(resume.Plan(None, overwrite=True), CheckpointStore(folder, Local()), said.append)
    assert not (folder / "metrics.jsonl").exists() and not (folder / "attempts.jsonl").exists()
    [aside] = folder.glob("records-overwritten-*")
    assert sorted(p.name for p in aside.iterdir()) == ["attempts.jsonl", "metrics.jsonl"]
    assert read_records(aside / "metrics.jsonl") == METRICS  # kept as they were
    assert any(f"(metrics.jsonl, attempts.jsonl) moved to {aside}" in line for line in said), said


@pytest.mark.slow  # two local 1 x 2 runs and the report: about 20 s
@pytest.mark.deadline(180)
def test_after_resume_never_overwrite_the_report_shows_the_new_line_only(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    local_run(folder, "--max-steps", "40")
    local_run(folder, "--max-steps", "12", "--resume", "never", "--overwrite")
    s = summary(folder)
    steps = [r for r in read_records(folder / "metrics.jsonl") if r["event"] == "step"]
    assert (len(s.attempts), s.steps, s.lost_steps, s.failures, s.state) == (1, 12, 0, 0, "finished")
    assert s.attempts[0].outcome == "completed" and s.final_loss == steps[-1]["loss"]
    [aside] = folder.glob("records-overwritten-*")
    assert max(r["step"] for r in read_records(aside / "metrics.jsonl") if "step" in r) == 40


# ----- 22.10: a million records take seconds and little memory -----------------------------------------------


def synthetic_run(folder: Path, steps: int, saves: int) -> Path:
    """A run's metrics.jsonl as an older version wrote it with --log-every-s 0: a "step" record a step, a
    "ranks" record (8 ranks) every 5, and `saves` saves: 1.2 records a step."""
    folder.mkdir(parents=True)
    t, every = 1_700_000_000.0, steps // saves
    lines = [
        {"event": "start", "time": t, "job": "9", "restart": 0, "step": 0, "world_size": 8, "startup_s": 9}
    ]
    for s in range(1, steps + 1):
        t = round(t + 0.1, 3)
        lines.append(
            {"event": "step", "epoch": 0, "step": s, "loss": 1 / s, "samples_per_s": 2560.5, "step_time_s": 0.1,
             "lr": 0.01, "data_s": 0.001, "total_steps": steps, "eta_s": 1.0, "time": t}
        )  # fmt: skip
        if s % 5 == 0:
            lines.append(
                {"event": "ranks", "step": s, "step_time_s": [0.09] * 8, "data_s": [0.0] * 8, "time": t}
            )
        if s % every == 0:
            lines.append(
                {
                    "event": "save",
                    "step": s,
                    "stall_s": 0.05,
                    "write_s": 0.5,
                    "final": False,
                    "time": t + 0.05,
                }
            )
    lines.append(
        {"event": "end", "step": steps, "samples_per_s": 2560.0, "median_step_time_s": 0.1, "time": t}
    )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


class OverBudget(Exception):
    pass


def calls_for_the_report(folder: Path, budget: int) -> int:
    """Python and C function calls the report's own work makes on `folder` (reading, the timeline, the points
    and the heat map it would draw; matplotlib's drawing, a fixed cost, left out). Stops at `budget`."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
            if calls > budget:
                raise OverBudget

    sys.setprofile(count)
    try:
        run = read_run(folder, use_sacct=False)
        s = timeline.summarize(run.records, run.lines, run.slurm, run.running)
        for series in run.records.losses() + run.records.rates():
            plots.thin(series.steps, series.values)
        run.records.heat.grid(plots.MAX_COLUMNS)
        plots.restart_columns(run.records)
    except OverBudget:
        return calls
    finally:
        sys.setprofile(None)
    assert s.saves > 0 and s.steps > 0
    return calls


@pytest.mark.deadline(120)  # about 5 s: 90,000 records written and read, every call counted
def test_the_reports_work_grows_linearly_with_its_records(tmp_path: Path) -> None:
    """30,000 records with 125 saves, then 60,000 with 250 (a report that sorted every record once per save,
    as it did, grew with records x saves): the same work per record at both sizes, about 55 calls."""
    small = synthetic_run(tmp_path / "small", 25_000, 125)
    large = synthetic_run(tmp_path / "large", 50_000, 250)
    records = {folder: len(read_records(folder / "metrics.jsonl")) for folder in (small, large)}
    per_record = {folder: calls_for_the_report(folder, 100 * n) / n for folder, n in records.items()}
    assert per_record[large] < 100, per_record  # a quadratic report stops at the budget
    assert per_record[large] < 1.05 * per_record[small], per_record


PEAK = """
import sys
from pathlib import Path
from hpc_ddp.report import timeline
from hpc_ddp.report.sources import read_run
def peak_kb():  # this process's own high-water mark (ru_maxrss would carry the parent's over exec)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
before = peak_kb()
run = read_run(Path(sys.argv[1]), use_sacct=False)
s = timeline.summarize(run.records, run.lines, run.slurm, run.running)
print(s.steps, s.saves, (peak_kb() - before) * 1024)
"""


@pytest.mark.deadline(120)  # about 10 s: 200,000 records written, and read in a process of their own
def test_the_report_holds_little_memory_per_record(tmp_path: Path) -> None:
    """200,000 records with 800 saves: the report keeps compact numbers (its peak grows about 120 bytes a
    record), not the records (a dict each: 1.8 GB for a million)."""
    folder = synthetic_run(tmp_path / "run", 166_400, 800)
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, str(folder)], capture_output=True, text=True, timeout=100, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    steps, saves, grown = (int(x) for x in proc.stdout.split())
    assert (steps, saves) == (166_400, 800)
    assert grown < 200 * 200_000, f"the report's peak grew {grown / 1e6:.0f} MB for 200,000 records"


# ----- 22.12: garbage in the records -------------------------------------------------------------------------


def test_a_negative_stall_is_garbage_not_negative_time(tmp_path: Path) -> None:
    """A save with stall_s -50 in the lost part of attempt 1 (the fixture's numbers): ignored, so the parts
    stay in their bounds and the goodput stays the fixture's (it read 150% where a negative stall was kept)."""
    bad = {"event": "save", "time": 1045, "epoch": 0, "step": 30, "stall_s": -50.0, "write_s": 1.0}
    s = summary(write_fixture(tmp_path / "run", metrics=METRICS[:7] + [bad] + METRICS[7:]))
    assert s.goodput == pytest.approx(83 / 144) and (s.productive_s, s.stalls_s, s.lost_s) == (83, 9, 20)
    assert s.save_cost_s == 2.0  # the mean of the stalls that are real
    for a in s.attempts:
        parts = (a.startup_s, a.productive_s, a.stalls_s, a.lost_s, a.after_s)
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(a.allocated_s)


def test_time_stamps_no_run_can_have_written_are_skipped(tmp_path: Path) -> None:
    """1e308, a negative time, a step of 1e300: skipped, and the report prints its line (it was an
    OverflowError traceback); the fixture's numbers stand."""
    pytest.importorskip("matplotlib")
    junk = [
        {"event": "step", "time": 1e308, "step": 81, "loss": 0.1, "samples_per_s": 5.0},
        {"event": "start", "time": -5, "job": JOB, "restart": 7, "step": 0},
        {"event": "step", "time": 1031, "step": 1e300, "loss": 0.2},
        {"event": "save", "time": 1e308, "step": 10, "stall_s": 1.0},
    ]
    lines = [
        {"event": "end", "job": JOB, "restart": 9, "time": 1e308, "outcome": "failed", "step": 90},
        {"event": "start", "job": JOB, "restart": 9, "time": 1e300},
    ]
    folder = write_fixture(tmp_path / "run", METRICS[:5] + junk + METRICS[5:], attempt_lines() + lines)
    s = summary(folder)
    assert (s.allocated_s, s.productive_s, s.lost_steps, s.steps, len(s.attempts)) == (144, 83, 25, 80, 3)
    proc = run_module("hpc_ddp.report", str(folder), "--no-sacct", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "goodput 57.6%" in proc.stdout


def test_a_running_attempts_allocation_runs_until_now(tmp_path: Path) -> None:
    """A run that holds its folder, last record at 110: asked at 210, its attempt has been allocated 109 s
    (not 9), and the 100 s since its last record count as training (records come every few steps)."""
    folder = write_fixture(
        tmp_path / "run", metrics=[step(100 + k, k, 1.0 / k) for k in range(1, 11)], attempts=[]
    )
    (folder / "run.lock").write_text("{}\n")
    run = read_run(folder, use_sacct=False)
    s = timeline.summarize(run.records, run.lines, run.slurm, run.running, now=210.0)
    assert (s.state, s.allocated_s, s.productive_s, s.after_s) == ("running", 109, 109, 0)
    (folder / "run.lock").unlink()  # no run holds it: the attempt was cut at its last record
    run = read_run(folder, use_sacct=False)
    s = timeline.summarize(run.records, run.lines, run.slurm, run.running, now=210.0)
    assert (s.state, s.allocated_s) == ("failed", 9)


@pytest.mark.parametrize("startup", [-500.0, 1e308])
def test_a_startup_no_process_can_have_taken_is_garbage(startup: float, tmp_path: Path) -> None:
    """Negative, or from before 1970: no startup (the attempt starts at its first step), not negative time or
    a 1e308-second allocation."""
    metrics = [dict(METRICS[0], startup_s=startup)] + METRICS[1:]
    a = summary(write_fixture(tmp_path / "run", metrics=metrics)).attempts[0]
    assert (a.startup_s, a.process_start, a.allocated_s) == (0, 1010, 50)
