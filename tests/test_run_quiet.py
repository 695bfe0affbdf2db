"""What a rank prints that is not its own (hpc_ddp.run.quiet, issue 37 item 4): a warning is one line, never a
scrap of source under it; torch's DataLoader worker warning, which the kit answers in its own words, is left
out."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from conftest import ROOT, clean_environ

from hpc_ddp.run import quiet

TORCH = "/opt/venv/lib/python3.11/site-packages/torch/distributed/tensor/_dispatch.py"
WORKERS = (
    "This DataLoader will create 2 worker processes in total. Our suggested max number of worker in current "
    "system is 1, which is smaller than what this DataLoader is going to create."
)


def test_a_warning_is_one_line_with_the_path_inside_its_package() -> None:
    line = quiet.one_line(
        UserWarning("Found a non-scalar tensor with numel=1\nand ndim!=0"), UserWarning, TORCH, 701
    )
    assert line == (
        "torch/distributed/tensor/_dispatch.py:701: UserWarning: Found a non-scalar tensor with numel=1 and ndim!=0\n"
    )
    # Python's own format adds the source line under it: the scrap the console showed.
    assert warnings.formatwarning("x", UserWarning, __file__, 1).count("\n") == 2
    assert (
        quiet.one_line("x", DeprecationWarning, "/home/me/mytask.py", 3)
        == "/home/me/mytask.py:3: DeprecationWarning: x\n"
    )


@pytest.mark.process
def test_installed_warnings_print_one_line_and_leave_out_the_worker_count_warning() -> None:
    """In a process of its own: pytest records warnings itself, which would hide what a rank prints."""
    script = (
        "import warnings\n"
        "from hpc_ddp.run import quiet\n"
        "quiet.install()\n"
        f"warnings.warn_explicit({WORKERS!r}, UserWarning, {TORCH!r}, 431)\n"
        'warnings.warn("a user\'s own warning", UserWarning)\n'
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert "suggested max number of worker" not in proc.stderr
    assert proc.stderr == "<string>:5: UserWarning: a user's own warning\n", proc.stderr
