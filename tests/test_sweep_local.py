"""Sweeps (issue 44), locally and for real: one 2-trial sweep of tiny 2-rank runs, two at a time (distinct ports),
read by every test here; the same command again runs nothing; a trial ends bitwise equal to the same options run
alone (conftest's uninterrupted_2x1: DETERMINISTIC_2X1 with --lr 0.005)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import DETERMINISTIC_2X1, clean_environ, die_with_test, run_module

from hpc_ddp.ledger import attempts

pytestmark = [pytest.mark.slow, pytest.mark.deadline(120)]

# DETERMINISTIC_2X1 without its --lr (the sweep's): lr=0.005 is that run alone.
ARGS = list(DETERMINISTIC_2X1[: DETERMINISTIC_2X1.index("--lr")])
SWEEP = ["--sweep", "lr=0.005,0.01", "--sweep-parallel", "2"]


def sweep(folder: Path) -> tuple[int, str]:
    command = [sys.executable, "-m", "hpc_ddp.submit", "--local", "--folder", str(folder), *ARGS, *SWEEP]
    done = subprocess.run(
        command,
        env=clean_environ(SLOW_TASK_SLEEP_S="0"),
        capture_output=True,
        text=True,
        timeout=100,
        preexec_fn=die_with_test,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    folder = tmp_path_factory.mktemp("sweep") / "lrs"
    code, out = sweep(folder)
    return folder, code, out


def test_every_trial_runs_as_a_whole_run_in_its_own_folder(swept: tuple[Path, int, str]) -> None:
    folder, code, out = swept
    assert code == 0, out
    names = ["lr=0.005", "lr=0.01"]
    assert [t["name"] for t in json.loads((folder / "sweep.json").read_text())["trials"]] == names
    for name in names:
        trial = folder / name
        assert f"[sweep] trial {name}: new" in out and f"[sweep] trial {name}: exit 0 (finished)" in out
        assert (trial / "model.pth").is_file() and (trial / "launcher.log").is_file()
        (only,) = attempts.read(trial)
        assert (only.outcome, only.decision) == ("completed", "done")
        assert json.loads((trial / "run.json").read_text())["config"]["lr"] == float(name.split("=")[1])
    # Two at a time: two launchers, two fake job ids, two rendezvous ports.
    jobs = {attempts.read(folder / n)[0].job for n in names}
    assert len(jobs) == 2


def test_the_same_command_again_runs_nothing(swept: tuple[Path, int, str]) -> None:
    folder, code, _ = swept
    assert code == 0
    before = {p: p.stat().st_mtime_ns for p in folder.glob("*/model.pth")}
    again, out = sweep(folder)
    assert again == 0, out
    assert "[sweep] trial lr=0.005: finished" in out and "[sweep] trial lr=0.01: finished" in out
    assert "2 trial(s) in" in out and "0 to run" in out and "started" not in out
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*/model.pth")} == before
    assert all(len(attempts.read(p.parent)) == 1 for p in before)


def test_a_trial_equals_the_same_options_run_alone(
    swept: tuple[Path, int, str], uninterrupted_2x1: Path
) -> None:
    folder, code, out = swept
    assert code == 0, out
    expected = torch.load(uninterrupted_2x1 / "model.pth", weights_only=True)
    got = torch.load(folder / "lr=0.005" / "model.pth", weights_only=True)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    other = torch.load(folder / "lr=0.01" / "model.pth", weights_only=True)
    assert not all(torch.equal(expected[k], other[k]) for k in expected)  # the lr did vary


def test_the_sweeps_report_is_one_page_with_every_trial_and_a_link_to_its_own(
    swept: tuple[Path, int, str],
) -> None:
    folder, code, out = swept
    assert code == 0, out
    done = run_module("hpc_ddp.report", str(folder), "--no-sacct")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == (
        f"report: {folder / 'report.html'} (sweep of 2 trial(s), 2 finished; each trial's report beside it)"
    )
    page = (folder / "report.html").read_text()
    assert (
        "<th>lr</th><th>state</th><th>steps</th><th>final loss</th><th>best loss</th><th>goodput</th>" in page
    )
    for name in ("lr=0.005", "lr=0.01"):
        assert f'<a href="{name}/report.html">{name}</a>' in page
        assert (folder / name / "report.html").is_file()
    assert "<td>0.005</td><td>finished</td><td>48</td>" in page and 'alt="loss"' in page


def test_sigterm_stops_every_running_trial_starts_no_other_and_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each running trial gets SIGINT (a launcher saves and exits 130 on it) and is waited for; no process
    outlives the sweep. Trials here are stand-ins that exit 130 on SIGINT, as a launcher does."""
    from hpc_ddp.launch.sweep import local
    from hpc_ddp.launch.sweep.trials import Trial
    from hpc_ddp.run.config import TrainConfig

    started: list[subprocess.Popen[bytes]] = []
    code = "import signal,sys,time; signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); print(1, flush=True); time.sleep(60)"

    def start(trial: Trial, job_id: str, quiet: bool) -> local._Running:
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, preexec_fn=die_with_test
        )
        assert process.stdout is not None and process.stdout.readline()  # its handler is in place
        started.append(process)
        return local._Running(trial, process, None)

    monkeypatch.setattr(local, "_start", start)
    trials = [Trial(f"t{i}", (), (), tmp_path / f"t{i}", TrainConfig()) for i in range(3)]
    lines: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            local.run(trials, 2, lines.append)
    finally:
        timer.cancel()
    assert len(started) == 2 and [p.returncode for p in started] == [130, 130]
    assert "[sweep] stopping: 2 running trial(s) save and exit; 1 not started" in lines
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_value_added_runs_the_new_trials_only(swept: tuple[Path, int, str]) -> None:
    """The same sweep with lr=0.02 added, shown as a Slurm array (--print-sbatch: nothing runs or is written):
    the finished trials are left alone, the array holds the new trial alone."""
    folder, code, out = swept
    assert code == 0, out
    argv = ["--folder", str(folder), *ARGS, "--sweep", "lr=0.005,0.01,0.02", "--print-sbatch"]
    done = run_module("hpc_ddp.submit", *argv, env=clean_environ(SLOW_TASK_SLEEP_S="0"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "[sweep] trial lr=0.005: finished" in done.stdout and "[sweep] trial lr=0.01: finished" in done.stdout
    )
    assert "[sweep] trial lr=0.02: new" in done.stdout and "#SBATCH --array=0-0%1" in done.stdout
    assert "# element 0: python -m hpc_ddp.train" in done.stderr and "--lr=0.02" in done.stderr
    assert not (folder / "lr=0.02").exists()
