"""A real full disk (issue 32, finding 10 and build item 5): every write survives ENOSPC for the retry window, a
restart while the disk is still full waits and retries, and a full disk is never a usage error.

The disk is really full: the run folder is a small tmpfs in a private mount namespace (it goes away with the
namespace), which the task fills at a chosen step (tests/robust_tasks.py:full_for_a_while) and a shell beside
the launcher frees once the run's output shows the case under test. HPC_DDP_SAVE_BACKOFF_S=0.2 makes the window
6.2 s."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp.errors import DiskFull, UsageError
from hpc_ddp.ledger import exits, files
from hpc_ddp.run.sinks.jsonl import JsonLines


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


needs_mount_ns = pytest.mark.skipif(not _unshare_works(), reason="needs root and `unshare --mount`")

# Mount a tmpfs of $2 at $1 (the harness fills it at once when $3 is 1); once "$1/run/filler" exists (the task's)
# and the run's output (in $5) holds the text $4, free the disk 1 s later; copy the run folder out to $6 before
# the namespace goes. The freer never outlives the run.
HARNESS = """
mount -t tmpfs -o "size=$2" tmpfs "$1" || exit 99
mkdir -p "$1/run"
if [ "$3" = 1 ]; then dd if=/dev/zero of="$1/run/filler" bs=64k 2>/dev/null; fi
(
    while [ ! -e "$1/run/filler" ] || ! grep -q -- "$4" "$5"; do sleep 0.05; done
    sleep 1
    rm -f "$1/run/filler"
) >/dev/null 2>&1 &
freer=$!
mount=$1; log=$5; out=$6
shift 6
"$@" >"$log" 2>&1; code=$?
kill "$freer" 2>/dev/null
cp -r "$mount/run" "$out" 2>/dev/null
exit $code
"""


def on_tmpfs(
    tmp_path: Path, free_after: str, *args: str, fill: bool = False, **env: str
) -> tuple[int, str, Path]:
    """A local run in a run folder on a 64 MB tmpfs, full from when the task (or, with `fill`, the harness)
    fills it until a second after its output says `free_after`; its exit code, output, a copy of its folder."""
    mount, copy, log = tmp_path / "mnt", tmp_path / "copy", tmp_path / "out.log"
    mount.mkdir()
    log.touch()
    cmd = [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", HARNESS, "sh", str(mount), "64m",
        "1" if fill else "0", free_after, str(log), str(copy),
        sys.executable, "-m", "hpc_ddp.submit", "--local", "--folder", str(mount / "run"), *args,
    ]  # fmt: skip
    environ = clean_environ(**{"HPC_DDP_SAVE_BACKOFF_S": "0.2", "ROBUST_SLEEP_S": "0.05", **env})
    proc = subprocess.run(
        cmd, env=environ, capture_output=True, text=True, timeout=150, preexec_fn=die_with_test
    )
    return proc.returncode, log.read_text() + proc.stdout + proc.stderr, copy


def steps(folder: Path) -> list[int]:
    """The steps metrics.jsonl records, read as the kit reads it: a line a killed writer left cut (a write the full
    disk took part of) is skipped."""
    from hpc_ddp.run.records.metrics_read import read_records

    return [r["step"] for r in read_records(folder / "metrics.jsonl") if r["event"] == "step"]


TASK = ("--task", "robust_tasks:full_for_a_while", "--nodes", "1", "--epochs", "3", "--save-every-steps", "5")


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(150)
@needs_mount_ns
def test_a_disk_full_for_seconds_loses_nothing_and_the_run_goes_on(tmp_path: Path) -> None:
    # fsdp: every rank's writer meets the full disk (sharded checkpoints); 24 steps, full from step 10 for 5 s.
    # Freed once the first checkpoint write failed: a save and metrics records meet the full disk.
    code, out, run = on_tmpfs(
        tmp_path, "a checkpoint could not be written", *TASK, "--strategy", "fsdp", FULL_AT="10"
    )
    assert code == 0, out  # before the fix: rank 0 died on metrics.jsonl (OSError) and the run restarted
    assert "the disk is full from step 10" in out
    assert "metrics.jsonl: cannot write (No space left on device); its records are held in memory" in out
    assert "no record was lost" in out
    assert steps(run) == list(range(1, 25))  # every step once: nothing lost, nothing trained again
    assert "Traceback" not in out and "restarting" not in out and "exited with code" not in out
    assert (run / "model.pth").is_file()


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(150)
@needs_mount_ns
def test_a_restart_on_a_disk_still_full_waits_for_space_instead_of_a_usage_error(tmp_path: Path) -> None:
    # Rank 1 crashes at step 12, two steps after the disk filled: the restart comes while it is still full.
    # Freed once the restart's rank 0 said it waits for space.
    code, out, run = on_tmpfs(tmp_path, "cannot write run folder", *TASK, FULL_AT="10", CRASH_AT="12")
    assert code == 0, out  # before the fix: "run folder ... is not writable", exit 2, never retried
    # The crash is named, though the disk was full when rank 1 wrote its exit note (before the fix the note was
    # lost: "the job step ended with exit code 1").
    crash = "RuntimeError: a crash at step 12 while the disk is full (tests/robust_tasks.py)"
    assert re.search(
        rf"attempt 1 failed on node 0 \S+: {re.escape(crash)}; restarting from the checkpoint", out
    )
    assert "cannot write run folder" in out and "retrying for up to 6.2 s until there is space" in out
    assert "not writable" not in out
    assert sorted(set(steps(run))) == list(range(1, 25))
    assert (run / "model.pth").is_file()


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(90)
@needs_mount_ns
def test_a_disk_still_full_after_the_window_is_a_failure_of_one_line_not_a_usage_error(
    tmp_path: Path,
) -> None:
    code, out, _ = on_tmpfs(tmp_path, "never", *TASK, fill=True, HPC_DDP_SAVE_BACKOFF_S="0.1")
    assert code == 1, out
    assert "cannot be written: No space left on device, still after waiting 3.1 s for space" in out, out
    assert "Fix: free space (or quota) there, then run the same command" in out
    assert "Traceback" not in out and "not writable" not in out


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(120)
@needs_mount_ns
def test_a_disk_full_for_good_stops_the_run_naming_its_cause_and_never_retries(tmp_path: Path) -> None:
    # Full from step 6 to the end: the checkpoint writer (rank 0's, ddp) gives up; every rank stops, rank 0 on
    # SavingFailed, rank 1 on its consequence. The exit notes go to space set aside at start.
    code, out, run = on_tmpfs(
        tmp_path, "never", *TASK[:-4], "--epochs", "2", "--save-every-steps", "5", FULL_AT="6",
        HPC_DDP_SAVE_BACKOFF_S="0.1",
    )  # fmt: skip
    assert code == 1, out
    # Before the fix the notes were lost: "the job step ended with exit code 1; restarting from the checkpoint"
    # (a SavingFailed retried, on a disk still full), naming whichever rank the launcher saw end first.
    assert "attempt 1 failed on node 0 (127.0.0.1): SavingFailed: checkpoints cannot be written" in out, out
    assert "not retried: the run stopped itself" in out and "restarting" not in out
    assert "rank 0 failed first, with the one-line error above" in out
    (attempt,) = (run / "exits").iterdir()
    job, restart = attempt.name.rsplit("-", 1)
    notes = {n["rank"]: n for n in exits.read(run, job, int(restart))}
    assert notes[0]["type"] == "SavingFailed" and notes[0]["retry"] is False
    assert set(notes) == {0, 1}  # notes, not placeholders
    # both written in the space their node set aside at start: one file for the node's ranks (docs/scale.md)
    assert [p.name for p in attempt.iterdir()] == ["node0.space"]


# ----- the rules, as unit tables ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def failing(times: int, code: int = errno.ENOSPC) -> object:
    calls = [0]

    def write() -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise OSError(code, os.strerror(code), "/x")
        return f"written at call {calls[0]}"

    return write


def test_patiently_waits_out_a_full_disk_for_the_window_and_no_other_error() -> None:
    clock, said = Clock(), []
    assert files.patiently(failing(5), "x", said.append, 31, clock, clock.sleep) == "written at call 6"
    assert said == ["cannot write x (No space left on device); retrying for up to 31 s until there is space"]
    clock = Clock()
    assert files.patiently(failing(3, errno.EDQUOT), "x", None, 31, clock, clock.sleep) == "written at call 4"
    with pytest.raises(OSError, match="Permission denied"):
        files.patiently(failing(1, errno.EACCES), "x", None, 31, clock, clock.sleep)
    clock = Clock()
    with pytest.raises(OSError, match="No space left on device"):
        files.patiently(failing(10**6), "x", None, 31, clock, clock.sleep)
    assert 31 <= clock.now < 33  # the whole window, not one retry more


def test_an_exit_note_takes_the_space_set_aside_for_it_when_the_disk_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits.reserve(tmp_path, "7", 0, 1)
    placeholder = tmp_path / "exits" / "7-0" / "rank1.json"
    assert placeholder.stat().st_size == exits.NOTE_BYTES and exits.read(tmp_path, "7", 0) == []  # no note
    try:
        raise ValueError("é" * 5000)  # escaped in JSON, six bytes a letter: longer than the space set aside
    except ValueError as e:
        error = e

    def full(*_args: object) -> None:  # what a full disk does to a new file (the real one: the tests above)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exits, "atomic_write_bytes", full)
    exits.note(tmp_path, "7", 0, 1, "node3", error)
    (note,) = exits.read(tmp_path, "7", 0)
    assert (note["rank"], note["node"], note["type"]) == (1, "node3", "ValueError")
    assert note["traceback"].startswith("...") and note["traceback"].endswith("é")  # its end kept
    assert placeholder.stat().st_size == exits.NOTE_BYTES  # written in place, blanks after it
    exits.release(tmp_path, "7", 0, 1)  # a note stays
    assert exits.read(tmp_path, "7", 0) == [note]
    monkeypatch.undo()
    exits.reserve(tmp_path, "7", 1, 0)
    exits.release(tmp_path, "7", 1, 0)  # an attempt that left no note leaves nothing
    assert not (tmp_path / "exits" / "7-1").exists()
    exits.note(tmp_path / "gone", "7", 0, 0, "node3", error)  # nothing set aside, no folder: no error either


def test_metrics_records_are_held_on_a_full_disk_and_written_in_order_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpc_ddp.run.sinks import jsonl

    monkeypatch.setattr(jsonl, "STEP_EVERY_S", 0.0)  # every step record written at once, as a long step's is
    said: list[str] = []
    sink = JsonLines(tmp_path / "metrics.jsonl", said.append)
    sink.record({"event": "step", "step": 1})
    real = sink.file
    assert real is not None

    class Full:  # the file as a full disk leaves it: every write fails (a unit table of the rule)
        def write(self, _data: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    sink.file = Full()  # type: ignore[assignment]
    sink.record({"event": "step", "step": 2})
    sink.record({"event": "step", "step": 3})
    assert said[-1].endswith(
        "cannot write (No space left on device); its records are held in memory and "
        "written once there is space. Training goes on"
    )
    sink.file = real
    sink.record({"event": "step", "step": 4})
    assert "no record was lost" in said[-1]
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    other = JsonLines(tmp_path / "m2.jsonl")
    other.record({"event": "step", "step": 1})

    class Broken:
        def write(self, _data: object) -> int:
            raise OSError(errno.EIO, "Input/output error")

    other.file = Broken()  # type: ignore[assignment]
    with pytest.raises(OSError, match="Input/output error"):  # anything else than a full disk: as before
        other.record({"event": "step", "step": 2})
    assert not issubclass(DiskFull, UsageError)  # exit 1, its one line: never a usage error (exit 2)


# TensorBoard's writer on a full disk: its writer thread dies on the failed write; the board keeps the values since
# its last flush and writes them to a new event file once there is space (each step once).
BOARD = """
import sys, time
from pathlib import Path
from robust_tasks import fill_disk
from hpc_ddp.run.records import tblog

folder = Path(sys.argv[1])
tblog.FLUSH_S = 0  # the board flushes at every step: what it holds is at most one step's values
board = tblog.Board(folder)
for step in range(1, 4):
    board.scalars(step, {"train/loss": float(step)})
filler = fill_disk(str(folder))
for step in range(4, 204):  # written on a full disk (past its last page): its writer thread fails
    board.scalars(step, {"train/loss": float(step)})
Path(filler).unlink()
time.sleep(1.1)  # the board tries a new event file once a second
for step in range(204, 211):
    board.scalars(step, {"train/loss": float(step)})
board.close()
print("files", len(board.own))
"""


@pytest.mark.process
@pytest.mark.deadline(60)
@needs_mount_ns
def test_tensorboard_on_a_full_disk_writes_every_step_once_when_there_is_space(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    mount = tmp_path / "mnt"
    mount.mkdir()
    script = 'mount -t tmpfs -o size=4m tmpfs "$1" || exit 99; "$2" -c "$3" "$1"; code=$?; cp -r "$1/tb" "$4"; exit $code'
    cmd = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(mount),
        sys.executable,
        BOARD,
        str(tmp_path / "tb"),
    ]
    proc = subprocess.run(
        cmd, env=clean_environ(), capture_output=True, text=True, timeout=50, preexec_fn=die_with_test
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # the writer thread's death is the board's to handle
    assert "files 2" in proc.stdout  # the first event file, cut by the full disk, and the new one
    seen = [
        event.step
        for path in sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
        for event in EventFileLoader(str(path)).Load()
        if event.HasField("summary")
    ]
    assert sorted(seen) == list(range(1, 211))  # every step once
