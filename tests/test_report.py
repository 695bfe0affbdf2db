"""The run report (hpc_ddp.report): every number from a fixture run folder whose answers are known, the page
it writes, and its usage errors.

The fixture (written by `write_fixture`): job 77, three attempts, one step per second of training. A save's
stall comes right after its step; its record is written once the checkpoint is durable, a few seconds later.
  attempt 1: process start 1000, first step 1010 (startup 10 s); saves at step 10 (at 1020, stall 1 s) and
             step 20 (at 1030, stall 2 s); last record step 40 at 1052; the supervisor ends it at 1060:
             failed at step 45, checkpoint 20. The next attempt resumes at 20: 25 steps lost, and the time
             from the step-20 checkpoint (1030 + its 2 s stall) to its last record (1052), 20 s, is lost work.
  attempt 2: process start 1095 (queue 35 s after 1060), first step 1100 at step 20; save at step 40 (stall
             3 s); preempted: agreed save at step 55 (stall 1 s, final), end record 1142; supervisor end 1145,
             checkpoint 55: nothing lost.
  attempt 3: process start 1196 (queue 51 s), first step 1200 at step 55; final save at step 80 (stall 2 s),
             end record 1228, completed at 1230.
  allocated 60 + 50 + 34 = 144 s; productive (1032-1010-3) + (1142-1100-4) + (1228-1200-2) = 19+38+26 = 83 s;
  goodput 83/144; one failure: MTBF 144 s; save cost mean(1, 2, 3) = 2 s (final saves not counted):
  best interval sqrt(2 x 2 x 144) = 24 s.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_environ, run_module
from report_check import IMAGES, inline_images, not_white

from hpc_ddp import proc
from hpc_ddp.report import recorded, timeline
from hpc_ddp.report.recorded import heat_map as records_heat
from hpc_ddp.report.sources import plausible, read_run, sacct_windows
from hpc_ddp.report.timeline import Window
from hpc_ddp.run.folder import _start_ticks, hold_folder
from hpc_ddp.scheduler.slurm.client import SlurmClient

JOB = "77"


def step(t: float, s: int, loss: float, rate: float = 100.0) -> dict[str, Any]:
    return {
        "event": "step",
        "time": t,
        "epoch": 0,
        "step": s,
        "loss": loss,
        "samples_per_s": rate,
        "step_time_s": 1.0,
        "lr": 0.01,
        "data_s": 0.1,
    }


def save(t: float, s: int, stall: float, final: bool = False) -> dict[str, Any]:
    return {
        "event": "save",
        "time": t,
        "epoch": 0,
        "step": s,
        "stall_s": stall,
        "write_s": stall,
        "final": final,
    }


def start(t: float, restart: int, s: int, startup: float) -> dict[str, Any]:
    return {
        "event": "start",
        "time": t,
        "job": JOB,
        "restart": restart,
        "epoch": 0,
        "step": s,
        "resumed": s > 0,
        "world_size": 4,
        "startup_s": startup,
    }


def ranks(t: float, s: int, slow: int | None = None) -> dict[str, Any]:
    times = [0.1, 0.1, 0.1, 0.1]
    if slow is not None:
        times[slow] = 0.4
    return {"event": "ranks", "time": t, "epoch": 0, "step": s, "step_time_s": times, "data_s": [0.01] * 4}


METRICS = [
    start(1010, 0, 0, 10),
    step(1020, 10, 2.0),
    ranks(1020, 10),
    save(1023, 10, 1.0),
    step(1030, 20, 1.5),
    save(1035, 20, 2.0),
    step(1042, 30, 1.2),
    ranks(1042, 30, slow=2),
    step(1052, 40, 1.1),
    start(1100, 1, 20, 5),
    step(1110, 30, 1.3),
    step(1120, 40, 1.0),
    save(1126, 40, 3.0),
    step(1133, 50, 0.8),
    save(1141, 55, 1.0, final=True),
    {
        "event": "end",
        "time": 1142,
        "epoch": 0,
        "step": 55,
        "steps_this_process": 35,
        "samples_per_s": 100.0,
        "median_step_time_s": 1.0,
        "seconds": 47,
    },
    start(1200, 2, 55, 4),
    step(1210, 65, 0.6),
    step(1220, 75, 0.4),
    step(1225, 80, 0.5),
    save(1227, 80, 2.0, final=True),
    {
        "event": "end",
        "time": 1228,
        "epoch": 0,
        "step": 80,
        "steps_this_process": 25,
        "samples_per_s": 100.0,
        "median_step_time_s": 1.0,
        "seconds": 32,
    },
]


def attempt_lines() -> list[dict[str, Any]]:
    def end(t: float, restart: int, outcome: str, s: int, ckpt: int, decision: str) -> dict[str, Any]:
        return {
            "event": "end",
            "job": JOB,
            "restart": restart,
            "time": t,
            "outcome": outcome,
            "step": s,
            "checkpoint": ckpt,
            "rank": 1 if outcome == "failed" else None,
            "node": None,
            "reason": f"{outcome} for the test",
            "signature": "",
            "decision": decision,
            "exclude": [],
        }

    def begin(t: float, restart: int, resumed_from: int | None) -> dict[str, Any]:
        return {
            "event": "start",
            "job": JOB,
            "restart": restart,
            "time": t,
            "nodes": ["node1", "node2"],
            "resumed_from": resumed_from,
        }

    return [
        begin(1009, 0, None),
        end(1060, 0, "failed", 45, 20, "restart"),
        begin(1099, 1, 20),
        end(1145, 1, "preempted", 55, 55, "requeue"),
        begin(1199, 2, 55),
        end(1230, 2, "completed", 80, 80, "done"),
    ]


def write_jsonl(path: Path, records: list[dict[str, Any]], torn: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def write_fixture(
    folder: Path, metrics: list[dict[str, Any]] | None = None, attempts: list[dict[str, Any]] | None = None
) -> Path:
    """A run folder with the fixture's records (or the ones given), each file ending in a torn line."""
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "metrics.jsonl", METRICS if metrics is None else metrics, torn='{"event": "st')
    write_jsonl(folder / "attempts.jsonl", attempt_lines() if attempts is None else attempts, torn='{"ev')
    return folder


def summary(folder: Path) -> timeline.Summary:
    run = read_run(folder, use_sacct=False)
    return timeline.summarize(run.records, run.lines, run.slurm, run.running)


def test_the_fixture_numbers_are_exact(tmp_path: Path) -> None:
    s = summary(write_fixture(tmp_path / "run"))
    assert [a.outcome for a in s.attempts] == ["failed", "preempted", "completed"]
    assert [(a.resumed_at, a.last_step, a.kept_step, a.lost_steps) for a in s.attempts] == [
        (0, 45, 20, 25),
        (20, 55, 55, 0),
        (55, 80, 80, 0),
    ]
    assert [a.allocated_s for a in s.attempts] == [60, 50, 34]
    assert [(a.startup_s, a.productive_s, a.stalls_s, a.lost_s, a.after_s) for a in s.attempts] == [
        (10, 19, 3, 20, 8),
        (5, 38, 4, 0, 3),
        (4, 26, 2, 0, 2),
    ]
    assert [a.queue_before_s for a in s.attempts] == [0, 35, 51]
    assert (s.allocated_s, s.productive_s, s.startup_s, s.stalls_s, s.lost_s, s.after_s, s.queue_s) == (
        144,
        83,
        19,
        9,
        20,
        13,
        86,
    )
    assert s.goodput == pytest.approx(83 / 144)
    assert (s.steps, s.lost_steps, s.failures, s.saves) == (80, 25, 1, 5)
    assert (s.save_cost_s, s.mtbf_s, s.best_interval_s) == (2.0, 144.0, 24.0)
    assert s.save_interval_s == 10.0  # attempt 1: saves at steps 10 and 20, at 1020 and 1030
    assert (s.final_loss, s.best_loss, s.best_step) == (0.5, 0.4, 75)
    assert s.step_time_s == 1.0 and s.best_interval_steps == 24
    assert s.state == "finished"
    assert [a.nodes for a in s.attempts] == [("node1", "node2")] * 3


def test_every_attempts_parts_add_up_to_its_allocation(tmp_path: Path) -> None:
    for a in summary(write_fixture(tmp_path / "run")).attempts:
        parts = a.startup_s + a.productive_s + a.stalls_s + a.lost_s + a.after_s
        assert parts == pytest.approx(a.allocated_s)


def test_slurm_accounting_gives_the_queue_wait(tmp_path: Path) -> None:
    run = read_run(write_fixture(tmp_path / "run"), use_sacct=False)
    slurm = {(JOB, 0): Window(990, 1058), (JOB, 1): Window(1090, 1146), (JOB, 2): Window(1190, None)}
    s = timeline.summarize(run.records, run.lines, slurm)
    assert [a.queue_before_s for a in s.attempts] == [0, 32, 44]


def test_sacct_rows_become_windows_in_start_order_and_implausible_ones_are_dropped() -> None:
    rows = [
        "77|2026-12-02T10:00:00|2026-12-02T10:05:00|2026-12-02T10:10:00|REQUEUED",
        "77|2026-12-02T10:10:05|2026-12-02T10:11:00|Unknown|RUNNING",
        "77|2026-12-02T10:10:05|Unknown|Unknown|PENDING",
        "78|x|y|z|COMPLETED",
        "garbage",
    ]
    asked: list[tuple[str, ...]] = []
    answer = "\n".join(rows)  # whatever is asked, as a sacct that prints these rows would
    windows = sacct_windows(
        JOB, SlurmClient(lambda argv, _t: asked.append(tuple(argv)) or proc.Output(answer))
    )
    assert asked and asked[0][0] == "sacct"  # through the one Slurm client and its one sacct parser
    assert sorted(windows) == [(JOB, 0), (JOB, 1)]
    assert windows[(JOB, 1)].start - windows[(JOB, 0)].end == 60 and windows[(JOB, 1)].end is None
    t0 = windows[(JOB, 0)].start
    assert plausible(windows, [(JOB, 0, t0 + 10), (JOB, 1, t0 - 3600)]) == {(JOB, 0): windows[(JOB, 0)]}


def test_a_running_run_without_attempts_file_or_new_records(tmp_path: Path) -> None:
    """An old-style folder (step and epoch records only) of a run still going: one attempt, running."""
    records = [step(100 + k, k, 1.0 / k) for k in range(1, 11)]
    for r in records:
        for key in ("lr", "data_s"):
            del r[key]
    folder = write_fixture(tmp_path / "run", metrics=records, attempts=[])
    (folder / "run.lock").write_text("{}\n")  # what a run holds while it uses the folder
    s = summary(folder)
    assert len(s.attempts) == 1 and s.state == "running" and s.attempts[0].outcome == "running"
    assert (s.allocated_s, s.productive_s, s.lost_steps, s.steps) == (9, 9, 0, 10)
    assert s.goodput == 1.0 and s.best_interval_s is None and s.final_loss == 0.1
    # Without the lock, nothing runs there: a last attempt without an end was killed.
    (folder / "run.lock").unlink()
    assert summary(folder).state == "failed" and summary(folder).attempts[0].outcome == "cut"


def test_a_lock_left_by_a_killed_run_is_no_running_run(tmp_path: Path) -> None:
    """A run SIGKILLed on this machine leaves its run.lock behind: its dead holder runs nothing."""
    folder = write_fixture(
        tmp_path / "run", metrics=[step(100 + k, k, 1.0 / k) for k in range(1, 4)], attempts=[]
    )
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = hold_folder(folder, "launcher", None, 0)  # a real lock record, then made the child's
        record = dict(lock.record, pid=child.pid, pid_start=_start_ticks(child.pid))
        lock.release()
        (folder / "run.lock").write_text(json.dumps(record) + "\n")
        assert summary(folder).state == "running"
    finally:
        child.kill()
        child.wait(timeout=30)
    assert (folder / "run.lock").exists() and summary(folder).state == "failed"


def test_a_failed_last_attempt_loses_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    metrics = [start(10, 0, 0, 2), step(20, 10, 1.0), save(21, 10, 1.0), step(31, 20, 0.9), step(41, 30, 0.8)]
    attempts = [
        {
            "event": "end",
            "job": JOB,
            "restart": 0,
            "time": 50,
            "outcome": "hang",
            "step": 30,
            "checkpoint": 10,
            "rank": 3,
            "node": "node2",
            "reason": "rank 3 hung",
            "signature": "x",
            "decision": "stop",
            "exclude": [],
        }
    ]
    s = summary(write_fixture(tmp_path / "run", metrics, attempts))
    a = s.attempts[0]
    assert (a.outcome, a.lost_steps, a.startup_s, a.productive_s, a.stalls_s, a.lost_s, a.after_s) == (
        "hang",
        20,
        2,
        10,
        1,
        20,
        9,
    )
    assert s.state == "failed" and s.failures == 1 and s.mtbf_s == 42
    assert s.best_interval_s == pytest.approx(math.sqrt(2 * 1 * 42))


def test_without_attempts_a_restart_that_resumed_earlier_shows_the_lost_steps(tmp_path: Path) -> None:
    """Only metrics: the next start's step says which steps the killed attempt lost."""
    metrics = [
        start(10, 0, 0, 0),
        step(20, 10, 1.0),
        save(20, 10, 0.0),
        step(30, 20, 0.9),
        start(40, 1, 10, 0),
        step(50, 20, 0.9),
    ]
    folder = write_fixture(tmp_path / "run", metrics, attempts=[])
    (folder / "run.lock").write_text("{}\n")
    s = summary(folder)
    assert [(a.outcome, a.lost_steps, a.lost_s) for a in s.attempts] == [("cut", 10, 10), ("running", 0, 0)]
    assert s.failures == 1 and s.goodput == pytest.approx(20 / 30)


def test_an_old_folder_is_cut_into_attempts_at_its_end_records(tmp_path: Path) -> None:
    """Before start records: a process's "end" record closes it, and the next one resumes at that step."""

    def end(t: float, s: int) -> dict[str, Any]:
        return {
            "event": "end",
            "time": t,
            "epoch": 0,
            "step": s,
            "steps_this_process": s,
            "samples_per_s": 1.0,
            "median_step_time_s": 1.0,
            "seconds": 10,
        }

    metrics = (
        [step(100 + k, k, 1.0) for k in range(1, 11)]
        + [end(111, 10)]
        + [step(130 + k, 10 + k, 0.5) for k in range(1, 6)]
        + [end(136, 15)]
    )
    s = summary(write_fixture(tmp_path / "run", metrics, attempts=[]))
    assert [(a.outcome, a.resumed_at, a.last_step, a.allocated_s, a.after_s) for a in s.attempts] == [
        ("stopped", 0, 10, 10, 0),
        ("completed", 10, 15, 5, 0),
    ]
    assert (s.queue_s, s.lost_steps, s.state, s.final_loss) == (20, 0, "finished", 0.5)


def test_records_of_the_wrong_shape_are_skipped_not_fatal(tmp_path: Path) -> None:
    """Foreign or damaged records (json.loads reads Infinity and NaN, strings where numbers belong) change
    nothing: the fixture's numbers stay exact."""
    junk = [
        {"event": "step", "time": "x", "step": 3},
        {"event": "step", "time": 1025, "step": float("inf")},
        {"event": "ranks", "time": 1026, "step": 12, "step_time_s": "fast"},
        {"time": None},
        ["a list"],
    ]
    lines = [
        {"event": "end", "job": JOB, "restart": "zero", "time": 1},
        {"event": "start", "job": JOB, "restart": 5, "time": float("nan")},
        {"event": "start"},
    ]
    folder = write_fixture(tmp_path / "run", METRICS[:3] + junk + METRICS[3:], attempt_lines() + lines)
    s = summary(folder)
    assert (s.allocated_s, s.productive_s, s.lost_steps, len(s.attempts)) == (144, 83, 25, 3)


def test_heat_map_rows_are_ranks() -> None:
    steps, rows = recorded.heat_map(METRICS)
    assert steps == [10, 30] and len(rows) == 4 and rows[2] == [0.1, 0.4]


def test_a_long_run_heat_map_keeps_each_windows_slowest() -> None:
    records = [ranks(k, k) for k in range(1, 2501)] + [
        {"event": "ranks", "time": 9, "step": 2501, "step_time_s": [0.1, 0.1], "data_s": [0.0, 0.0]}
    ]
    records[1233]["step_time_s"][3] = 0.9  # one spike in 2501 records
    steps, rows = records_heat(records, 1000)
    assert len(steps) == 834 and steps[:3] == [1, 4, 7] and len(rows) == 4
    assert rows[3][411] == 0.9 and max(rows[3][:411] + rows[3][412:]) == 0.1
    _, rows = records_heat(records[-2:])
    assert rows[3][0] == 0.1 and math.isnan(rows[3][1])  # the last record has only 2 ranks


def test_young_daly() -> None:
    assert timeline.young_daly(2.0, 144.0) == 24.0
    assert timeline.young_daly(None, 144.0) is None and timeline.young_daly(2.0, None) is None


def test_no_best_interval_says_why() -> None:
    """Issue 33 item 10: "failures 2" beside "best checkpoint interval n/a (no failure seen)": the failures
    came before any save was timed, so the missing number was the save's cost, not a failure."""
    from hpc_ddp.ledger.attempts import Attempt
    from hpc_ddp.report import page

    starts = [{"event": "start", "job": "7", "restart": r, "time": 10.0 + 100 * r, "step": 0} for r in (0, 1)]
    steps = [{"event": "step", "step": 1, "time": 20.0 + 100 * r, "loss": 1.0} for r in (0, 1)]
    lines = [
        Attempt("7", r, started=10.0 + 100 * r, ended=50.0 + 100 * r, outcome="failed", step=1)
        for r in (0, 1)
    ]
    s = timeline.summarize([starts[0], steps[0], starts[1], steps[1]], lines, running=False)
    assert s.failures == 2 and s.best_interval_s is None
    assert (
        dict(page.headline(s))["best checkpoint interval sqrt(2 C M)"] == "n/a (no checkpoint save was timed)"
    )
    assert (
        "n/a (no failure seen)"
        in dict(page.headline(timeline.summarize([starts[0], steps[0]], running=False))).values()
    )


# ----- the command ----------------------------------------------------------------------------------------


def test_the_command_writes_one_self_contained_page_and_the_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = write_fixture(tmp_path / "run")
    proc = run_module("hpc_ddp.report", str(folder), "--no-sacct", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"report: {folder / 'report.html'} (finished; 3 attempts, step 80, "
        "smoothed training loss 1.012 (mean of the last 8 steps), goodput 57.6%, lost 25 steps, best "
        "checkpoint interval 24.0 s)"
    )
    page = (folder / "report.html").read_text()
    assert not re.search(r"https?://", page) and "<script" not in page
    images = inline_images(page)
    assert list(images) == list(IMAGES)
    for name, png in images.items():
        assert png.startswith(b"\x89PNG") and png == (folder / name).read_bytes()
        assert not_white(png) > 0.02, name
    for text in (
        "57.6%",
        "25 steps replayed",
        "sqrt(2",
        "failed for the test",
        "node1 node2",
        "24.0 s",
        "from metrics.jsonl and attempts.jsonl.</p>",
        "Goodput 57.6% &middot; finished",
    ):
        assert text in page


def test_out_elsewhere(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = write_fixture(tmp_path / "run")
    (tmp_path / "web").mkdir()
    proc = run_module("hpc_ddp.report", str(folder), "--out", str(tmp_path / "web" / "r.html"), "--no-sacct")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "web" / "r.html").is_file() and (tmp_path / "web" / "loss.png").is_file()
    assert not (folder / "report.html").exists()


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: p, "is not a run folder: it has no metrics.jsonl"),
        (lambda p: p / "missing", "is not a folder"),
    ],
)
def test_a_folder_that_is_no_run_folder_is_one_line_and_exit_2(
    make: Any, expected: str, tmp_path: Path
) -> None:
    proc = run_module("hpc_ddp.report", str(make(tmp_path)), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and expected in proc.stderr and "Traceback" not in proc.stderr


def test_without_matplotlib_the_command_says_how_to_install_it(tmp_path: Path) -> None:
    folder = write_fixture(tmp_path / "run")
    (tmp_path / "nompl").mkdir()
    (tmp_path / "nompl" / "matplotlib.py").write_text("raise ImportError('hidden for the test')\n")
    env = clean_environ()
    env["PYTHONPATH"] = f"{tmp_path / 'nompl'}:{env['PYTHONPATH']}"
    proc = run_module("hpc_ddp.report", str(folder), env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "pip install 'hpc-ddp[report]'" in proc.stderr


@pytest.mark.parametrize(
    "seconds, text",
    [
        (None, "n/a"),
        (0, "0 s"),
        (0.0186, "18.6 ms"),
        (9.04, "9.0 s"),
        (83, "1 min 23 s"),
        (7322, "2 h 02 min"),
    ],
)
def test_durations_read_as_a_person_would_say_them(seconds: float | None, text: str) -> None:
    from hpc_ddp.report.page import duration

    assert duration(seconds) == text


def fake_sacct(bin_dir: Path, rows: list[str], code: int = 0) -> dict[str, str]:
    """A `sacct` on PATH that prints `rows` (and exits `code`), and the environment that finds it."""
    bin_dir.mkdir()
    script = bin_dir / "sacct"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{row}'\n" for row in rows) + f"exit {code}\n")
    script.chmod(0o755)
    env = clean_environ()
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return env


def slurm_clock(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


@pytest.mark.parametrize("code, queue", [(0, "1 min 16 s"), (1, "1 min 26 s")])
def test_queue_waits_come_from_sacct_when_it_answers(code: int, queue: str, tmp_path: Path) -> None:
    """Slurm's own start and end of each run of job 77 give 32 + 44 s; a sacct that fails leaves the gaps
    between the attempts' records (35 + 51 s)."""
    pytest.importorskip("matplotlib")
    rows = [
        f"77|{slurm_clock(900)}|{slurm_clock(990)}|{slurm_clock(1058)}|REQUEUED",
        f"77|{slurm_clock(1058)}|{slurm_clock(1090)}|{slurm_clock(1146)}|REQUEUED",
        f"77|{slurm_clock(1146)}|{slurm_clock(1190)}|Unknown|RUNNING",
    ]
    env = fake_sacct(tmp_path / "bin", rows, code)
    folder = write_fixture(tmp_path / "run")
    proc = run_module("hpc_ddp.report", str(folder), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (folder / "report.html").read_text()
    assert f"<tr><th>queue wait between attempts</th><td>{queue}</td></tr>" in page
    assert ("and Slurm&#x27;s accounting (sacct).</p>" in page) == (code == 0)


def test_help_is_quick_and_options_are_never_abbreviated(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpc_ddp.report", "--help"],
        cwd=tmp_path,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m hpc_ddp.report")
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()}
    assert "hpc_ddp" in imported and not imported & {"torch", "matplotlib", "numpy"}
    proc = run_module("hpc_ddp.report", str(tmp_path), "--no-sac", timeout=60)
    assert proc.returncode == 2 and "did you mean --no-sacct?" in proc.stderr, proc.stderr
