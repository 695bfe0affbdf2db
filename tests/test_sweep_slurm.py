"""Sweeps on the real local Slurm cluster (issue 44): ONE job array of four 2-node x 1-task trials, read by
every test here. Element 0 (lr=0.005) loses a node after its first checkpoint: its batch shell requeues that
element alone, away from the node, and it resumes; lr=1e+30 diverges and fails alone, named in the table; the
same command again submits nothing. The elements run one at a time (--sweep-parallel 1: two nodes each, three
nodes in all), so the node lost is element 0's second node (its batch shell lives on the first). One more array,
its own: elements with --spare-nodes, restarted in place by their own batch shells (about 25 s)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test
from test_launch_slurm_submit import HANG_GUARD_S, sacct_records
from test_launch_slurm_survive import take_away, taken_away, wait_all_idle

from hpc_ddp import exitcodes
from hpc_ddp.ledger import attempts

__all__ = ["taken_away"]  # a fixture, imported for the tests below

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.deadline(400)]

# 512 samples / 2 ranks / batch 32 = 8 steps an epoch; a checkpoint every 4 steps.
TRAINING = ["--task", "slow_tasks:slow", "--deterministic", "--save-every-steps", "4", "--epochs", "4"]
SWEEP = ["--sweep", "lr=0.005,0.01,0.02,1e30", "--sweep-parallel", "1", "--wait"]
NAMES = ["lr=0.005", "lr=0.01", "lr=0.02", "lr=1e+30"]


def command(folder: Path) -> list[str]:
    job = ["--nodes", "2", "--tasks-per-node", "1", "--time", "10", "--folder", str(folder)]
    return [sys.executable, "-m", "hpc_ddp.submit", *job, *TRAINING, *SWEEP]


def element(job: str) -> tuple[str, list[str]]:
    """An element's own job id and its nodes, from the controller."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    own, nodes = re.search(r"JobId=(\d+)", out), re.search(r" NodeList=(\S+)", out)
    assert own and nodes, out
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodes.group(1)], capture_output=True, text=True)
    return own.group(1), hosts.stdout.split()


def freeze(job_id: str, node: str, batch_too: bool = False) -> list[int]:
    """SIGSTOP the step's processes of `job_id` on `node` (every emulated node's processes run here); with
    `batch_too`, its batch shell's as well (on its first node)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            env = dict(i.split("=", 1) for i in (entry / "environ").read_text().split("\0") if "=" in i)
        except (OSError, ValueError):
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURMD_NODENAME") == node
            and ("SLURM_STEP_ID" in env or batch_too)
        ):
            pids.append(int(entry.name))
            os.kill(pids[-1], signal.SIGSTOP)
    return pids


def kill(pids: list[int]) -> None:
    """SIGKILL the processes `freeze` stopped (those still there)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def swept(slurm_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, str]]:
    wait_all_idle()
    folder = tmp_path_factory.mktemp("sweep") / "lrs"
    proc = subprocess.Popen(
        command(folder),
        env=clean_environ(SLOW_TASK_SLEEP_S="0.1"),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_test,
    )
    taken: list[str] = []
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (folder / NAMES[0] / "checkpoints" / "latest").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        array = next(p.name for p in (folder / "submitit").glob("*_0_submitted.pkl")).split("_")[0]
        own, nodes = element(f"{array}_0")
        frozen = freeze(own, nodes[1])
        assert frozen, f"no task of element {array}_0 (job {own}) on {nodes[1]}"
        take_away(nodes[1], taken)  # DOWN, then DRAIN (a bare DOWN returns within milliseconds here)
        kill(frozen)
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
        proc.wait()
        for node in taken:
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
        wait_all_idle()
    yield folder, proc.returncode, out


def test_the_diverging_trial_fails_alone_and_the_sweep_exits_with_its_code(
    swept: tuple[Path, int, str],
) -> None:
    folder, code, out = swept
    assert code == exitcodes.NONFINITE, out
    table = out[out.index("trial  ") :].splitlines()
    assert table[0].split()[:2] == ["trial", "state"], out
    rows = {line.split()[0]: line for line in table[1:]}
    assert rows["lr=0.005"].split()[1:3] == ["finished", "32"] and rows["lr=0.01"].split()[1] == "finished", (
        out
    )
    assert rows["lr=0.02"].split()[1] == "finished", out
    assert "failed (nonfinite)" in rows["lr=1e+30"] and "NaN" in rows["lr=1e+30"], out
    for name in NAMES:
        assert f"[sweep] trial {name}: submitted as job " in out, out


def test_only_the_element_that_lost_a_node_is_requeued_and_it_resumes(swept: tuple[Path, int, str]) -> None:
    folder, _, out = swept
    array = re.search(r"trial lr=0\.005: submitted as job (\d+)_0", out)
    assert array, out
    lost, finished = attempts.read(folder / NAMES[0])
    assert (lost.job, lost.outcome, lost.decision) == (f"{array.group(1)}_0", "node_fail", "requeue"), out
    assert (finished.job, finished.restart, finished.outcome) == (lost.job, 1, "completed")
    assert (
        finished.resumed_from is not None and finished.resumed_from >= 4 and lost.node not in finished.nodes
    )
    # Two runs of that element in accounting (REQUEUED, or RESIZING where Slurm removed the node under --no-kill:
    # 22.05 then writes no REQUEUED record), one of every other.
    assert len(sacct_records(lost.job)) == 2, sacct_records(lost.job)
    for index, name in ((1, NAMES[1]), (2, NAMES[2]), (3, NAMES[3])):
        (only,) = attempts.read(folder / name)  # one attempt each: never requeued
        assert only.job == f"{array.group(1)}_{index}"
        assert sacct_records(only.job) == ["COMPLETED" if index < 3 else "FAILED"], sacct_records(only.job)
    assert f"[sweep] trial lr=0.005 (job {array.group(1)}_0): PENDING" in out


def test_the_same_command_again_submits_nothing(swept: tuple[Path, int, str]) -> None:
    folder, _, _ = swept
    again = subprocess.run(
        command(folder),
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=die_with_test,
    )
    out = again.stdout + again.stderr
    assert again.returncode == exitcodes.NONFINITE, out
    assert "[sweep] trial lr=0.005: finished" in out and "[sweep] trial lr=0.01: finished" in out
    assert "[sweep] trial lr=0.02: finished" in out
    assert "[sweep] trial lr=1e+30: failed (nonfinite" in out and "--sweep-retry-failed" in out
    assert "submitted" not in out and "following" not in out
    assert out.rstrip().splitlines()[-4].startswith("lr=0.005"), out  # the table, at once


def test_an_element_with_spare_nodes_restarts_in_place_then_stops_a_crash_loop(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """--spare-nodes inside array elements (issue 44): two trials, 2 nodes x 1 task + 1 spare each, one at a time,
    rank 1 SIGKILLed as its task starts, every time. Element 0 (--max-restarts 5): its batch shell restarts it in
    place on the same nodes (no requeue, no spare spent for a SIGKILL), under the element's own id, then stops
    the same death as a crash loop, as a single job's does. Element 1 (--max-restarts 0) stops at once. The
    sweep reports both failed, with the jobs' exit code."""
    wait_all_idle()
    folder = tmp_path / "spares"
    job = [
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--spare-nodes",
        "1",
        "--time",
        "10",
        "--folder",
        str(folder),
    ]
    task = ["--task", "slurm_tasks:sigkilled_at_start", "--epochs", "1"]
    sweep = ["--sweep", "max-restarts=5,0", "--sweep-parallel", "1", "--wait"]
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.submit", *job, *task, *sweep],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        preexec_fn=die_with_test,
    )
    out = done.stdout + done.stderr
    assert done.returncode == exitcodes.FAILED, out
    submitted = re.search(r"trial max-restarts=5: submitted as job (\d+)_0", out)
    assert submitted, out
    first, second = attempts.read(folder / "max-restarts=5")
    element = f"{submitted.group(1)}_0"
    assert {first.job, second.job} == {element} and [first.restart, second.restart] == [0, 1000], out
    assert (first.reason, first.decision, first.left, first.spares_in) == (
        "rank 1 was killed by SIGKILL",
        "restart",
        (),
        (),
    ), out
    assert second.nodes == first.nodes and second.decision == "stop", out
    assert "REQUEUED" not in sacct_records(element), out
    (only,) = attempts.read(folder / "max-restarts=0")
    assert (only.job, only.decision) == (f"{submitted.group(1)}_1", "stop"), out
    rows = {line.split()[0]: line for line in out[out.index("trial  ") :].splitlines()[1:]}
    assert "failed" in rows["max-restarts=5"] and "failed" in rows["max-restarts=0"], out


def test_an_element_whose_batch_shells_node_is_lost_is_closed_and_requeued_by_wait(
    slurm_cluster: str, tmp_path: Path, taken_away: list[str]
) -> None:
    """Issue 44: element 0's batch shell's own node taken away after its first checkpoint. Under --no-kill Slurm
    ends that element (no batch shell is left to decide); the sweep's --wait closes the attempt as a single
    job's --wait does (the node failure recorded, the decision the ledger's), requeues the element away from
    the node, follows it again to its end; then element 1 runs. Both finish."""
    wait_all_idle()
    folder = tmp_path / "lost"
    job = ["--nodes", "2", "--tasks-per-node", "1", "--time", "10", "--folder", str(folder)]
    sweep = ["--sweep", "seed=1,2", "--sweep-parallel", "1", "--wait"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp.submit", *job, *TRAINING, *sweep],
        env=clean_environ(SLOW_TASK_SLEEP_S="0.1"),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_test,
    )
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (folder / "seed=1" / "checkpoints" / "latest").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        array = next(p.name for p in (folder / "submitit").glob("*_0_submitted.pkl")).split("_")[0]
        own, nodes = element(f"{array}_0")
        # The batch shell runs on the element's first node. Frozen first, so that it cannot record the node's
        # failure itself in the moment before Slurm ends it (then its own `end` would decide, as it should).
        frozen = freeze(own, nodes[0], batch_too=True)
        assert frozen, f"nothing of element {array}_0 (job {own}) on {nodes[0]}"
        take_away(nodes[0], taken_away)
        kill(frozen)
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out
    lost, finished = attempts.read(folder / "seed=1")
    assert (lost.job, lost.outcome, lost.node, lost.decision) == (
        f"{array}_0",
        "node_fail",
        nodes[0],
        "requeue",
    )
    assert nodes[0] not in finished.nodes and (finished.outcome, finished.decision) == ("completed", "done")
    assert finished.resumed_from is not None and finished.resumed_from >= 4, out
    assert f"[sweep] trial seed=1 (job {array}_0): attempt 1 node_fail on {nodes[0]}" in out, out
    assert f"requeued job {array}_0; it will not run on {nodes[0]}" in out, out
    (only,) = attempts.read(folder / "seed=2")
    assert (only.job, only.outcome) == (f"{array}_1", "completed"), out
    rows = {line.split()[0]: line for line in out[out.index("trial  ") :].splitlines()[1:]}
    assert rows["seed=1"].split()[1] == "finished" and rows["seed=2"].split()[1] == "finished", out
