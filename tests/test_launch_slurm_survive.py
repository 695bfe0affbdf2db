"""On the real local Slurm cluster (3 emulated nodes): failures that are not preemption.

A node that Slurm takes away under a running job (the batch shell's own, or another), a rank that raises a
GPU hardware error on one node, a task that fails everywhere, a run folder that turns read-only. Each job is
a real 2-node x 1-task submitit job followed by `submit --wait`, under the kit's `--no-kill`: the batch
shell's `end` step (hpc_ddp.launch.slurm.batch) decides after every attempt it outlives, and `--wait`
(hpc_ddp.launch.slurm.lost) after one it does not. One task per node: what these tests need is more than one
node (test_launch_slurm_submit.py runs 2 x 2), and every rank is a process that spends seconds of CPU
importing torch. This module sorts after test_launch_slurm_submit.py, whose background time-limit job must
not be on a node these tests take away.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import clean_environ
from test_launch_slurm_submit import (
    CLIENT,
    DDP_SBATCH,
    HANG_GUARD_S,
    run_submit,
    sacct_records,
    start_submit,
    wait_job,
)

from hpc_ddp.launch.slurm import submitter
from hpc_ddp.ledger import attempts

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.deadline(240)]

ONE_TASK = ["--tasks-per-node", "1"]  # after submit_argv's own "--tasks-per-node 2": the last one counts
# 512 samples / 2 ranks / batch 32 = 8 steps an epoch; a checkpoint every 4 steps.
TRAINING = ["--task", "slow_tasks:slow", "--deterministic", "--save-every-steps", "4", "--epochs", "4"]
DETERMINISTIC = [*ONE_TASK, *TRAINING]  # submit's options


def job_nodes(job_id: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    match = re.search(r" NodeList=(\S+)", out)
    if not match or match.group(1) in ("(null)", ""):
        return []
    return subprocess.run(
        ["scontrol", "show", "hostnames", match.group(1)], capture_output=True, text=True
    ).stdout.split()


def wait_all_idle(timeout_s: float = 120) -> None:
    """Until every node is idle: a job then lands on the first nodes (node1,node2), which the tests rely on.
    A node just RESUMEd, or still finishing the previous test's job, takes a moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
        if states.split() and all(line.split()[1] == "idle" for line in states.splitlines() if line.strip()):
            return
        assert time.monotonic() < deadline, f"nodes not idle after {timeout_s:g} s:\n{states}"
        time.sleep(0.5)


@pytest.fixture
def taken_away() -> Iterator[list[str]]:
    """Nodes a test sets DOWN; each is RESUMEd afterwards, whatever happened."""
    nodes: list[str] = []
    yield nodes
    for node in nodes:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
    wait_all_idle()


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = run_submit(folder, *DETERMINISTIC, "--wait", env=clean_environ(SLOW_TASK_SLEEP_S="0"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(folder / "model.pth", weights_only=True)


def test_the_batch_hosts_node_taken_away_mid_run_is_survived_bitwise_equal(
    uninterrupted: dict[str, Any], tmp_path: Path, taken_away: list[str]
) -> None:
    """Issue 33 item 1: the batch shell's own node lost. Under --no-kill Slurm ends the job (FAILED,
    JobLaunchFailure: no batch shell is left to decide) and never requeues it; `--wait` records the node
    failure, requeues the job away from that node, follows it to the end, and the run is bitwise what an
    uninterrupted one gives. (A node other than the batch shell's: the batch shell decides, below.)"""
    wait_all_idle()
    folder = tmp_path / "run"
    proc, job_id = start_submit(folder, *DETERMINISTIC, SLOW_TASK_SLEEP_S="0.1")
    deadline = time.monotonic() + HANG_GUARD_S
    while not (folder / "checkpoints" / "latest").is_file():  # the first checkpoint, at step 4
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    first, second = job_nodes(job_id)  # the batch shell runs on the first
    take_away(first, taken_away)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out
    assert out.rstrip().endswith(f"[submit] job {job_id} completed; run folder {folder}"), out
    lost, finished = attempts.read(folder)
    assert (lost.outcome, lost.node, lost.blamed, lost.decision) == ("node_fail", first, True, "requeue"), out
    assert lost.exclude == (first,)
    assert f"[submit] attempt 1 node_fail on {first} (points at the node): node {first} failed" in out
    assert f"requeued job {job_id}; it will not run on {first}" in out
    assert first not in finished.nodes and second in finished.nodes and len(finished.nodes) == 2
    assert (finished.outcome, finished.decision) == ("completed", "done")
    assert finished.resumed_from is not None and finished.resumed_from >= 4
    assert (
        f"[submit] attempt 2 on {','.join(finished.nodes)}: resumed from step {finished.resumed_from}" in out
    )
    got = torch.load(folder / "model.pth", weights_only=True)
    assert all(torch.equal(uninterrupted[k], got[k]) for k in uninterrupted)


def submit_node_fault(
    folder: Path, bad_nodes: str, error: str = ""
) -> tuple[subprocess.CompletedProcess[str], str]:
    """A 2-node job whose tasks on `bad_nodes` raise a CUDA ECC error, on an idle cluster (so it starts on
    node1,node2), waited for: the finished `submit --wait` and the job id."""
    wait_all_idle()
    proc = run_submit(
        folder,
        *ONE_TASK,
        "--task",
        "retry_tasks:node_fault",
        "--epochs",
        "2",
        "--wait",
        env=clean_environ(RETRY_BAD_NODE=bad_nodes, RETRY_ERROR=error),
    )
    found = re.match(r"Submitted job (\d+):", proc.stdout)
    assert found, proc.stdout
    return proc, found.group(1)


def test_a_task_that_fails_everywhere_stops_after_two_attempts_with_one_traceback(
    slurm_cluster: str, tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    proc = run_submit(folder, *ONE_TASK, "--task", "retry_tasks:fails_everywhere", "--epochs", "2", "--wait")
    assert proc.returncode == 1, proc.stdout
    job_id = re.match(r"Submitted job (\d+):", proc.stdout).group(1)  # type: ignore[union-attr]
    assert sacct_records(job_id) == ["REQUEUED", "FAILED"]
    first, second = attempts.read(folder)
    assert (first.decision, second.decision) == ("requeue", "stop")
    assert first.blamed is False and first.exclude == ()
    out = proc.stdout
    assert "crash loop: attempt 2 failed with the same error as attempt 1 and no newer checkpoint" in out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count("ValueError: bad batch at call 3 (tests/retry_tasks.py:fails_everywhere)") >= 1
    assert out.index("Traceback (most recent call last)") < out.index(f"[hpc_ddp] job {job_id} stops")
    # one task per node: rank 1 is node2's; the final word is the record's, said once
    assert (
        f"[submit] job {job_id} stopped after 2 attempt(s): rank 1 failed first (on node2): ValueError" in out
    )
    assert out.count("[submit]     attempt 1 on") == 0  # `end` listed the attempts above: not again
    log = submitter._read(submitter.log_path(folder, job_id, 0))
    assert log.count("Traceback (most recent call last)") >= 1  # the ranks' own logs keep everything


def test_a_job_that_no_longer_fits_once_bad_nodes_are_excluded_stops_instead_of_pending(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """node2 fails (a GPU hardware error), then node3: with both excluded, one node is left for a 2-node job.
    The first failure is the one-node story too: node2 blamed, the job requeued without it (on node1,node3)."""
    folder = tmp_path / "run"
    proc, job_id = submit_node_fault(folder, "node2,node3")
    assert proc.returncode == 1, proc.stdout
    first, second = attempts.read(folder)
    assert first.nodes == ("node1", "node2")  # the idle cluster's first two nodes
    assert (first.outcome, first.node, first.blamed, first.decision, first.exclude) == (
        "failed",
        "node2",
        True,
        "requeue",
        ("node2",),
    )
    assert first.reason == "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    assert (
        f"[hpc_ddp] requeued job {job_id}; it will not run on node2 (clear that with: scontrol update "
        f"JobId={job_id} ExcNodeList=)" in proc.stdout
    )
    assert (second.nodes, second.node, second.decision) == (("node1", "node3"), "node3", "stop")
    assert second.exclude == ("node2", "node3")
    assert (
        "cannot requeue: the job needs 2 node(s) and only 1 usable one(s) remain in partition debug once "
        "node2,node3 are excluded" in proc.stdout
    )
    assert f"[submit] job {job_id} stopped after 2 attempt(s): rank 1 failed first (on node3)" in proc.stdout


def freeze_tasks(job_id: str, node: str) -> list[int]:
    """SIGSTOP the job's processes on `node` (an emulated node's processes all run here: their environment
    names the node), as a node that stops answering would leave them; returns their pids."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item
            )
        except OSError:
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURMD_NODENAME") == node
            and "SLURM_STEP_ID" in env
        ):
            pids.append(int(entry.name))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    return pids


def take_away(node: str, taken_away: list[str]) -> None:
    """DOWN, then DRAIN (a bare DOWN returns within milliseconds here: ReturnToService=2)."""
    taken_away.append(node)
    for state in ("DOWN", "DRAIN"):
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", f"State={state}", "Reason=hpc_ddp test"], check=True
        )


def test_a_lost_node_that_leaves_too_few_stops_the_job_instead_of_pending_forever(
    slurm_cluster: str, tmp_path: Path, taken_away: list[str]
) -> None:
    """Issues 23 and 33 item 1: node3 drained, node2 lost under a 2-node job on node1,node2 (its tasks frozen,
    the node set DOWN, then the tasks killed). Under --no-kill Slurm removes node2 and keeps the job: the
    batch shell records the node failure and, with one usable node left, stops the job (it ends; nothing
    pends). Without --no-kill Slurm requeued the job itself, and whether the batch shell's `end` ran before
    its KillWait, or the survivors saved on SIGTERM first (`--wait` then said 75), was a race."""
    wait_all_idle()
    take_away("node3", taken_away)
    folder = tmp_path / "run"
    proc, job_id = start_submit(folder, *DETERMINISTIC, SLOW_TASK_SLEEP_S="0.1")
    deadline = time.monotonic() + HANG_GUARD_S
    while not (folder / "checkpoints" / "latest").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    assert job_nodes(job_id) == ["node1", "node2"]
    frozen = freeze_tasks(job_id, "node2")
    assert frozen, "no task of the job found on node2"
    take_away("node2", taken_away)
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 1, out
    (lost,) = attempts.read(folder)
    assert (lost.outcome, lost.node, lost.decision) == ("node_fail", "node2", "stop"), out
    assert "[hpc_ddp] attempt 1 node_fail on node2 (points at the node)" in out, out
    assert "cannot requeue: the job needs 2 node(s) and only 1 usable one(s) remain" in out, out
    assert "pending" not in out.split("cannot requeue")[-1], out
    assert f"[submit] job {job_id} stopped after 1 attempt(s): a node failed (on node2)" in out, out
    assert sacct_records(job_id)[-1] == "FAILED", out  # never requeued, never cancelled: it ended
    state = CLIENT.job(job_id)
    assert state is None or state.gone or state.state.done, state


def test_a_requeue_by_slurm_with_every_node_up_is_a_preemption_and_a_stop_stops(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Issue 23 item 2: `scontrol requeue` twice (what PreemptMode=REQUEUE does) with --max-requeue 1: the
    first is a preemption, requeued; the second spends the budget, and the job really stops there."""
    wait_all_idle()
    folder = tmp_path / "run"
    proc, job_id = start_submit(folder, *DETERMINISTIC, "--max-requeue", "1", SLOW_TASK_SLEEP_S="0.1")
    log = submitter.log_path(folder, job_id)
    for needle in ("Epoch 0,", "Resuming from"):  # training, then training again after the first requeue
        deadline = time.monotonic() + HANG_GUARD_S
        while needle not in submitter._read(log):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    records = attempts.read(folder)
    assert [(a.outcome, a.decision, a.blamed) for a in records] == [
        ("preempted", "requeue", False),
        ("preempted", "stop", False),
    ], out
    assert "node_fail" not in out and "--max-restarts" not in out, out
    assert "requeue budget spent (1 of --max-requeue 1)" in out, out
    assert proc.returncode != 0, out
    assert sacct_records(job_id)[-1] != "COMPLETED", out  # no third attempt


def test_an_illegal_memory_access_blames_the_node_once_then_the_code(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Issue 23 item 4: node2 raises it (a bad GPU, maybe): excluded; node3 raises it too: it follows the job,
    the code is blamed and the job stops as a crash loop instead of walking through the partition."""
    folder = tmp_path / "run"
    error = "CUDA error: an illegal memory access was encountered"
    proc, job_id = submit_node_fault(folder, "node2,node3", error)
    assert proc.returncode == 1, proc.stdout
    first, second = attempts.read(folder)
    assert (first.node, first.blamed, first.decision, first.exclude) == ("node2", True, "requeue", ("node2",))
    assert (second.nodes, second.node, second.blamed, second.decision) == (
        ("node1", "node3"),
        "node3",
        False,
        "stop",
    )
    assert "crash loop" in proc.stdout and "cannot requeue" not in proc.stdout, proc.stdout
    assert f"[submit] job {job_id} stopped after 2 attempt(s): rank 1 failed first (on node3)" in proc.stdout


def test_a_job_refused_another_jobs_folder_stops_and_leaves_it_alone(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Issue 23 item 6: job A trains in the folder; job B (slurm/ddp.sbatch, same --folder) is refused by
    the folder lock (rank 0 exits 2). B stops at once, not requeued, and writes nothing in A's folder."""
    wait_all_idle()
    folder = tmp_path / "run"
    # 1 s a step until the test releases it (tests/slurm_tasks.py): running at B's end whatever the load (15
    # epochs of 8 steps), then quick
    release = tmp_path / "release"
    task = ("--task", "slurm_tasks:slow_until_released", "--epochs", "15")
    proc, job_a = start_submit(
        folder, *DETERMINISTIC, *task, SLOW_TASK_SLEEP_S="1", RELEASE_FILE=str(release)
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while not (folder / "checkpoints" / "latest").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    before = sorted(str(p.relative_to(folder)) for p in (folder / "exits").rglob("*"))
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--gpus-per-node=0",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            str(DDP_SBATCH),
            "--folder",
            str(folder),
            *TRAINING,  # the sbatch options above give its shape
        ],
        cwd=tmp_path,
        env=clean_environ(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"),
        capture_output=True,
        text=True,
        check=True,
    )
    job_b = submitted.stdout.strip().split(";")[0]
    assert wait_job(job_b) == "FAILED"
    log = (tmp_path / f"hpc_ddp-{job_b}.out").read_text()
    assert f"is held by job {job_a}: this job recorded nothing there and stops" in log, log
    assert sacct_records(job_b) == ["FAILED"]  # never requeued
    assert all(a.job == job_a for a in attempts.read(folder))
    assert not list((folder / "exits").glob(f"{job_b}-*")), before
    assert proc.poll() is None, proc.communicate()[0]  # A was running all along
    release.touch()
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out  # A is unharmed


def test_a_run_folder_that_turns_read_only_stops_the_job_in_one_line(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Issue 33 item 8: the run folder's file system remounted read-only after an error (here a read-only bind
    mount over it, mid-run). Every attempt would fail the same way: the job stops, not requeued, and `--wait`
    ends on one line naming the cause (its logs and records could not be written either), no traceback."""
    wait_all_idle()
    folder = tmp_path / "run"
    # The ranks retry a save for about 31 s before they stop (README "Faults during a run"): 0.05 s first.
    proc, job_id = start_submit(
        folder, *DETERMINISTIC, SLOW_TASK_SLEEP_S="0.2", HPC_DDP_SAVE_BACKOFF_S="0.05"
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while not (folder / "checkpoints" / "latest").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        out, _ = proc.communicate(timeout=180)  # within the test's deadline: the mount must not outlive it
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert proc.returncode == 1, out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith(f"[submit] job {job_id} ended FAILED"), out
    assert f"its run folder {folder} cannot be written (Read-only file system)" in last, out
    assert sacct_records(job_id) == ["FAILED"], out  # never requeued
    assert [a.outcome for a in attempts.read(folder)] == ["running"]  # its end could not be written
    assert "Traceback" not in out and "During handling" not in out, out  # the ranks' own errors, folded
