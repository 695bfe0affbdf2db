"""On the real local Slurm cluster (3 emulated nodes): recovering inside the allocation (--spare-nodes, issue 35).

Three jobs, each one job id from start to end, several steps, never requeued (sacct: no REQUEUED record):

- `submit --wait`, ddp, 2 nodes x 1 task + 1 spare, snapshots in memory every step (issue 45). The first
  step runs on node2,node3 (the batch shell's node1 is the spare); the node that hosts rank 0 and the
  rendezvous, node2, is set DOWN mid-step, its snapshot folder deleted (its memory lost). The batch
  shell starts a second step on node1,node3, whose rank 0 (and rendezvous host) is node1. Its rank on node3 is
  then SIGKILLed (the OOM killer, say): a third step on the same nodes, no spare needed; the run ends bitwise
  equal to an uninterrupted one.
- `sbatch slurm/ddp.sbatch`, fsdp, 2 nodes x 1 task + 1 spare, --min-nodes 1: node3's task raises a GPU ECC
  error (blamed: the spare node1 replaces it), then node1's does (no spare left: the job goes on in place on
  node2 alone, 1 rank instead of 2, its sharded checkpoint resharded). One task a node: the claims are the
  nodes', and every rank start costs seconds of CPU importing torch.
- `submit --wait`, 2 nodes x 1 task + 1 spare, rank 1 SIGKILLed at every start: restarted in place on the same
  nodes (no spare spent), then, the same death without a newer checkpoint, stopped as a crash loop as a job
  without spares is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import DETERMINISTIC_2X1, clean_environ, die_with_test
from test_launch_slurm_submit import DDP_SBATCH, HANG_GUARD_S, sacct_records, start_submit, wait_job
from test_launch_slurm_survive import job_nodes, take_away, taken_away, wait_all_idle

from hpc_ddp import exitcodes
from hpc_ddp.ledger import attempts
from hpc_ddp.run.records import reached

__all__ = ["taken_away"]  # a fixture, imported for the tests below

# Measured: 29 s and 19 s (load 7), 49 s for the file; 77 s at load 16. The crash loop: 7 s (quiet).
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.deadline(300)]

TRAINING = [*DETERMINISTIC_2X1, "--save-every-steps", "4"]  # 48 steps, a checkpoint every 4


def start_reference(folder: Path) -> subprocess.Popen[str]:
    """The same 2 x 1 run, uninterrupted, here (`submit --local`: the same two ranks, gloo), in the background
    while the job runs."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpc_ddp.submit",
            "--local",
            "--nodes",
            "2",
            "--folder",
            str(folder),
            *TRAINING,
        ],
        env=clean_environ(SLOW_TASK_SLEEP_S="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )


def trained_after_restart(metrics: Path) -> bool:
    """A step record after the second start record: the step restarted in place has committed a step."""
    starts, lines = 0, metrics.read_text().splitlines() if metrics.is_file() else []
    for line in lines:
        try:
            event = json.loads(line).get("event")
        except ValueError:
            continue
        starts += event == "start"
        if starts >= 2 and event == "step":
            return True
    return False


def kill_tasks(job_id: str, node: str, step: str) -> list[int]:
    """SIGKILL the tasks of step `step` of the job on `node` (an emulated node's processes all run here: their
    environment names it); returns their pids."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            env = dict(
                item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item
            )
        except (OSError, ValueError):
            continue
        if (env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME"), env.get("SLURM_STEP_ID")) == (
            job_id,
            node,
            step,
        ):
            pids.append(int(entry.name))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def test_losing_rank_0s_node_brings_the_spare_in_without_a_requeue_bitwise_equal(
    slurm_cluster: str, tmp_path: Path, taken_away: list[str]
) -> None:
    """With --snapshot-every-steps 1 (issue 45): node2 loses its memory with it (its snapshot folder deleted),
    so rank 0's state comes from its buddy's replica on node3; each restart resumes at most 2 steps behind,
    and nothing is left in memory at the end."""
    wait_all_idle()  # the job gets node[1-3], its batch shell on node1
    folder, shm = tmp_path / "run", tmp_path / "shm"
    # Snapshots every step, checkpoints every 12 (48 steps): a node lost at step 14 finds memory newer.
    snapshots = ("--snapshot-every-steps", "1", "--save-every-steps", "12")
    proc, job_id = start_submit(
        folder,
        *TRAINING,
        *snapshots,
        "--spare-nodes",
        "1",
        SLOW_TASK_SLEEP_S="0.15",
        HPC_DDP_SNAPSHOT_DIR=str(shm),
    )
    reference = start_reference(tmp_path / "reference")
    deadline = time.monotonic() + HANG_GUARD_S
    while not (folder / "checkpoints" / "latest").is_file():  # the first checkpoint, at step 12
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    assert job_nodes(job_id) == ["node1", "node2", "node3"]
    (first,) = attempts.read(folder)
    assert first.nodes == ("node2", "node3"), first  # rank 0 on node2; node1, the batch shell's, is the spare
    while (reached.read(folder) or (0, 0.0))[0] < 14:  # step 13's snapshot is whole, newer than the disk's
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    take_away("node2", taken_away)
    # The second step training (its first step committed): its rank on node3 SIGKILLed (the OOM killer, say)
    deadline = time.monotonic() + HANG_GUARD_S
    while not trained_after_restart(folder / "metrics.jsonl"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    # A lost machine loses its memory (node2's tasks are gone by now: nothing writes there any more)
    shutil.rmtree(shm / job_id / "node2", ignore_errors=True)
    assert kill_tasks(job_id, "node3", "1"), "no task of the second step found on node3"
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out
    lost, killed, finished = attempts.read(folder)
    assert (lost.outcome, lost.node, lost.decision) == ("node_fail", "node2", "restart"), out
    assert (lost.left, lost.spares_in, lost.restart) == (("node2",), ("node1",), 0), out
    # restarted in place on the same nodes: node3 blamed as ever (a requeue would avoid it), no node left
    assert (killed.nodes, killed.reason, killed.decision) == (
        ("node1", "node3"),
        "rank 1 was killed by SIGKILL",
        "restart",
    ), out
    assert (killed.left, killed.spares_in, killed.restart) == ((), (), 1000), out
    assert "(node3 kept: a SIGKILL is no sign of bad hardware)" in out, out
    assert (finished.nodes, finished.outcome, finished.restart) == (("node1", "node3"), "completed", 2000), (
        out
    )
    assert finished.job == job_id and finished.resumed_from is not None and finished.resumed_from >= 13
    assert (
        "in place on node1,node3 (node2 left, spare node1 in, 0 spare(s) left)" in out
        and "Process 0 initialized on node1" in out  # the new step's rank 0, and its rendezvous host
    ), out
    # --wait says it: the new step's start, then what the restart cost, at its first step
    assert "[submit] attempt 2 on node1,node3 (restart in place 1): resumed from step" in out, out
    said = re.search(
        rf"\[submit\] restart in place 1 of job {job_id} \(node2 left, spare node1 in\): ([0-9.]+) s from the "
        "failure of attempt 1 to the first step of attempt 2, without leaving the allocation",
        out,
    )
    assert said and 0 < float(said.group(1)) < HANG_GUARD_S, out  # a figure, not a target: the bench times it
    assert "REQUEUED" not in sacct_records(job_id), out
    assert sacct_records(job_id)[-1] == "COMPLETED", out
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in records if r.get("event") == "resume"]
    assert len(resumes) == 2 and all(r["lost_steps"] is not None and r["lost_steps"] <= 2 for r in resumes), (
        resumes
    )
    # node2's memory is gone: rank 0's state from its buddy's replica on node3, at both restarts
    assert [(r["from"], r["from_buddies"], r["lost_nodes"]) for r in resumes[:1]] == [
        ("memory", [0], ["node2"])
    ]
    assert resumes[1]["from"] == "memory" and resumes[0]["step"] <= resumes[1]["step"], resumes
    assert finished.resumed_from == resumes[1]["step"]
    assert list(shm.rglob("*")) == [], list(shm.rglob("*"))  # nothing left in memory
    ref_out, _ = reference.communicate(timeout=HANG_GUARD_S)
    assert reference.returncode == 0, ref_out
    want = torch.load(tmp_path / "reference" / "model.pth", weights_only=True)
    got = torch.load(folder / "model.pth", weights_only=True)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_gpu_error_takes_the_spare_then_with_none_left_min_nodes_goes_on_in_place(
    slurm_cluster: str, tmp_path: Path
) -> None:
    wait_all_idle()
    folder = tmp_path / "run"
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--partition={slurm_cluster}", "--nodes=3", "--gpus-per-node=0"]
        + ["--ntasks-per-node=1", "--cpus-per-task=1", str(DDP_SBATCH), "--folder", str(folder)]
        + [
            "--task",
            "retry_tasks:node_fault",
            "--epochs",
            "2",
            "--strategy",
            "fsdp",
            "--save-every-steps",
            "2",
        ]
        + ["--allow-resize", "--min-nodes", "1", "--spare-nodes", "1"],
        cwd=tmp_path,
        env=clean_environ(
            PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", RETRY_BAD_NODE="node3,node1"
        ),
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    assert wait_job(job_id) == "COMPLETED"
    log = (tmp_path / f"hpc_ddp-{job_id}.out").read_text()
    records = sacct_records(job_id)
    assert "REQUEUED" not in records and records[-1] == "COMPLETED", (records, log)
    gpu, shrunk, finished = attempts.read(folder)
    assert {a.job for a in (gpu, shrunk, finished)} == {job_id}
    assert [a.restart for a in (gpu, shrunk, finished)] == [0, 1000, 2000]
    # node3's GPU: blamed, the spare (node1, the batch shell's) takes its place, same world size
    assert gpu.nodes == ("node2", "node3") and gpu.reason.endswith("uncorrectable ECC error encountered")
    assert (gpu.node, gpu.blamed, gpu.decision, gpu.left, gpu.spares_in) == (
        "node3",
        True,
        "restart",
        ("node3",),
        ("node1",),
    ), log
    # node1's GPU: no spare left; --min-nodes 1 goes on with node2 alone, in place
    assert shrunk.nodes == ("node1", "node2")
    assert (shrunk.node, shrunk.decision, shrunk.left, shrunk.spares_in) == (
        "node1",
        "restart",
        ("node1",),
        (),
    )
    assert "--min-nodes 1: it goes on with the 1 usable node(s) left of the 2 it ran on" in log, log
    assert "--allow-resize: the checkpoint of 2 ranks is resharded onto 1" in log, log
    assert (finished.nodes, finished.outcome, finished.exclude) == (
        ("node2",),
        "completed",
        ("node3", "node1"),
    )
    starts = [
        r
        for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
        if r["event"] == "start"
    ]
    assert [s["world_size"] for s in starts] == [2, 2, 1]
    weights = torch.load(folder / "model.pth", weights_only=True)
    model = torch.nn.Linear(10, 1)
    model.load_state_dict(weights)  # the plain model's full state dict, whole
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_a_rank_sigkilled_again_after_its_restart_in_place_is_a_crash_loop_that_stops(
    slurm_cluster: str, tmp_path: Path
) -> None:
    wait_all_idle()
    folder = tmp_path / "run"
    task = ("--task", "slurm_tasks:sigkilled_at_start", "--max-restarts", "5")
    proc, job_id = start_submit(folder, *DETERMINISTIC_2X1, *task, "--spare-nodes", "1")
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == exitcodes.FAILED, out
    first, second = attempts.read(folder)
    assert {first.job, second.job} == {job_id} and [first.restart, second.restart] == [0, 1000], out
    # a SIGKILL spends no spare: the same nodes again, node3 kept although blamed
    assert (first.nodes, first.reason, first.decision, first.left, first.spares_in) == (
        ("node2", "node3"),
        "rank 1 was killed by SIGKILL",
        "restart",
        (),
        (),
    ), out
    assert (second.nodes, second.reason, second.decision) == (
        ("node2", "node3"),
        "rank 1 was killed by SIGKILL",
        "stop",
    ), out
    assert "crash loop: attempt 2 failed with the same error as attempt 1 and no newer checkpoint" in out, out
    # no rank started (no start record): the record keeps the nodes the batch shell placed the steps on
    assert (
        "attempt 1 on node2,node3: from the start; failed: rank 1 was killed by SIGKILL -> restart" in out
    ), out
    assert "REQUEUED" not in sacct_records(job_id), out
