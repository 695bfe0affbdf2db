"""End-to-end: the local launcher really trains, supervises, and passes signals (real gloo, 4 processes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp import exitcodes
from hpc_ddp.launch.local.console import consequence
from hpc_ddp.submit import resume_command

pytestmark = [pytest.mark.slow, pytest.mark.deadline(60)]  # each 8-10 s (measured)


def start(folder: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "--folder", str(folder), *args]
    return subprocess.Popen(
        cmd,
        env=clean_environ(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )


def read_until(proc: subprocess.Popen[str], needle: str, timeout: float = 120) -> list[str]:
    """Lines of the launcher's console up to the first one containing `needle`."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never appeared; output:\n" + "\n".join(lines))


def ranks_of(launcher: int) -> dict[int, psutil.Process]:
    """The launcher's ranks by rank: its children but the fork server, which has none. A rank forked by the
    server is named for its rank (its /proc environment is the server's); one started the plain way has its
    SLURM_PROCID there."""
    found = {}
    for child in psutil.Process(launcher).children():
        name, env = child.name(), child.environ()
        if name.startswith("hpc_ddp rank "):
            found[int(name.split()[-1])] = child
        elif "SLURM_PROCID" in env:
            found[int(env["SLURM_PROCID"])] = child
    return found


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


# The 2x2 run with the article's output: tests/test_launch_local_console.py (README's quick start, run twice).


def test_sigkill_of_one_rank_stops_everything_within_seconds(tmp_path: Path) -> None:
    # --max-restarts 0: no retry, the launcher ends at the first failure (tests/test_launch_local_retry.py retries)
    proc = start(
        tmp_path,
        "--task",
        "slow_tasks:slow",
        "--epochs",
        "100",
        "--max-restarts",
        "0",
        SLOW_TASK_SLEEP_S="0.05",
    )
    read_until(proc, "Epoch 0,")
    children = psutil.Process(proc.pid).children()  # the 4 ranks and the fork server
    by_rank = ranks_of(proc.pid)
    assert sorted(by_rank) == [0, 1, 2, 3] and len(children) == 5
    by_rank[2].send_signal(signal.SIGKILL)
    code, out = finish(proc, timeout=30)  # a hang here fails the test
    assert code == 1, out
    # One name per node (issue 21): its index, as the ranks' start lines say it, and its address.
    assert "rank 2 on node 1 (127.0.0.2), pid " in out and "was killed by SIGKILL" in out
    assert "attempt 1 failed on node 1 (127.0.0.2) (points at the node)" in out
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_a_rank_that_raises_fails_the_run_and_shows_its_error(tmp_path: Path) -> None:
    code, out = finish(start(tmp_path, "--task", "slow_tasks:crash", "--max-restarts", "0"), timeout=120)
    assert code == 1
    assert "rank 1 on node 0 (127.0.0.1), pid " in out and "exited with code 1" in out
    assert "boom from rank 1" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("[launcher] rank 1 on node 0"))
    assert "attempt 1 failed on node 0 (127.0.0.1): RuntimeError: boom from rank 1" in out
    # The ranks that failed only because rank 1 ended (gloo's "Connection closed by peer ... GLHF!") come
    # after the first cause, folded into one line naming their logs (issue 21); before, rank 0's came first.
    saw = [r for r in (0, 2, 3) if consequence((tmp_path / "logs" / f"rank{r}.log").read_text())]
    assert saw, "no rank saw rank 1 end"  # each was in a collective with it
    assert "GLHF" not in out and "Connection closed by peer [" not in out, out
    then = [i for i, line in enumerate(lines) if " failed too, on the rank that ended first (" in line]
    assert len(then) == 1 and then[0] > first, out
    named = lines[then[0]].split("[launcher] then ")[1].split(" failed too")[0].split(" ", 1)[1]
    assert set(named.split(", ")) <= {"0", "2", "3"}, lines[then[0]]
    assert "a consequence, not a cause" in lines[then[0]]
    assert "hpc_ddp: rank 0 exits with code 1" not in out  # a consequence's last words: in its log
    assert "[rank " not in out, out  # rank 0's lines only (issue 21)
    # After a failure that ends the run: the exact command that starts it again (no checkpoint yet here).
    advice = next(line for line in lines if "the same command resumes" in line)
    argv = ["--local", "--folder", str(tmp_path), "--task", "slow_tasks:crash", "--max-restarts", "0"]
    assert advice.endswith(f"resumes from the start (no checkpoint yet): {resume_command(argv)}"), advice


def test_killing_the_launcher_leaves_no_process(tmp_path: Path) -> None:
    # 2 nodes x 1 rank: a rank on each emulated node, as few rank processes as that takes
    proc = start(
        tmp_path,
        "--task",
        "slow_tasks:slow",
        "--epochs",
        "100",
        "--tasks-per-node",
        "1",
        SLOW_TASK_SLEEP_S="0.05",
    )
    read_until(proc, "Epoch 0,")
    children = psutil.Process(proc.pid).children()  # the 2 ranks and the fork server: all must go
    assert len(ranks_of(proc.pid)) == 2 and len(children) == 3
    proc.kill()  # SIGKILL: no cleanup code runs in the launcher
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive


def test_a_hang_dumps_every_rank_stack_to_its_log_then_fails(tmp_path: Path) -> None:
    """With --timeout-s 8 the auto hang threshold is 4 s: the watchdog's verdict comes first (run/watch/watchdog.py),
    and every rank's log holds its stacks."""
    proc = start(
        tmp_path, "--task", "slow_tasks:hang", "--nodes", "1", "--timeout-s", "8", "--max-restarts", "0"
    )
    code, out = finish(proc, timeout=120)
    assert code == exitcodes.HANG, out
    assert "[launcher] hang at step 2: rank 1 (" in out
    waiting = (tmp_path / "logs" / "rank0.log").read_text()
    stuck = (tmp_path / "logs" / "rank1.log").read_text()
    # rank 0 shows where it waited (DDP's gradient all-reduce in backward), rank 1 where it is stuck (loss_fn)
    assert "in backward" in waiting and ", in step\n" in waiting  # the loop's step (run/loop/trainer.py)
    assert "slow_tasks.py" in stuck and "in loss_fn" in stuck


def test_a_launcher_started_with_its_stdout_closed_runs_and_speaks_on_stderr(tmp_path: Path) -> None:
    """`python -m hpc_ddp.submit --local ... >&-`: before, AttributeError ('NoneType' ... 'flush'), nothing ran."""
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "--folder", str(tmp_path), "--nodes", "1"]
    proc = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *cmd, "--epochs", "1"],
        env=clean_environ(),
        stderr=subprocess.PIPE,
        text=True,
        timeout=50,
        preexec_fn=die_with_test,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "[launcher] local job " in proc.stderr and "Model saved by rank 0" in proc.stderr
    assert (tmp_path / "model.pth").is_file()
