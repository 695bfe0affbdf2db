"""The report on the folders a real life leaves: one it may not write, one whose line of training was started
over, a very long run, records that end between two progress records, and garbage (issue 22, items 8-12, and
the report parts of issue 21 item 5). The numbers of an ordinary run are test_report.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_module
from test_report import write_fixture

from hpc_ddp.run.folder import hold_folder, is_held


def untouched(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry of `folder` (itself included) with its mtime, after setting them all to a second long ago:
    a file created, written or removed in it (even one removed again at once) shows as a change."""
    entries = [folder, *sorted(folder.rglob("*"))]
    for path in entries:
        os.utime(path, ns=(1_000_000_000, 1_000_000_000), follow_symlinks=False)
    return listing(folder)


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in [folder, *sorted(folder.rglob("*"))]
    }


# ----- 22.8: reading a run never writes into it --------------------------------------------------------------


def test_looking_at_the_lock_writes_nothing_into_the_folder(tmp_path: Path) -> None:
    """is_held on a folder with no run.lock, and on one a live run holds: the folder is as it was (the probe
    file that measured the lock's age by the file system's clock was created and removed in it)."""
    folder = write_fixture(tmp_path / "run")
    before = untouched(folder)
    assert not is_held(folder)
    assert listing(folder) == before
    lock = hold_folder(folder, "launcher", None, 0)
    try:
        before = untouched(folder)
        assert is_held(folder)
        assert listing(folder) == before
    finally:
        lock.release()


def test_the_report_with_out_elsewhere_writes_nothing_into_the_run_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = write_fixture(tmp_path / "run")
    (tmp_path / "web").mkdir()
    before = untouched(folder)
    proc = run_module("hpc_ddp.report", str(folder), "--out", str(tmp_path / "web" / "r.html"), "--no-sacct")
    assert proc.returncode == 0, proc.stderr
    assert listing(folder) == before
    assert (tmp_path / "web" / "r.html").is_file()
