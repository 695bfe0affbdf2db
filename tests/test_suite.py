"""The suite's own rules: Slurm's commands are failing stand-ins unless a test is marked slurm
(tests/standins.py); every test has one cost marker, and every run ends with the seconds per test file
(tests/costs.py). The first tests look at this very run; the others run pytest on a small file in tmp_path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import costs
import pytest
import standins
import workers
from conftest import ROOT, clean_environ, die_with_test

BOUND_S = 60
XDIST_BOUND_S = 180  # pytest with two workers: three pytest start-ups (they take seconds on a busy machine)

# ----- this run ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", standins.COMMANDS)
def test_slurm_commands_are_failing_stand_ins_here_and_in_the_processes_tests_start(command: str) -> None:
    assert shutil.which(command) == str(standins.folder() / command)
    for env in (None, clean_environ()):  # in-process, and for a subprocess's environment
        proc = subprocess.run(
            ["bash", "-c", f"{command} --version"], env=env, capture_output=True, text=True, timeout=BOUND_S
        )
        assert proc.returncode != 0
        assert proc.stdout == ""
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"{command}: a stand-in from tests/standins.py"), proc.stderr
        assert f"a test that needs {command} brings its own fake first on PATH" in proc.stderr


def test_a_fake_put_first_on_path_by_the_test_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sinfo").write_text("#!/bin/sh\necho 'node1 idle'\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for env in (None, clean_environ()):
        proc = subprocess.run(["sinfo"], env=env, capture_output=True, text=True, timeout=BOUND_S)
        assert (proc.returncode, proc.stdout) == (0, "node1 idle\n")


def test_this_test_has_one_cost(request: pytest.FixtureRequest) -> None:
    found = [m.name for m in request.node.iter_markers() if m.name in costs.COSTS]
    assert found == ["unit"]


def test_every_file_the_cost_table_names_exists() -> None:
    tests = ROOT / "tests"
    assert [f for f in costs.FILES if not (tests / f).is_file()] == []
    assert [t for t in costs.TESTS if not (tests / t.split("::")[0]).is_file()] == []


# ----- pytest on a small file -------------------------------------------------------------------------------

PYTEST_INI = """[pytest]
addopts = --strict-markers
markers =
    unit: x
    process: x
    ranks: x
    slurm: x
    scenario: x
    slow: x
"""

STANDINS = """
import os
import shutil

import pytest
import standins

AT_COLLECTION = shutil.which("scontrol")


def stand_in(command):
    return shutil.which(command) == str(standins.folder() / command)


@pytest.mark.unit
def test_collection_saw_the_stand_ins():
    assert AT_COLLECTION == str(standins.folder() / "scontrol")
    assert stand_in("scontrol")


@pytest.mark.slurm
def test_a_slurm_test_sees_none():
    assert str(standins.folder()) not in os.environ["PATH"].split(os.pathsep)
    assert not stand_in("sbatch")


@pytest.mark.unit
def test_the_next_test_has_them_again():
    assert stand_in("sbatch")
"""

COSTLESS = """
import pytest


@pytest.mark.unit
def test_with_a_cost():
    pass


def test_without_a_cost():
    pass
"""

TWO_COSTS = """
import pytest


@pytest.mark.unit
@pytest.mark.process
def test_two():
    pass
"""

COSTED = """
import pytest

pytestmark = pytest.mark.ranks


@pytest.mark.unit  # the test's own cost wins over its file's
def test_quick():
    pass


def test_many_ranks():
    pass
"""


def run_pytest(tmp_path: Path, name: str, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with only the stand-ins and costs plugins, on one test file written to tmp_path."""
    (tmp_path / "pytest.ini").write_text(PYTEST_INI)
    (tmp_path / name).write_text(source)
    argv = [sys.executable, "-m", "pytest", "-p", "standins", "-p", "costs", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*argv, *args, name],
        cwd=tmp_path,
        env=clean_environ(PATH=standins.without_standins(os.environ["PATH"])),  # as a run of its own
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        preexec_fn=die_with_test,
    )


@pytest.mark.slow  # pytest in pytest, as every test below
def test_stand_ins_from_collection_on_and_none_while_a_slurm_test_runs(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "test_standins.py", STANDINS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout


@pytest.mark.slow
def test_a_test_without_a_cost_fails_collection_and_says_where_to_add_one(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "test_costless.py", COSTLESS)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert (
        "1 test(s) without a cost marker, first test_costless.py::test_without_a_cost. Fix: add the file to "
        "FILES in tests/costs.py, or mark the test: @pytest.mark.<cost> with one of unit, process, ranks, "
        "slurm, scenario"
    ) in proc.stderr


@pytest.mark.slow
def test_two_costs_are_refused(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "test_two.py", TWO_COSTS)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "test_two.py::test_two: two cost markers (process, unit); keep one" in proc.stderr


@pytest.mark.slow
def test_costly_tests_leave_the_quick_lane_and_each_run_ends_with_seconds_per_file(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "test_costed.py", COSTED, "-m", "not slow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 deselected" in proc.stdout
    lines = proc.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if "seconds per test file" in line)
    # wall seconds, CPU seconds, tests, file
    assert lines[title + 1].split()[1:] == [
        "s",
        lines[title + 1].split()[2],
        "cpu-s",
        "1",
        "tests",
        "test_costed.py",
    ]
    assert lines[title + 2].split()[1:] == [
        "s",
        lines[title + 2].split()[2],
        "cpu-s",
        "1",
        "tests",
        "in",
        "all",
    ]
    assert float(lines[title + 1].split()[2]) >= 0, proc.stdout
    assert lines[title + 3].startswith("by cost: unit "), proc.stdout


# Under pytest-xdist (env/test.sh): the slurm tests on one worker, one after the other; a shared run made once;
# the table of seconds per file from every worker; a deadline that fires in a worker still shows its stacks.
SPREAD = """
import os
import time
from pathlib import Path

import pytest

OUT = Path(os.environ["SPREAD_OUT"])


def note(name):
    (OUT / f"{name}.{time.monotonic_ns()}").write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture(scope="module")
def shared_run():
    note("shared_run")


@pytest.mark.slurm
@pytest.mark.parametrize("i", range(3))
def test_on_the_cluster(i):
    note("slurm")
    for folder in os.environ["PATH"].split(os.pathsep):  # no stand-in, not even the controller's
        command = Path(folder, "sbatch")
        assert not command.is_file() or "tests/standins.py" not in command.read_text(errors="replace")
    time.sleep(0.3)


@pytest.mark.unit
@pytest.mark.parametrize("i", range(3))
def test_reads_the_shared_run(shared_run, i):
    note("shared")


@pytest.mark.unit
@pytest.mark.parametrize("i", range(6))
def test_anywhere(i):
    time.sleep(0.2)
"""

STUCK_IN_A_WORKER = """
import time

import pytest


@pytest.mark.unit
def test_fine():
    pass


@pytest.mark.unit
def test_stuck():
    time.sleep(600)
"""


def run_xdist(tmp_path: Path, name: str, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest -n 2 --dist loadgroup with the suite's plugins, xdist as the test process found it."""
    xdist = pytest.importorskip("xdist", reason="pytest-xdist is in env/requirements-test.txt")
    site = str(Path(xdist.__file__).resolve().parent.parent)
    env = clean_environ(PATH=standins.without_standins(os.environ["PATH"]), SPREAD_OUT=str(tmp_path / "out"))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], site])
    (tmp_path / "out").mkdir()
    (tmp_path / "pytest.ini").write_text(PYTEST_INI + "    alone: x\n    deadline(seconds): x\n")
    (tmp_path / name).write_text(source)
    plugins = ["-p", "xdist", "-p", "deadline", "-p", "standins", "-p", "workers", "-p", "costs"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *plugins, "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
        + [*args, name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=XDIST_BOUND_S,
        preexec_fn=die_with_test,
    )


@pytest.mark.slow
@pytest.mark.deadline(XDIST_BOUND_S + 30)
def test_under_xdist_slurm_tests_share_a_worker_a_shared_run_is_made_once_and_every_file_is_counted(
    tmp_path: Path,
) -> None:
    proc = run_xdist(tmp_path, "test_spread.py", SPREAD, "-v")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 passed" in proc.stdout
    notes = sorted((tmp_path / "out").iterdir(), key=lambda p: int(p.suffix[1:]))
    by = {
        kind: [p.read_text() for p in notes if p.stem == kind] for kind in ("slurm", "shared_run", "shared")
    }
    assert len(by["slurm"]) == 3 and len(set(by["slurm"])) == 1, by  # one worker, one after the other
    assert len(by["shared_run"]) == 1 and set(by["shared"]) == set(by["shared_run"]), by
    assert "@slurm" in proc.stdout  # xdist's group suffix on the node ids
    lines = proc.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if "seconds per test file" in line)
    assert lines[title + 1].split()[3:] == ["cpu-s", "12", "tests", "test_spread.py"], proc.stdout


@pytest.mark.slow
@pytest.mark.deadline(XDIST_BOUND_S + 30)
def test_under_xdist_a_deadline_in_a_worker_names_the_test_shows_the_stacks_and_fails_the_run(
    tmp_path: Path,
) -> None:
    proc = run_xdist(tmp_path, "test_stuck.py", STUCK_IN_A_WORKER, "-o", "deadline_s=3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "[deadline] test_stuck.py::test_stuck: passed its 3 s deadline" in out
    assert "in test_stuck" in out  # the stuck test's frame, from faulthandler's dump
    assert out.count("[deadline]") == 1, out  # the stuck test ran once: the run stopped there
    assert "worker restarting disabled" in proc.stdout and "1 failed" in proc.stdout, out


def test_the_second_clusters_files_are_its_own_group_only_when_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """env/test.sh starts a second local cluster and exports its folder; without it (a single cluster, or
    HPC_DDP_NO_SLURM=1), every slurm test runs on the one cluster, in one group."""
    submit, survive = Path("tests/test_launch_slurm_submit.py"), Path("tests/test_launch_slurm_survive.py")
    monkeypatch.delenv(workers.SECOND_CLUSTER_DIR, raising=False)
    assert workers.second_cluster(submit) is None and workers.second_cluster(survive) is None
    monkeypatch.setenv(workers.SECOND_CLUSTER_DIR, "/var/tmp/second")
    assert workers.second_cluster(submit) == "/var/tmp/second" and workers.second_cluster(survive) is None
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert set(workers.SECOND_CLUSTER) <= files  # no stale name
