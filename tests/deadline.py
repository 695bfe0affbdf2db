"""A deadline for every test that holds even when the test is stuck in native code with the GIL held.

Each test's setup + call + teardown runs under faulthandler's watchdog: a C thread that needs neither the GIL
nor the interpreter's main loop (pytest-timeout's signal and thread methods need both). When the deadline
passes it writes "Timeout (H:MM:SS)!" and every thread's Python stack, then calls _exit(1): the run stops
right there, non-zero. The children the tests start die with the run (conftest.die_with_test).

The dump goes to the terminal's stderr through a relay process (tests/deadline_relay.py), because the dump
alone may not name the test (the stuck frame is often not the test's own): before each test pytest sends the
relay a line naming it, and the relay prints that line only when dump bytes follow it, so a run prints
"[deadline] tests/x.py::test_y: passed its 120 s deadline; ..." right above the stacks, and nothing while
deadlines hold. The relay ends with pytest on every path, killed included.

  [tool.pytest.ini_options] deadline_s = 60     every test's default; 0 turns all deadlines off (debugging)
  @pytest.mark.deadline(300)                    one test's (or, in `pytestmark`, one file's) own deadline
  pytest -o deadline_s=0                        no deadlines, e.g. under a debugger

Loaded by tests/conftest.py (`pytest_plugins`), or by `pytest -p deadline` with tests/ on sys.path.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

RELAY = Path(__file__).resolve().with_name("deadline_relay.py")
HEADER_MAX = 4000  # one write() under PIPE_BUF (4096 on Linux) is atomic: a header never arrives in pieces


class _Channel:
    """The write end of the pipe to the relay, and the relay process."""

    def __init__(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            # pytest's own fd capture is suspended while plugins are configured, so fd 2 is the real stderr
            # here (during a test it points at a capture file that dies with the process): the relay's.
            self.relay = subprocess.Popen(
                [sys.executable, "-I", "-S", str(RELAY), str(os.getpid())], stdin=read_fd, close_fds=True
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.pipe: IO[bytes] = open(write_fd, "wb", buffering=0)  # faulthandler writes to its fd

    def header(self, line: str) -> None:
        try:
            os.write(self.pipe.fileno(), b"\0" + line.encode()[:HEADER_MAX] + b"\n")
        except BrokenPipeError:  # someone killed the relay: a deadline still stops the run, without stacks
            pass

    def close(self) -> None:
        try:
            os.write(self.pipe.fileno(), b"\0\n")  # the end frame: a forked child may hold the pipe open
        except OSError:  # the relay is gone already
            pass
        self.pipe.close()
        try:
            self.relay.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.relay.kill()
            self.relay.wait()


_channel: _Channel | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "deadline_s",
        "seconds a test (setup + call + teardown) may take before every thread's "
        "stack is dumped and the run exits 1; @pytest.mark.deadline(s) overrides it; 0: no deadlines",
        default="60",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _channel
    if float(config.getini("faulthandler_timeout") or 0) > 0:  # one faulthandler timer per process
        raise pytest.UsageError("faulthandler_timeout would cancel the per-test deadlines: use deadline_s")
    if float(config.getini("deadline_s")) > 0:
        _channel = _Channel()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _channel
    faulthandler.cancel_dump_traceback_later()
    if _channel is not None:
        _channel.close()
        _channel = None


def deadline_s(item: pytest.Item) -> float:
    """The test's deadline in seconds (0: none): its closest `deadline` marker, else the ini's `deadline_s`."""
    default = float(item.config.getini("deadline_s"))
    if default <= 0:
        return 0.0
    marker = item.get_closest_marker("deadline")
    if marker is None:
        return default
    if len(marker.args) != 1 or marker.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.deadline(seconds)")
    return float(marker.args[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    seconds = deadline_s(item)
    if seconds <= 0 or _channel is None:
        yield
        return
    _channel.header(
        f"[deadline] {item.nodeid}: passed its {seconds:g} s deadline; "
        "every thread's stack follows, then the run exits 1"
    )
    faulthandler.dump_traceback_later(seconds, exit=True, file=_channel.pipe)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
