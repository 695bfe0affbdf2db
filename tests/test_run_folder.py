"""The run folder: its default locations, the writability check, atomic writes and the preemption record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import preemption as preemption_record
from hpc_ddp.run import folder as run_folder


def test_each_launch_path_has_its_default_folder() -> None:
    assert run_folder.default_for_task("4242") == Path("runs/4242")
    assert run_folder.default_for_task(None) == Path(f"runs/single-{os.getpid()}")
    # A local run's folder is its task's, the same for the same command (issue 21: a rerun resumes).
    assert run_folder.default_for_local_run("linear") == Path("runs/linear")
    assert run_folder.default_for_local_run("mytasks:build") == Path("runs/mytasks-build")
    assert run_folder.default_for_local_run("pkg.sub:make model") == Path("runs/pkg.sub-make-model")
    assert run_folder.default_for_local_check("123") == Path("runs/doctor-123")
    # A Slurm job's is its job name's and task's, the same for the same command (issue 33 item 6).
    assert (
        run_folder.default_for_submission("hpc_ddp", "mytasks:build")
        == Path("runs/hpc_ddp-mytasks-build").absolute()
    )
    stamp = time.mktime((2024, 5, 6, 7, 8, 9, 0, 0, -1))
    assert (
        run_folder.default_for_submitted_check("golden", stamp)
        == Path("runs/doctor-golden-20240506-070809").absolute()
    )


def test_prepare_creates_the_folder_and_leaves_nothing_in_it(tmp_path: Path) -> None:
    run_folder.prepare(tmp_path / "a" / "run")
    assert list((tmp_path / "a" / "run").iterdir()) == []


def test_prepare_refuses_a_path_under_a_file_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(
        UsageError, match=r"run folder .*/file/run is not writable \(Not a directory\)\. Fix: --folder"
    ):
        run_folder.prepare(tmp_path / "file" / "run")
    assert run_folder.write_test(tmp_path / "file", "probe") == "Not a directory"


def test_a_private_folder_is_owner_only(tmp_path: Path) -> None:
    run_folder.prepare(tmp_path / "private", private=True)
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o700


def test_atomic_write_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    run_folder.atomic_write_bytes(path, b"old")
    run_folder.atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_the_preemption_record_keeps_the_text_ddp_sbatch_greps_for(tmp_path: Path) -> None:
    assert preemption_record.read(tmp_path) is None
    record = preemption_record.Preempted(
        requeue=True, signal="SIGUSR2", mode="exit", step=40, requeue_votes=2, stop_votes=0
    )
    since = time.time() - 1
    preemption_record.write(tmp_path, record)
    text = (tmp_path / "preempted.json").read_text()
    assert '"requeue": true' in text and '"mode": "exit"' in text
    # The facts rank 0 writes (issue 18: the supervisor decides from them): votes, signal, step.
    assert json.loads(text) == {
        "requeue": True,
        "signal": "SIGUSR2",
        "mode": "exit",
        "step": 40,
        "requeue_votes": 2,
        "stop_votes": 0,
        "requeued": None,
    }
    assert preemption_record.read(tmp_path) == record
    assert preemption_record.since(tmp_path, since) and not preemption_record.since(
        tmp_path, time.time() + 60
    )
    assert preemption_record.read_since(tmp_path, since) == record
    assert preemption_record.read_since(tmp_path, time.time() + 60) is None
    preemption_record.clear(tmp_path)
    assert preemption_record.read(tmp_path) is None and not preemption_record.since(tmp_path, 0)
    # A record of an older kit (no facts beyond the decision) still reads.
    (tmp_path / "preempted.json").write_text('{"requeue": false, "signal": "SIGTERM", "mode": "exit"}')
    assert preemption_record.read(tmp_path) == preemption_record.Preempted(False, "SIGTERM", "exit")


def test_an_unreadable_preemption_record_restarts_nothing(tmp_path: Path) -> None:
    (tmp_path / "preempted.json").write_text("{not json")
    assert preemption_record.read(tmp_path) is None
    (tmp_path / "preempted.json").write_text("{}")
    assert preemption_record.read(tmp_path) is None


def test_a_folder_held_by_a_local_launcher_suggests_no_scancel(tmp_path: Path) -> None:
    """A local job's id is made up: `scancel <it>` would cancel nothing, or someone else's job."""
    holder = {"token": "t", "role": "launcher", "job_id": "4242", "restarts": 0, "host": "far", "pid": 1}
    (tmp_path / "run.lock").write_text(json.dumps({**holder, "boot_id": "other", "since": time.time()}))
    with pytest.raises(UsageError) as refused:
        run_folder.hold_folder(tmp_path, "rank0", "88", 0)
    assert "the local launcher of job 4242" in str(refused.value)
    assert "scancel" not in str(refused.value) and "Ctrl-C its launcher, or kill 1)" in str(refused.value)
