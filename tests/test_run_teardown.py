"""End of life: nothing outlives the process group, rank 0's errors reach all ranks, a task exits with its code.

Nothing that holds the process group outlives it, errors reach every rank, and a task always exits with its
own code, fast (hpc_ddp.cluster.group teardown, Trainer.close, hpc_ddp.run.session, exitcodes.leave)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import trainer_state
from conftest import clean_environ, die_with_test, local_checkpoints
from slow_tasks import _data
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp import exitcodes
from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster import group
from hpc_ddp.cluster.group import GroupLifetimeError
from hpc_ddp.log import RankLog
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.trainer import Trainer

CPU = torch.device("cpu")


def _task(fail: str) -> tasks.Task:
    """The linear task, failing where `fail` says."""

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if fail == "loss":
            raise RuntimeError("boom in loss_fn")
        if fail == "interrupt":
            raise KeyboardInterrupt
        return nn.functional.mse_loss(output, target)

    class Model(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if fail == "forward":  # raised inside DDP.forward, whose frame holds the DDP module
                raise RuntimeError("boom in the user's forward")
            return super().forward(x)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if fail == "optimizer":
            raise ValueError("boom in the user's optimizer factory")
        return torch.optim.SGD(params, lr=0.01)

    return tasks.Task(model=Model(10, 1), dataset=_data(0), loss_fn=loss_fn, optimizer=optimizer)


def _exercise(fail: str, folder: Path) -> None:
    """One path through a Trainer's life inside a real one-rank gloo group; raises where `fail` says."""
    cfg = TrainConfig(epochs=1, max_steps=3, save_every_epochs=0)
    cfg = cfg.with_folder(str(folder))
    with Trainer(cfg, dist_env.detect({}), CPU, _task(fail), RankLog(0), local_checkpoints(cfg)) as trainer:
        assert any(h is trainer.strategy.wrapped for h in group.live_holders())  # the teardown check sees it
        if fail == "restore":
            trainer_state.restore(trainer, {"world_size": 7, "config": {}}, folder / "ckpt.pt")
        if fail == "writer":
            trainer.save()  # into a folder that is a file: the background write fails, close() raises it
            return
        trainer.run()


@pytest.mark.parametrize(
    "fail, expected",
    [
        ("none", None),
        ("loss", RuntimeError),
        ("forward", RuntimeError),
        ("interrupt", KeyboardInterrupt),
        ("optimizer", ValueError),
        ("restore", Exception),
        ("writer", OSError),
    ],
)
def test_no_path_lets_ddp_outlive_the_process_group(
    fail: str, expected: type[BaseException] | None, tmp_path: Path
) -> None:
    """Whatever ends the block, the teardown finds no live DDP (it would raise GroupLifetimeError and keep the
    group), destroys the group, and the error that ended the block is the one raised. The exception's
    traceback stays referenced here on purpose: its frames hold the Trainer, the way the old hang did."""
    folder = tmp_path
    if fail == "writer":
        folder = tmp_path / "a-file"
        folder.write_text("not a folder")
    caught: BaseException | None = None
    try:
        with group.process_group(dist_env.detect({}), CPU):
            _exercise(fail, folder)
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt is one of the paths
        caught = e
    if expected is None:
        assert caught is None
    else:
        assert isinstance(caught, expected) and not isinstance(caught, GroupLifetimeError), repr(caught)
    assert not dist.is_initialized()  # destroyed: the teardown found no holder alive
    assert group.live_holders() == []


def test_a_ddp_alive_at_teardown_is_an_error_not_a_later_deadlock() -> None:
    """The check itself: a DDP module kept past the block makes the teardown refuse (and say why)."""
    kept: list[Any] = []
    with pytest.raises(GroupLifetimeError, match="DistributedDataParallel still alive"):
        with group.process_group(dist_env.detect({}), CPU):
            kept.append(DDP(nn.Linear(2, 1)))
            group.hold(kept[0])
    assert dist.is_initialized()  # left in place rather than destroyed under a live Reducer
    ref = weakref.ref(kept.pop())
    assert ref() is None and group.live_holders() == []
    dist.destroy_process_group()


RANK0_SCRIPT = """
import sys, time
from hpc_ddp.cluster.env import detect
from hpc_ddp.cluster.group import process_group
from hpc_ddp.errors import UsageError
from hpc_ddp.run import session
import torch
from hpc_ddp.launch import local
from pathlib import Path
job = local.LocalJob(nodes=1, tasks_per_node=2, folder=Path("."), train_argv=[], max_requeue=0, checkpoint_storage="local", job_id=sys.argv[2])
env = detect(local.slurm_env(job, int(sys.argv[1]), 0))  # what srun gives a task of a 1 x 2 step
kind = sys.argv[3]
def fn():
    if kind == "usage":
        raise UsageError("--folder x: not writable. Fix: another --folder")
    raise ValueError("disk on fire")
start = time.monotonic()
with process_group(env, torch.device("cpu"), "gloo", 120.0):
    try:
        session._rank0(env, fn)
    except Exception as e:
        print(f"rank {env.rank} raised {type(e).__name__}: {e} after {time.monotonic() - start:.1f} s", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, seen_by_rank1",
    [
        ("error", "RuntimeError: rank 0 failed (ValueError: disk on fire)"),
        ("usage", "UsageError: --folder x: not writable. Fix: another --folder"),
    ],
)
def test_any_error_on_rank0_reaches_every_rank_at_once(kind: str, seen_by_rank1: str) -> None:
    """Not only usage errors: before, anything else left rank 1 in the broadcast until the 120 s timeout."""
    from hpc_ddp.launch.local import fresh_job_id

    job_id = fresh_job_id()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK0_SCRIPT, str(rank), job_id, kind],
            env=clean_environ(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=die_with_test,
        )
        for rank in (0, 1)
    ]
    outs = []
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert "rank 0 raised" in outs[0] and ("disk on fire" in outs[0] or "not writable" in outs[0]), outs[0]
    assert f"rank 1 raised {seen_by_rank1}" in outs[1], outs[1]
    waited = float(outs[1].split(" after ")[1].split(" s")[0])
    assert waited < 60, outs[1]


def train_task(folder: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """`python -m hpc_ddp.train` alone (one process), output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp.train", "--folder", str(folder), *args],
        env=clean_environ(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )


def ended(proc: subprocess.Popen[str], within_s: float) -> tuple[int, str, float]:
    """Exit code, output and seconds taken; kills it and fails if it is still running after `within_s`."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"still running after {within_s} s (its exit hangs):\n{out}")
    return proc.returncode, out, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("task", ["leftover_thread", "gil_hang_at_exit"])
def test_a_finished_task_leaves_with_code_0_despite_what_would_hang_its_exit(
    task: str, tmp_path: Path
) -> None:
    """A non-daemon thread that never ends, or an exit hook stuck in native code holding the GIL: an ordinary
    interpreter exit waits for either forever; the task skips both (os._exit) once its files are durable."""
    code, out, _ = ended(train_task(tmp_path, "--task", f"exit_tasks:{task}", "--epochs", "2"), 90)
    assert code == exitcodes.OK, out
    assert "Model saved by rank 0" in out and (tmp_path / "model.pth").is_file()
    assert "exits with code 0 (finished)" in out


@pytest.mark.slow
def test_a_preempted_task_keeps_its_code_75_despite_a_leftover_thread(tmp_path: Path) -> None:
    proc = train_task(
        tmp_path, "--task", "exit_tasks:leftover_thread", "--epochs", "500", "--save-every-epochs", "0"
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the run is training: its first epoch ended
        if line.startswith("Epoch 0,"):
            break
    proc.send_signal(signal.SIGTERM)
    code, out, _ = ended(proc, 60)
    assert code == exitcodes.PREEMPTED, out
    assert "exits with code 75 (preempted, resumable)" in out


@pytest.mark.slow
def test_a_usage_error_after_user_code_started_a_thread_still_exits_2(tmp_path: Path) -> None:
    code, out, _ = ended(
        train_task(tmp_path, "--task", "exit_tasks:leftover_thread", "--batch-size", "100000"), 90
    )
    assert code == exitcodes.USAGE, out
    assert "python -m hpc_ddp.train: error: each rank gets" in out and "Traceback" not in out


@pytest.mark.slow
@pytest.mark.deadline(120)
def test_a_usage_error_on_rank_0_alone_is_the_first_cause_not_its_peer_s_closed_connection(
    tmp_path: Path,
) -> None:
    """Issue 42: rank 0 alone refuses its first step with a usage error (as MLflow 3 refuses a file store) while
    rank 1 waits in the step's collective and fails on it ("Connection closed by peer"). Rank 0's line is the
    first cause, on the console (no traceback of rank 1's) and in attempts.jsonl; exit 2, never retried."""
    import json

    from test_launch_local import finish, start

    from hpc_ddp.ledger import exits

    code, out = finish(
        start(tmp_path, "--task", "exit_tasks:usage_error_on_rank0", "--nodes", "1", "--epochs", "1"), 100
    )
    assert code == exitcodes.USAGE, out
    assert "python -m hpc_ddp.train: error: the tracker refuses a file store" in out
    assert (
        "[launcher] rank 0 on node 0 (127.0.0.1)" in out
        and "exited with code 2; stopped the other ranks" in out
    )
    assert "then rank 1 failed too, on the rank that ended first (Connection closed by peer)" in out
    assert "Traceback" not in out and "rank 1 failed first" not in out and "restarting" not in out
    end = [
        r
        for r in map(json.loads, (tmp_path / "attempts.jsonl").read_text().splitlines())
        if r["event"] == "end"
    ]
    assert [(r["outcome"], r["rank"], r["reason"]) for r in end] == [
        ("usage", 0, "UsageError: the tracker refuses a file store. Fix: set MLFLOW_ALLOW_FILE_STORE=1")
    ]
    (attempt,) = (tmp_path / exits.EXITS).iterdir()
    job, restart = attempt.name.rsplit("-", 1)
    notes = exits.read(tmp_path, job, int(restart))
    assert (
        notes[0]["rank"] == 0 and notes[0]["usage"] is True
    )  # written before its group went: before rank 1's


@pytest.mark.slow
def test_a_step_stuck_in_native_code_holding_the_gil_ends_at_the_timeout_with_stacks(tmp_path: Path) -> None:
    """No Python thread can run then, the hang watchdog's neither: its dead man's switch, faulthandler's C timer
    pushed forward on every tick, fires threshold (3 s) + window (5 s) + margin (10 s) after the last tick,
    dumps every thread and exits 1."""
    code, out, took = ended(
        train_task(tmp_path, "--task", "exit_tasks:gil_hang_in_step", "--timeout-s", "6"), 90
    )
    assert code == exitcodes.FAILED, out
    assert "Timeout (0:00:1" in out and "in loss_fn" in out and "exit_tasks.py" in out
