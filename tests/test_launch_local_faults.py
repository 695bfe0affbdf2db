"""The local launcher never hangs: a full disk under the logs, a closed console, Ctrl-C on a hung rank.

Each test runs a real local job (gloo on CPU) and bounds it with a deadline: a launcher that hangs fails the
test instead of the suite, and the teardown kills whatever is left (the ranks die with the launcher through
PR_SET_PDEATHSIG; any other process found is killed by pid).
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import clean_environ, die_with_test, run_module
from test_launch_local import finish, read_until, start

from hpc_ddp import exitcodes
from hpc_ddp.launch.local import Console

pytestmark = pytest.mark.slow

CHATTY = ("--task", "test_launch_local_faults:chatty", "--nodes", "1", "--epochs", "2")


def chatty(config):  # type: ignore[no-untyped-def]
    """A task (loaded by the ranks as `--task test_launch_local_faults:chatty`) whose every rank prints about
    40 KB per step, 640 KB per rank in 2 epochs: far more than a pipe holds (64 KiB), so a launcher that
    stops draining a rank's output stalls that rank, and its peers then wait in the gradient all-reduce."""
    import torch
    from slow_tasks import _data
    from torch import nn

    from hpc_ddp import Task

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i in range(40):
            print(f"chatter {i:03d} " + "x" * 1000)
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


def hang(config):  # type: ignore[no-untyped-def]
    """slow_tasks:hang, which says when it starts to hang: rank 1 sleeps in loss_fn on its 2nd step, and from
    then on no rank can reach an agreed step (its peers wait for it in the gradient all-reduce)."""
    from slow_tasks import _data
    from torch import nn

    from hpc_ddp import Task

    calls = [0]

    def loss_fn(output, target):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if os.environ.get("RANK") == "1" and calls[0] == 2:
            print("[rank 1] hanging in loss_fn", flush=True)  # on the console with --all-ranks (HANG)
            time.sleep(3600)
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(10, 1), dataset=_data(config.seed), loss_fn=loss_fn)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Launchers a test starts; any still running at teardown (a hang) is killed with its whole tree."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            proc.kill()
            proc.wait()
            for child in tree:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass


def descendants(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def assert_all_gone(children: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(children, timeout=5)
    running = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            pass
    assert not running, running


def assert_complete_logs(folder: Path, ranks: int) -> None:
    for rank in range(ranks):
        text = (folder / "logs" / f"rank{rank}.log").read_text()
        assert "Process group destroyed" in text, f"rank{rank}.log is incomplete"


# --- 1. A full disk under the logs -------------------------------------------------------------------------


@pytest.mark.deadline(90)
def test_unwritable_logs_are_reported_once_and_training_completes(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    # /dev/full fails every write with ENOSPC: the disk is full for these two logs only.
    (tmp_path / "logs").mkdir()
    for rank in (0, 1):
        (tmp_path / "logs" / f"rank{rank}.log").symlink_to("/dev/full")
    proc = start(tmp_path, *CHATTY)
    procs.append(proc)
    code, out = finish(proc, timeout=60)  # before the fix: both ranks stall on their full pipes
    assert code == 0, out[-3000:]
    assert (tmp_path / "model.pth").exists()
    for rank in (0, 1):
        notes = [
            line
            for line in out.splitlines()
            if line.startswith("[launcher]") and f"rank{rank}.log" in line and "cannot write" in line
        ]
        assert len(notes) == 1, out[-3000:]
        assert "No space left on device" in notes[0] and "dropped" in notes[0]
    assert "Exception in thread" not in out and "Traceback" not in out
    assert "Process group destroyed" in out  # the console still shows rank 0


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


needs_mount_ns = pytest.mark.skipif(not _unshare_works(), reason="needs root and `unshare --mount`")


def start_on_tmpfs(
    mount: Path, size: str, fill: bool, folder: Path, *args: str, **env: str
) -> subprocess.Popen[str]:
    """The local run, in a private mount namespace where `mount` is a small tmpfs (nothing leaks out: the
    mount goes away with the namespace when the launcher exits). With `fill`, the tmpfs is full from the start."""
    mount.mkdir(parents=True, exist_ok=True)
    script = (
        'mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 99; '
        '[ "$3" = 1 ] && dd if=/dev/zero of="$2/fill" bs=4k 2>/dev/null; shift 3; exec "$@"'
    )
    cmd = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        size,
        str(mount),
        "1" if fill else "0",
        sys.executable,
        "-m",
        "hpc_ddp.submit",
        "--local",
        "--folder",
        str(folder),
        *args,
    ]
    return subprocess.Popen(
        cmd,
        env=clean_environ(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )


@pytest.mark.deadline(90)
@needs_mount_ns
def test_a_really_full_log_disk_loses_logs_but_not_the_run(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    proc = start_on_tmpfs(tmp_path / "logs", "64k", True, tmp_path, *CHATTY)
    procs.append(proc)
    code, out = finish(proc, timeout=60)
    assert code == 0, out[-3000:]
    assert (tmp_path / "model.pth").exists()
    for rank in (0, 1):
        notes = [
            line
            for line in out.splitlines()
            if line.startswith("[launcher]")
            and f"rank{rank}.log" in line
            and "No space left on device" in line
        ]
        assert len(notes) == 1, out[-3000:]


@pytest.mark.deadline(90)
@needs_mount_ns
def test_a_full_run_folder_ends_the_run_with_an_error_not_a_hang(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    # Everything (logs, checkpoints, metrics) on 256 KiB that the chatter fills within the first epoch.
    folder = tmp_path / "run"
    # A full disk is waited out for the retry window: 3.1 s here (HPC_DDP_SAVE_BACKOFF_S=0.1), not 31 s.
    proc = start_on_tmpfs(
        folder, "256k", False, folder, *CHATTY, "--timeout-s", "30", HPC_DDP_SAVE_BACKOFF_S="0.1"
    )
    procs.append(proc)
    code, out = finish(proc, timeout=60)  # before the fix: hung for good, --timeout-s notwithstanding
    # A full disk is never a usage error (exit 2): a retry (--max-restarts) that finds the folder full at its
    # start waits for space, then fails (exit 1) with one line (issue 32, finding 10).
    assert code in (0, 1), out[-3000:]
    assert "No space left on device" in out and "not writable" not in out


# --- 2. A closed console ----------------------------------------------------------------------------------


@pytest.mark.deadline(90)
def test_a_closed_console_stalls_no_rank_and_the_run_completes(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    # `python -m hpc_ddp.submit --local ... | head -3`
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "--folder", str(tmp_path), *CHATTY]
    proc = subprocess.Popen(
        cmd,
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_test,
    )
    procs.append(proc)
    assert proc.stdout is not None and proc.stderr is not None
    head = [proc.stdout.readline() for _ in range(3)]
    assert head[0].startswith("[launcher] local job ")
    proc.stdout.close()
    try:
        proc.wait(timeout=60)  # before the fix: rank 0 stalls on its full pipe
    except subprocess.TimeoutExpired:
        pytest.fail("the launcher hung after its console was closed")
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert (tmp_path / "model.pth").exists()
    assert_complete_logs(tmp_path, 2)
    assert "BrokenPipeError" not in err and "Exception ignored" not in err and "Traceback" not in err, err


def test_a_console_whose_reader_is_gone_takes_lines_without_error() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` has exited
    stream = os.fdopen(write_end, "w")
    console = Console(stream)
    for i in range(1000):
        console.line(f"line {i}")
    console.drain(stall_s=5)
    assert console.gone
    stream.write("a later print\n")  # the fd now points at /dev/null: no BrokenPipeError, now or at exit
    stream.flush()
    stream.close()


def test_a_stalled_console_never_blocks_who_writes_to_it() -> None:
    read_end, write_end = os.pipe()  # nobody reads it yet: Ctrl-S on a terminal, `| less` nobody scrolls
    console = Console(os.fdopen(write_end, "w"))
    began = time.monotonic()
    # 40 MB: far beyond the pipe (64 KiB) and beyond twice the console's backlog (16 MiB), since the writer may
    # hold a whole backlog's batch in flight (taken before it blocked) while the queue fills up again.
    for i in range(40_000):
        console.line(f"{i:05d} " + "y" * 1000)
    assert time.monotonic() - began < 10
    began = time.monotonic()
    console.drain(stall_s=1)  # at exit: gives up on a console that takes nothing
    assert time.monotonic() - began < 5
    assert not console.gone
    seen = b""
    deadline = time.monotonic() + 30
    while b"fell behind" not in seen and time.monotonic() < deadline:  # the reader comes back
        if select.select([read_end], [], [], 1.0)[0]:  # never a blocking read: an empty pipe would hang here
            seen = seen[-200:] + os.read(read_end, 1 << 20)
    assert b"lines were not shown here" in seen
    os.close(read_end)


SLOW_3 = ["--task", "slow_tasks:slow", "--nodes", "1", "--epochs", "3"]


# --- 3. Ctrl-C and SIGTERM while a rank hangs in user code ------------------------------------------------

HANG = (
    "--task",
    "test_launch_local_faults:hang",
    "--nodes",
    "1",
    "--all-ranks",  # rank 1's "hanging in loss_fn" on the console: the console shows rank 0's lines only
)  # rank 1 sleeps 3600 s; default --timeout-s


def start_hung(tmp_path: Path, procs: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    proc = start(tmp_path, *HANG, *args)
    procs.append(proc)
    read_until(proc, "[rank 1] hanging in loss_fn", timeout=30)
    time.sleep(0.5)  # rank 1 is asleep (rank 0 waits for it in the all-reduce, or soon will)
    return proc


@pytest.mark.deadline(60)
def test_ctrl_c_twice_kills_a_hung_run_within_seconds(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    proc = start_hung(tmp_path, procs)
    children = descendants(proc)
    assert len(children) >= 2
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    code, out = finish(proc, timeout=30)
    assert time.monotonic() - began < 10, out
    assert code == 130, out
    assert "did not stop" in out and "rank 1" in out, out
    assert_all_gone(children)


@pytest.mark.deadline(60)
def test_one_ctrl_c_kills_a_hung_run_after_the_grace_period(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    proc = start_hung(tmp_path, procs, "--stop-grace-s", "3")
    children = descendants(proc)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    code, out = finish(proc, timeout=30)
    assert time.monotonic() - began < 3 + 7, out
    assert code == 130, out
    assert "did not stop" in out and "rank 1" in out, out
    assert_all_gone(children)


@pytest.mark.deadline(60)
def test_sigterm_kills_a_hung_run_after_the_grace_period(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    proc = start_hung(tmp_path, procs, "--stop-grace-s", "3")
    children = descendants(proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # a second SIGTERM is passed on, but does not cut the grace short
    began = time.monotonic()
    code, out = finish(proc, timeout=30)
    elapsed = time.monotonic() - began
    assert 2 < elapsed < 3 + 7, out
    assert code == 128 + signal.SIGTERM, out
    assert "did not stop" in out, out
    assert_all_gone(children)


@pytest.mark.deadline(120)
def test_one_ctrl_c_on_a_healthy_run_saves_and_exits_75_and_says_the_command_that_resumes(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    proc = start(
        tmp_path, "--task", "slow_tasks:slow", "--nodes", "1", "--epochs", "3", SLOW_TASK_SLEEP_S="0.15"
    )
    procs.append(proc)
    head = read_until(proc, "Epoch 0,")
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert code == exitcodes.PREEMPTED, out
    assert "1 node x 2 processes" in head[0], head  # the launcher's first line (before: "1 nodes")
    # The rank got SIGTERM and says so in its log; the console says what the user did (issue 21).
    assert "interrupted (Ctrl-C): checkpoint saved, not requeued" in out, out
    assert "SIGTERM" not in out, out
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "stopped by SIGTERM: checkpoint saved, not requeued" in log
    assert "did not stop" not in out
    # The advice is the exact command that resumes: run as said, it resumes where the stop saved.
    lines = out.splitlines()
    said = next(
        line for line in lines if line.startswith("[launcher] interrupted (Ctrl-C): every rank saved")
    )
    command = shlex.split(said.split("; to resume, run: ")[1])
    assert command[1:] == ["-m", "hpc_ddp.submit", "--local", "--folder", str(tmp_path), *SLOW_3], said
    again = subprocess.run(
        command,
        env=clean_environ(SLOW_TASK_SLEEP_S="0.15"),
        capture_output=True,
        text=True,
        timeout=90,
        preexec_fn=die_with_test,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Resuming from {tmp_path / 'checkpoints'}" in again.stdout, again.stdout


@pytest.mark.deadline(120)
def test_a_terminal_that_closes_saves_and_stops_the_run(tmp_path: Path) -> None:
    """An ssh session that drops: the launcher's terminal hangs up (SIGHUP to it, the controlling process). The
    ranks, in their own sessions, would die with the launcher and lose their work; they save and stop instead."""
    master, slave = pty.openpty()

    def on_the_terminal() -> None:  # after start_new_session's setsid: the terminal becomes the session's
        die_with_test()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    cmd = [
        sys.executable,
        "-m",
        "hpc_ddp.submit",
        "--local",
        "--folder",
        str(tmp_path),
        "--task",
        "slow_tasks:slow",
        "--nodes",
        "1",
        "--epochs",
        "100",
    ]
    proc = subprocess.Popen(
        cmd,
        env=clean_environ(SLOW_TASK_SLEEP_S="0.05"),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=on_the_terminal,
    )
    os.close(slave)
    try:
        shown = b""
        deadline = time.monotonic() + 60
        while b"Epoch 0," not in shown and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                shown += os.read(master, 65536)
        assert b"Epoch 0," in shown, shown
        children = descendants(proc)
        os.close(master)  # the terminal hangs up; the launcher's later writes to it fail, which it survives
        master = -1
        code = proc.wait(timeout=60)
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert code == exitcodes.PREEMPTED, log
    assert "stopped by SIGTERM: checkpoint saved, not requeued" in log, log
    assert list((tmp_path / "checkpoints").glob("*")), "no checkpoint saved"
    assert_all_gone(children)


def test_stop_grace_must_be_a_number_of_seconds(tmp_path: Path) -> None:
    for bad in ("-1", "nan"):
        out = run_module(
            "hpc_ddp.submit", "--local", "--folder", str(tmp_path), "--stop-grace-s", bad, timeout=60
        )
        assert out.returncode == exitcodes.USAGE, out.stderr
        assert "--stop-grace-s" in out.stderr and "0 or more seconds" in out.stderr
