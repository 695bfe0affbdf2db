"""Nothing hangs: the per-test deadline (tests/deadline.py) and the whole-run one (env/deadline.sh, .ci/run).

Each case runs in a subprocess with a subprocess timeout, so a broken deadline fails here instead of hanging.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, clean_environ, die_with_test

DEADLINE_SH = ROOT / "env" / "deadline.sh"
BOUND_S = 60  # what "fails in minutes" means here: each case must be over well within this

PYTEST_INI = """[pytest]
markers = deadline(seconds): this test's own deadline
"""

STUCK = """
import ctypes


def test_fast_before():
    pass


def test_stuck_in_native_code_holding_the_gil():
    ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held for the whole call
"""

# A test that writes the pids of pytest's children (the deadline relay) to PIDS, forks a child that keeps
# every inherited descriptor (the relay's pipe too) and sleeps, then sleeps itself: the caller kills pytest.
KILLED = """
import os
import time

import psutil


def test_waits_to_be_killed():
    relays = [p.pid for p in psutil.Process().children()]
    forked = os.fork()
    if forked == 0:
        time.sleep(600)
        os._exit(0)
    with open(os.environ["PIDS"] + ".tmp", "w") as f:
        f.write(" ".join(map(str, [os.getpid(), forked, *relays])))
    os.rename(os.environ["PIDS"] + ".tmp", os.environ["PIDS"])
    time.sleep(600)
"""

REARMED = """
import time

import pytest


def test_fast():
    pass


@pytest.mark.deadline(30)
def test_slower_than_the_first_deadline_within_its_own():
    time.sleep(3)  # the first test's 2 s timer, if still running, would fire here
"""


def pytest_argv(tmp_path: Path, name: str, source: str, *args: str) -> list[str]:
    """pytest with only the deadline plugin on one test file written to tmp_path."""
    (tmp_path / "pytest.ini").write_text(PYTEST_INI)
    (tmp_path / name).write_text(source)
    return [sys.executable, "-m", "pytest", "-p", "deadline", "-p", "no:cacheprovider", *args, name]


def run_pytest(
    tmp_path: Path, name: str, source: str, *args: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """pytest_argv's run, to its end; the result and its wall time."""
    argv = pytest_argv(tmp_path, name, source, *args)
    start = time.monotonic()
    proc = subprocess.run(
        argv,
        cwd=tmp_path,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        preexec_fn=die_with_test,
    )
    return proc, time.monotonic() - start


def test_a_test_stuck_in_native_code_holding_the_gil_fails_with_every_stack(tmp_path: Path) -> None:
    proc, took = run_pytest(tmp_path, "test_stuck.py", STUCK, "-o", "deadline_s=3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert 3 <= took < BOUND_S
    line = (
        "[deadline] test_stuck.py::test_stuck_in_native_code_holding_the_gil: passed its 3 s deadline; "
        "every thread's stack follows, then the run exits 1"
    )
    assert line in proc.stderr, out
    assert proc.stderr.count("[deadline]") == 1, out  # the test that passed before it is not named
    dump = proc.stderr[proc.stderr.index(line) :]
    assert "Timeout (0:00:03)!" in dump, out
    assert re.search(r"^Thread 0x[0-9a-f]+ \(most recent call first\):$", dump, re.M), out
    # The stuck frame itself: the test function, its file and line.
    assert re.search(
        r'File ".*test_stuck\.py", line 10 in test_stuck_in_native_code_holding_the_gil', dump
    ), out


def test_each_test_gets_its_own_deadline_and_a_finished_one_is_cancelled(tmp_path: Path) -> None:
    proc, _ = run_pytest(tmp_path, "test_rearmed.py", REARMED, "-o", "deadline_s=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    # Deadlines that hold print nothing (issue 18: the [deadline] lines only when one fires).
    assert "[deadline]" not in proc.stdout + proc.stderr
    assert "Timeout" not in proc.stderr


def test_deadline_s_0_turns_deadlines_off(tmp_path: Path) -> None:
    proc, _ = run_pytest(tmp_path, "test_rearmed.py", REARMED, "-o", "deadline_s=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[deadline]" not in proc.stderr


def test_the_relay_ends_with_a_killed_pytest_even_when_a_forked_child_holds_its_pipe(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    argv = pytest_argv(tmp_path, "test_killed.py", KILLED, "-o", "deadline_s=60")
    with subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=clean_environ(PIDS=str(pids)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_test,
    ) as pytest_proc:
        try:
            until = time.monotonic() + BOUND_S
            while not pids.exists() and pytest_proc.poll() is None and time.monotonic() < until:
                time.sleep(0.1)
            assert pids.exists(), "the inner test never started"
            pytest_pid, forked, *relays = map(int, pids.read_text().split())
            assert pytest_pid == pytest_proc.pid and relays, pids.read_text()
            pytest_proc.kill()
            pytest_proc.wait()
            until = time.monotonic() + 20  # the relay looks for its parent every second
            while not all(gone(pid) for pid in relays) and time.monotonic() < until:
                time.sleep(0.1)
            assert all(gone(pid) for pid in relays)
            assert not gone(forked)  # it still held the pipe open: the relay did not wait for its end
        finally:
            pytest_proc.kill()
            if pids.exists() and not gone(forked := int(pids.read_text().split()[1])):
                os.kill(forked, signal.SIGKILL)


# ----- env/deadline.sh: the whole run's deadline (.ci/run) ---------------------------------------------------

# A Python process stuck in native code with the GIL held, with a child of its own in another session (as the
# local launcher's ranks are): the pids go to the file named by argv[1] once both run.
STUCK_TREE = """
import ctypes, os, subprocess, sys
child = subprocess.Popen(["sleep", "600"], start_new_session=True)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")


def stuck_in_native_sleep():
    ctypes.PyDLL(None).sleep(600)


stuck_in_native_sleep()
"""


def run_deadline(seconds: int, *command: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(DEADLINE_SH), "--label", "[ci] suite", str(seconds), "--", *command],
        env=clean_environ(**env),
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        preexec_fn=die_with_test,
    )
    return proc, time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_run_deadline_dumps_native_and_python_stacks_and_kills_the_tree(tmp_path: Path) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(spy, os.X_OK):
        pytest.skip("py-spy is not installed: bash env/setup.sh --test")
    pids = tmp_path / "pids"
    proc, took = run_deadline(3, sys.executable, "-c", STUCK_TREE, str(pids), PY_SPY=spy)
    out = proc.stdout
    assert proc.returncode == 124, out + proc.stderr
    assert took < 30, out
    assert "[ci] suite passed its 3-second deadline: stacks of its 2 process(es) follow" in out
    assert out.rstrip().endswith("[ci] suite passed its 3-second deadline; killed its process tree; exit 124")
    stuck, child = map(int, pids.read_text().split())
    assert f"py-spy dump --native --pid {stuck}" in out
    assert f"py-spy dump --native --pid {child}" in out  # the child in its own session is in the tree
    assert re.search(r"^\s+sleep \(libc[^)]*\)$", out, re.M), out  # the native frame
    assert re.search(r"^\s+stuck_in_native_sleep \(<string>:\d+\)$", out, re.M), out  # the Python frame
    assert gone(stuck) and gone(child)


def test_the_run_deadline_without_py_spy_still_lists_and_kills(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    proc, took = run_deadline(
        1, "bash", "-c", f"echo $$ > {pid_file}; exec sleep 600", PY_SPY=str(tmp_path / "no")
    )
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert took < 30
    assert "py-spy not found, no stacks" in proc.stdout
    pid = int(pid_file.read_text())
    assert re.search(rf"^\s*{pid}\s.*sleep 600$", proc.stdout, re.M), proc.stdout
    assert gone(pid)


def test_the_run_deadline_passes_on_the_command_status() -> None:
    proc, took = run_deadline(60, "bash", "-c", "echo out; exit 3")
    assert (proc.returncode, proc.stdout, took < 30) == (3, "out\n", True)
