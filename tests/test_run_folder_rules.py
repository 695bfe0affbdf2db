"""Run folders that survive misuse, reruns and faults, in real runs (gloo): one process (`python -m
hpc_ddp.train`, ~3 s) where the rule is about the folder, the local launcher (1 node x 2 ranks) where it is
about a job. The rules are stated in docs/run-folder.md, "The rules of a run folder".

Deadlines are about 5x the time each took on a loaded 2-core machine (2.5-20 s; the module's `trained` fixture,
~3.5 s, is paid by the first test that uses it). Most tests start from a copy of one trained folder (`trained`: the linear task, 2 epochs of 31 steps, so
checkpoints at steps 31 and 62, and model.pth).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import clean_environ, die_with_test, run_module
from test_launch_local import finish, read_until, start

from hpc_ddp import exitcodes
from hpc_ddp.errors import UsageError
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint import full, store
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.records.metrics import read_records


def train(folder: Path, *args: str, cwd: Path | None = None, **env: str) -> tuple[int, str]:
    """`python -m hpc_ddp.train` alone: one rank, a real gloo group; exit code and all output."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.train", "--folder", str(folder), *args],
        cwd=cwd,
        env=clean_environ(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        preexec_fn=die_with_test,
    )
    return proc.returncode, proc.stdout


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file a run writes (logs and the lock aside), with its bytes and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "logs" not in p.relative_to(folder).parts and p.name != "run.lock"
    }


def steps(folder: Path) -> list[int]:
    return [int(p.name[len("ckpt-") : -len(".pt")]) for p in store.list_checkpoints(folder, storage=Local())]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("trained")
    code, out = train(folder, "--epochs", "2")
    assert code == 0, out
    assert steps(folder) == [62, 31]
    return folder


@pytest.fixture
def copy(trained: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(trained, folder)
    return folder


# --- 1. A start from an earlier checkpoint ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.deadline(75)
def test_a_start_from_an_earlier_checkpoint_keeps_its_new_line_and_sets_the_later_one_aside(
    tmp_path: Path,
) -> None:
    code, out = train(tmp_path, "--max-steps", "45", "--save-every-steps", "15", "--save-every-epochs", "0")
    assert code == 0, out
    assert steps(tmp_path) == [45, 30, 15]
    old_model = (tmp_path / "model.pth").read_bytes()
    step15 = store.ckpt_dir(tmp_path) / "ckpt-00000015.pt"
    code, out = train(
        tmp_path, "--max-steps", "25", "--keep", "1", "--resume", str(step15), "--save-every-epochs", "0"
    )
    assert code == 0, out
    assert steps(tmp_path) == [25]  # rotation kept the file it wrote
    assert store.read_latest(tmp_path, storage=Local()) == store.ckpt_dir(tmp_path) / "ckpt-00000025.pt"
    aside = list(store.ckpt_dir(tmp_path).glob("abandoned-*"))
    assert len(aside) == 1, out
    assert sorted(p.name for p in aside[0].iterdir()) == [
        "ckpt-00000030.pt",
        "ckpt-00000030.pt.sha256",
        "ckpt-00000045.pt",
        "ckpt-00000045.pt.sha256",
        "model.pth",
        "model.pth.sha256",
    ]
    assert (aside[0] / "model.pth").read_bytes() == old_model  # the abandoned line's weights: kept, not lost
    assert "ckpt-00000030.pt, ckpt-00000045.pt) and model.pth belong to another line of training" in out
    final = full.load(store.ckpt_dir(tmp_path) / "ckpt-00000025.pt", storage=Local())["model"]
    model = torch.load(tmp_path / "model.pth", weights_only=True)
    assert all(torch.equal(model[k], final[k]) for k in final)
    # The next run continues the new line: done at step 25, nothing trained, model.pth left alone.
    code, out = train(tmp_path, "--max-steps", "25")
    assert code == 0 and "already finished at epoch 0, step 25" in out, out


# --- 2. A finished run is finished ------------------------------------------------------------------------


@pytest.mark.parametrize("epoch, batch, said", [(49, 8, 50), (50, 0, 50), (0, 3, 0), (7, 8, 8)])
def test_a_finished_run_says_the_epoch_its_end_said(epoch: int, batch: int, said: int) -> None:
    """Issue 33 item 10: "already finished at epoch 49, step 400" beside "ranks ended at epoch 50, step 400":
    the checkpoint saved at the last step of epoch 49 holds every batch of it done, the loop's end the next
    epoch. Both are said as the end says it (8 batches an epoch here)."""
    from hpc_ddp.run.loop.position import Position, epochs_done

    assert epochs_done(Position(epoch=epoch, batch=batch, step=400), 8) == said


@pytest.mark.slow
@pytest.mark.deadline(45)
def test_rerunning_a_finished_run_trains_nothing_until_asked_for_more(tmp_path: Path) -> None:
    args = ("--max-steps", "20", "--save-every-epochs", "0")
    code, out = train(tmp_path, *args)
    assert code == 0, out
    done = snapshot(tmp_path)
    code, out = train(tmp_path, *args)
    assert code == 0, out
    assert (
        "The run in " in out
        and "already finished at epoch 0, step 20 (--epochs 10 --max-steps 20): "
        "nothing to train, nothing written"
        in out
    ), out
    assert snapshot(tmp_path) == done  # no step 21, no checkpoint, model.pth/run.json/metrics untouched
    code, out = train(tmp_path, "--max-steps", "30", "--save-every-epochs", "0")
    assert code == 0 and "at epoch 0, step 20" in out, out
    assert steps(tmp_path) == [30, 20]


# --- 3. Validate everything first, delete last -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.deadline(30)
def test_resume_never_overwrite_with_a_typo_deletes_nothing(copy: Path) -> None:
    before = snapshot(copy)
    code, out = train(copy, "--resume", "never", "--overwrite", "--task", "slow_tasks:slwo")
    assert code == exitcodes.USAGE, out
    assert "slow_tasks has no function 'slwo'" in out and "Traceback" not in out
    assert snapshot(copy) == before  # every checkpoint and model.pth still there, run.json not rewritten


# --- 4. What the kit saves, it can load -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.deadline(45)
def test_a_numpy_learning_rate_saves_checkpoints_that_resume(tmp_path: Path) -> None:
    code, out = train(tmp_path, "--task", "robust_tasks:numpy_lr", "--epochs", "1")
    assert code == 0, out
    code, out = train(tmp_path, "--task", "robust_tasks:numpy_lr", "--epochs", "2")
    assert code == 0, out
    assert "Resuming from" in out and "corrupt" not in out
    latest = store.read_latest(tmp_path, storage=Local())
    assert (
        latest is not None
        and full.load(latest, storage=Local())["optimizer"]["param_groups"][0]["lr"] == 0.01
    )


# --- 5. One run per folder --------------------------------------------------------------------------------


def test_a_lock_from_another_machine_is_taken_over_only_once_stale_and_a_requeue_takes_its_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.lock"
    path.write_text(
        json.dumps(
            {
                "token": "theirs",
                "role": "rank0",
                "job_id": "77",
                "restarts": 0,
                "host": "far",
                "pid": 1,
                "pid_start": 1,
                "boot_id": "another boot",
                "pid_ns": "x",
                "since": time.time(),
            }
        )
    )
    with pytest.raises(
        UsageError,
        match=r"is in use by rank 0 of job 77 \(pid 1 on far, .*refreshed 0 s ago.*"
        r"Fix: wait for it to end or stop it \(scancel 77",
    ):
        run_folder.hold_folder(tmp_path, "rank0", "88", 0)
    old = time.time() - 2 * run_folder.LOCK_STALE_S
    os.utime(path, (old, old))  # its holder stopped refreshing it two minutes ago
    mine = run_folder.hold_folder(tmp_path, "rank0", "88", 0)
    assert json.loads(path.read_text())["job_id"] == "88"
    requeued = run_folder.hold_folder(tmp_path, "rank0", "88", 1)  # the same job, restarted
    mine.release()  # no longer its lock: left alone
    assert json.loads(path.read_text())["token"] == requeued.token
    requeued.release()
    assert not path.exists()


@pytest.mark.slow
@pytest.mark.deadline(90)
def test_a_second_run_in_a_live_folder_is_refused_and_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    slow_task = ("--task", "slow_tasks:slow", "--nodes", "1")
    first = start(tmp_path, *slow_task, "--epochs", "200", SLOW_TASK_SLEEP_S="0.02")
    job = read_until(first, "[launcher] local job ")[-1].split("local job ")[1].split(":")[0]
    read_until(first, "Epoch 0,")
    deadline = time.monotonic() + 30
    while not store.list_checkpoints(tmp_path, storage=Local()):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    code, out = train(tmp_path, "--task", "slow_tasks:slow")
    assert code == exitcodes.USAGE, out
    assert f"is in use by the local launcher of job {job} (pid {first.pid} on " in out, out
    proc = run_module(
        "hpc_ddp.submit",
        "--local",
        "--folder",
        str(tmp_path),
        *slow_task,
        "--resume",
        "never",
        "--overwrite",
        timeout=60,
    )
    assert proc.returncode == exitcodes.USAGE, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and f"is in use by the local launcher of job {job}" in proc.stderr
    # Refused before it says anything, and a local job is no Slurm job: no scancel (before, both).
    assert "[launcher] local job" not in proc.stdout, proc.stdout
    assert "scancel" not in proc.stderr and f"Ctrl-C its launcher, or kill {first.pid}" in proc.stderr
    assert store.list_checkpoints(tmp_path, storage=Local()), "the live run's checkpoints must survive"
    assert json.loads((tmp_path / "run.json").read_text())["dist"]["job_id"] == job

    ranks = psutil.Process(first.pid).children()
    first.kill()  # SIGKILL: no cleanup runs; its ranks die with it
    first.wait()
    psutil.wait_procs(ranks, timeout=15)
    assert (tmp_path / "run.lock").exists()
    code, out = finish(start(tmp_path, *slow_task, "--epochs", "1"), timeout=60)
    assert code == 0, out
    assert f"took over {tmp_path / 'run.lock'}: its holder, pid {first.pid} on this machine, is gone" in out
    assert not (tmp_path / "run.lock").exists()


# --- 6. A `latest` that cannot be read; 8. a torn metrics.jsonl -------------------------------------------
#
# One resume of the trained folder, with both faults: each rule is about a file of its own.


@pytest.mark.slow
@pytest.mark.deadline(30)
def test_a_latest_that_is_a_directory_falls_back_and_a_cut_metrics_line_stays_alone(copy: Path) -> None:
    pointer = store.ckpt_dir(copy) / "latest"
    pointer.unlink()
    pointer.mkdir()
    metrics = copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    cut = lines[-1][: len(lines[-1]) // 2]  # a crash in the middle of the last record
    metrics.write_text("\n".join(lines[:-1] + [cut]))
    code, out = train(copy, "--epochs", "3")
    assert code == 0, out
    # The latest that is a directory: the run goes on from the newest checkpoint that loads.
    assert f"{pointer} is unreadable (Is a directory); using the newest checkpoint that loads" in out
    assert "Resuming from" in out and "ckpt-00000062.pt at epoch 2, step 62" in out
    assert store.read_latest(copy, storage=Local()) == store.ckpt_dir(copy) / "ckpt-00000093.pt"
    assert len(list(store.ckpt_dir(copy).glob("latest.unreadable-*"))) == 1
    # The cut metrics line: nothing glued onto it, and readers skip it.
    after = metrics.read_text().splitlines()
    assert after[len(lines) - 1] == cut  # nothing glued onto it
    for line in after[len(lines) :]:
        json.loads(line)  # every new record is whole
    records = read_records(metrics)
    assert len(records) == len(after) - 1 and records[-1]["event"] == "end"


# --- 9. What a resume may change ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.deadline(60)  # 4 runs: 7-18 s (measured)
def test_a_new_lr_on_resume_is_applied_and_said_or_refused(copy: Path, tmp_path: Path) -> None:
    code, out = train(copy, "--epochs", "3", "--lr", "0.005")  # the default SGD takes --lr
    assert code == 0, out
    assert (
        "--lr changed from 0.01 to 0.005 on resume: applied, the optimizer's learning rate is now [0.005] "
        "(was [0.01])"
    ) in out
    last = full.load(store.read_latest(copy, storage=Local()), storage=Local())  # type: ignore[arg-type]
    assert last["optimizer"]["param_groups"][0]["lr"] == 0.005 and last["config"]["lr"] == 0.005

    own = tmp_path / "own"
    code, out = train(own, "--task", "robust_tasks:fixed_lr", "--epochs", "1")
    assert code == 0, out
    before = snapshot(own)
    code, out = train(own, "--task", "robust_tasks:fixed_lr", "--epochs", "2", "--lr", "0.005")
    assert code == exitcodes.USAGE, out
    assert (
        "--lr 0.005: checkpoint " in out
        and "was trained with --lr 0.01, but this task's optimizer does not "
        "take its learning rate from --lr (it is [0.003] either way)"
        in out
    )
    assert snapshot(own) == before  # nothing recorded of what did not happen


# --- 10. Records are written only by a start that trains ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.deadline(60)
def test_a_refused_start_writes_no_record_and_earlier_starts_are_kept(tmp_path: Path) -> None:
    code, out = finish(start(tmp_path, "--nodes", "1", "--epochs", "1"), timeout=60)  # 2 ranks
    assert code == 0, out
    record = (tmp_path / "run.json").read_bytes()
    code, out = train(tmp_path, "--epochs", "2")  # 1 rank: refused
    assert code == exitcodes.USAGE and "world size 2 (now 1)" in out, out
    assert (tmp_path / "run.json").read_bytes() == record
    code, out = finish(start(tmp_path, "--nodes", "1", "--epochs", "2"), timeout=60)
    assert code == 0, out
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["config"]["epochs"] == 2 and len(info["starts"]) == 2
    first = json.loads(record)
    assert info["earlier"] == [first]  # kept whole, not replaced


# --- 14. A flipped bit in a real run's checkpoint ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.deadline(30)
def test_a_flipped_bit_in_the_newest_checkpoint_resumes_from_the_one_before(copy: Path) -> None:
    newest = store.ckpt_dir(copy) / "ckpt-00000062.pt"
    weight = full.load(newest, storage=Local())["model"]["weight"].numpy().tobytes()
    data = bytearray(newest.read_bytes())
    data[data.find(weight) + 2] ^= 0x01
    newest.write_bytes(bytes(data))
    code, out = train(copy, "--epochs", "3")
    assert code == 0, out
    assert "ckpt-00000062.pt cannot be loaded safely: it is corrupt (its SHA-256 is" in out
    assert "ckpt-00000031.pt at epoch 1, step 31" in out
    moved = list(store.ckpt_dir(copy).glob("abandoned-*/ckpt-00000062.pt"))
    assert len(moved) == 1 and moved[0].read_bytes() == bytes(data)  # the damaged file is kept, aside
