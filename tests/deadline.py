"""A deadline for every test that holds even when the test is stuck in native code with the GIL held.

Each test's setup + call + teardown runs under faulthandler's watchdog: a C thread that needs neither the GIL
nor the interpreter's main loop (pytest-timeout's signal and thread methods need both). When the deadline
passes it writes "Timeout (H:MM:SS)!" and every thread's Python stack to the terminal's stderr, then calls
_exit(1): the run stops right there, non-zero. Just before arming, a line names the test and its deadline
("[deadline] tests/x.py::test_y: 120 s") so the dump can be attributed even when the stuck frame is not the
test's own. The children the tests start die with the run (conftest.die_with_test).

  [tool.pytest.ini_options] deadline_s = 60     every test's default; 0 turns all deadlines off (debugging)
  @pytest.mark.deadline(300)                    one test's (or, in `pytestmark`, one file's) own deadline
  pytest -o deadline_s=0                        no deadlines, e.g. under a debugger

Loaded by tests/conftest.py (`pytest_plugins`), or by `pytest -p deadline` with tests/ on sys.path.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Generator
from typing import IO

import pytest

_stderr: IO[str] | None = None  # a duplicate of the terminal's stderr, immune to pytest's fd capturing


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "deadline_s",
        "seconds a test (setup + call + teardown) may take before every thread's "
        "stack is dumped and the run exits 1; @pytest.mark.deadline(s) overrides it; 0: no deadlines",
        default="60",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    if float(config.getini("faulthandler_timeout") or 0) > 0:  # one faulthandler timer per process
        raise pytest.UsageError("faulthandler_timeout would cancel the per-test deadlines: use deadline_s")
    # pytest's own fd capture is suspended while plugins are configured, so fd 2 is the real stderr here;
    # during a test it points at a capture file that dies with the process.
    _stderr = os.fdopen(os.dup(2), "w", buffering=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _stderr
    faulthandler.cancel_dump_traceback_later()
    if _stderr is not None:
        _stderr.close()
        _stderr = None


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
    if seconds <= 0 or _stderr is None:
        yield
        return
    _stderr.write(f"[deadline] {item.nodeid}: {seconds:g} s\n")
    _stderr.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
