"""Which Pythons can deadlock a forked DataLoader worker at its start (CPython gh-112275), and the line a rank
with workers says at start there (hpc_ddp.run.data.forkrisk)."""

from __future__ import annotations

import pytest

from hpc_ddp.run.data import forkrisk


@pytest.mark.parametrize(
    "version, implementation, risky",
    [
        ((3, 11, 7), "cpython", True),  # this machine's
        ((3, 11, 9), "cpython", True),
        ((3, 11, 10), "cpython", False),
        ((3, 10, 14), "cpython", True),
        ((3, 10, 15), "cpython", False),
        ((3, 9, 20), "cpython", False),
        ((3, 12, 0), "cpython", False),
        ((3, 13, 1), "cpython", False),
        ((3, 11, 7), "pypy", False),
    ],
)
def test_which_pythons_are_at_risk(version: tuple[int, int, int], implementation: str, risky: bool) -> None:
    assert forkrisk.at_risk(version, implementation) is risky


def test_the_line_names_the_python_the_bug_and_the_fixes_only_with_workers() -> None:
    line = forkrisk.note((3, 11, 7), 2)
    assert line is not None
    assert line.startswith(
        "Python 3.11.7 can deadlock a forked DataLoader worker at its start (CPython gh-112275)"
    )
    assert "Fix: Python 3.11.10 or 3.12, or --num-workers 0" in line
    assert forkrisk.note((3, 11, 7), 0) is None  # no worker is forked
    assert forkrisk.note((3, 12, 3), 2) is None
