"""Process control for the local launcher: start a rank with its signals held and tied to the launcher's life,
signal it (alone or with everything it started), stop and kill ranks within a deadline.

A signal never kills a rank that is still starting: training ranks start with SIGUSR1/SIGUSR2/SIGTERM blocked
(inherited through exec) until `preemption.install()` has set their handlers, so a signal that comes meanwhile
waits in the kernel. Ranks live in their own session (a terminal's Ctrl-C reaches only the launcher, which
forwards it) and die with the launcher even if it is SIGKILLed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

GRACE_S = 3.0  # after a failure, survivors get SIGTERM, then SIGKILL after this long
KILL_WAIT_S = 5.0  # how long a SIGKILLed rank may take to disappear before the launcher says so and goes on

# Signals that stop the run (save at the next agreed step, no restart), and what the ranks get for them. Ctrl-C
# and a closed terminal (SIGHUP: an ssh session that drops) become SIGTERM for the ranks, the same "save and
# stop" path as scancel; the ranks, in their own sessions, never see the terminal's signals themselves.
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FOR_RANKS = {signal.SIGINT: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}
HELD = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)  # blocked in a training rank until it handles them
HOLDS_SIGNALS = ("hpc_ddp.train",)  # modules that unblock them first thing (preemption.install)

# Looked up once, here: the launcher has threads (readers, console) when it forks a rank, and a dlopen/dlsym
# between fork and exec can deadlock on a loader lock one of them held at the fork.
prctl = ctypes.CDLL(None, use_errno=True).prctl
PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 36


def die_with_parent(parent: int, hold: bool = False) -> None:
    """preexec_fn: runs in the child between fork and exec (and in a rank forked by launch/local/forkserver, once
    the launcher is its parent). SIGKILL it when the launcher dies, however it dies;
    with `hold`, block HELD (the mask survives exec: pending until preemption.install() has set handlers)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, HELD)


def start(cmd: list[str], env: dict[str, str], hold: bool) -> subprocess.Popen[bytes]:
    """Start one rank: output (stdout and stderr) through a pipe, no stdin, its own session, tied to us."""
    parent = os.getpid()
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(parent, hold),
    )


def send(proc: subprocess.Popen[bytes], sig: int, group: bool = False) -> None:
    """Signal a rank (with `group`, its whole process group: its DataLoader workers and anything it started).

    Only while the launcher has not reaped it: until then its pid, and so its process-group id, cannot belong
    to anyone else. Only the main thread reaps (poll/wait), and the signal handler does not, so nothing reaps
    between this check and the kill."""
    if proc.returncode is not None:
        return
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def alive(procs: Sequence[subprocess.Popen[bytes]]) -> list[subprocess.Popen[bytes]]:
    return [p for p in procs if p.poll() is None]


def wait_gone(
    procs: Sequence[subprocess.Popen[bytes]], seconds: float, give_up: Callable[[], bool] = lambda: False
) -> list[subprocess.Popen[bytes]]:
    """Wait up to `seconds` (less once `give_up()` says so) for `procs` to exit; returns the living."""
    deadline = time.monotonic() + seconds
    living = alive(procs)
    while living and time.monotonic() < deadline and not give_up():
        time.sleep(0.05)
        living = alive(living)
    return living


def kill(procs: Sequence[subprocess.Popen[bytes]]) -> list[subprocess.Popen[bytes]]:
    """SIGKILL `procs` with their process groups; returns those still there after KILL_WAIT_S (stuck in the
    kernel, on a dead file system or device)."""
    for p in procs:
        send(p, signal.SIGKILL, group=True)
    return wait_gone(procs, KILL_WAIT_S)


def stop(
    procs: Sequence[subprocess.Popen[bytes]], give_up: Callable[[], bool] = lambda: False
) -> list[subprocess.Popen[bytes]]:
    """SIGTERM the living, then SIGKILL whoever is still there after GRACE_S (or once `give_up()`); returns
    those that outlived even SIGKILL."""
    living = alive(procs)
    for p in living:
        send(p, signal.SIGTERM)
    living = wait_gone(living, GRACE_S, give_up)
    return kill(living) if living else []
