"""The doctor for real: its command line, a 2 x 2 local run, srun steps, and lone ranks that must not hang.

The real runs: a healthy 2 x 2 local run with the all-reduce benchmark, a healthy 2 x 2 srun step on the local
Slurm cluster, a 2-rank srun step with an unwritable folder (every rank must exit 1), and three single
processes started together: an occupied derived port, a rank 0 whose peer never comes, and a rank 1 whose
rank 0 never comes (each must name the problem instead of hanging).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test, run_module

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.doctor.rules import PASS, WARN
from hpc_ddp.launch import local

# ---- the command line --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, args, text",
    [
        ("hpc_ddp.doctor", ["--join-timeout-s", "0"], "--join-timeout-s 0.0: must be positive"),
        ("hpc_ddp.doctor", ["--bogus"], "unrecognized arguments: --bogus"),
        ("hpc_ddp.submit", ["--local", "--collective"], "--collective is a doctor option: add --doctor"),
    ],
)
def test_usage_errors_exit_2_with_one_line(module: str, args: list[str], text: str) -> None:
    proc = run_module(module, *args, timeout=60)
    assert proc.returncode == 2 and text in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---- real runs ---------------------------------------------------------------------------------------------


def statuses(out: str) -> dict[str, str]:
    """{check name: status} from the doctor's table."""
    return {m[2]: m[1] for m in re.finditer(r"^(PASS|WARN|FAIL)  (\S+)", out, re.M)}


@pytest.mark.slow
def test_local_2x2_run_is_healthy_with_collective(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc = run_module("hpc_ddp.submit", "--local", "--doctor", "--collective", "--folder", str(folder))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "hpc_ddp doctor: 4 rank(s) on 2 node(s), 1 machine(s) seen, launcher slurm" in out
    assert all(
        re.search(rf"^\s+{r}\s+{r % 2}\s+{r // 2}\s+\S+\s+\w+\s+127\.0\.0\.1:\d+\s+cpu", out, re.M)
        for r in range(4)
    )
    found = statuses(out)
    assert set(found.values()) <= {PASS, WARN}
    assert {
        "store",
        "gpus",
        "loopback",
        "master-port",
        "shared-folder",
        "versions",
        "threads",
        "collective",
    } <= set(found)
    assert found["collective"] == PASS and "busbw = algbw * 2(n-1)/n" in out and " 4 MB " in out
    assert found["slurm"] == PASS and "--requeue-by launcher" in out  # the local launcher says so explicitly
    assert not [p for p in folder.iterdir() if p.name.startswith(".hpc_ddp-doctor")]  # markers cleaned up


def srun(partition: str, nodes: int, per_node: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "srun",
            f"-N{nodes}",
            f"--ntasks-per-node={per_node}",
            "-p",
            partition,
            sys.executable,
            "-m",
            "hpc_ddp.doctor",
            *args,
        ],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=die_with_test,
    )


@pytest.mark.slow
@pytest.mark.slurm
def test_srun_2x2_on_the_local_cluster_is_healthy(slurm_cluster: str, tmp_path: Path) -> None:
    proc = srun(slurm_cluster, 2, 2, "--folder", str(tmp_path))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "4 rank(s) on 2 node(s), 1 machine(s) seen, launcher slurm" in out  # node1, node2: one machine
    assert re.search(r"^\s+3\s+1\s+1\s+node2\s", out, re.M)
    found = statuses(out)
    assert set(found.values()) <= {PASS, WARN} and found["loopback"] == PASS and found["rank0-host"] == PASS
    assert re.search(r"PASS  slurm\s+Slurm \d+\.\d+", out)


def unwritable(tmp_path: Path) -> Path:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    return folder / "run" if not os.access(folder, os.W_OK) else Path("/sys/hpc_ddp-doctor-test")  # root


@pytest.mark.slow
@pytest.mark.slurm
def test_unwritable_folder_fails_on_every_rank(slurm_cluster: str, tmp_path: Path) -> None:
    folder = unwritable(tmp_path)
    proc = srun(slurm_cluster, 2, 1, "--folder", str(folder))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(rf"FAIL  folder\s+run folder {folder} is not writable from ranks 0-1", proc.stdout)
    assert "[rank 1] doctor: FAIL" in proc.stdout
    assert "task 0: Exited with exit code 1" in proc.stderr
    assert "task 1: Exited with exit code 1" in proc.stderr


def fake_step(job_id: str, task: int, tasks: int) -> dict[str, str]:
    """What `srun -n<tasks>` on one node gives task `task` (as the local launcher fakes it)."""
    return clean_environ(
        SLURM_JOB_ID=job_id,
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(task),
        SLURM_LOCALID=str(task),
        SLURM_NODEID="0",
        SLURM_STEP_NUM_TASKS=str(tasks),
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NODELIST="127.0.0.1",
        SLURM_STEP_TASKS_PER_NODE=str(tasks),
    )


def start(folder: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """A doctor that waits only 1 s for its peers."""
    argv = [
        sys.executable,
        "-m",
        "hpc_ddp.doctor",
        "--join-timeout-s",
        "1",
        "--folder",
        str(folder),
        "--requeue-by",
        "launcher",
    ]  # as the local launcher starts it: its job is no Slurm job
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_test
    )


@pytest.fixture(scope="module")
def lone_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Three single doctor processes at once (each pays one torch import):
    busy: the only task of a job whose derived port another process listens on;
    rank0: rank 0 of 2 whose rank 1 never starts, with an unwritable folder;
    rank1: rank 1 of 2 whose rank 0 never starts."""
    tmp = tmp_path_factory.mktemp("lone")
    busy_job, rank0_job, rank1_job = (local.fresh_job_id() for _ in range(3))
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", dist_env.port_for_job(busy_job)))
        held.listen()
        procs = {
            "busy": start(tmp / "busy", fake_step(busy_job, 0, 1)),
            "rank0": start(unwritable(tmp), fake_step(rank0_job, 0, 2)),
            "rank1": start(tmp / "r1", fake_step(rank1_job, 1, 2)),
        }
        try:
            outs = {name: p.communicate(timeout=180) for name, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    return {name: subprocess.CompletedProcess(p.args, p.returncode, *outs[name]) for name, p in procs.items()}


@pytest.mark.slow
def test_occupied_derived_port_fails_before_init(lone_runs: dict) -> None:
    proc = lone_runs["busy"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(
        r"FAIL  master-port\s+port \d+ on \S+ is already in use \(Address already in use", proc.stdout
    )
    assert "fix: find the holder with `ss -ltnp" in proc.stdout
    assert re.search(r"FAIL  store\s+not started: rank 0 cannot host it", proc.stdout)
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_rank0_names_the_rank_that_never_came_instead_of_hanging(lone_runs: dict) -> None:
    proc = lone_runs["rank0"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(
        r"FAIL  store\s+rank 1 did not reach the store at 127\.0\.0\.1:\d+ within 1 s", proc.stdout
    )
    assert re.search(r"FAIL  folder\s+run folder \S+ is not writable from rank 0", proc.stdout)


@pytest.mark.slow
def test_a_rank_whose_rank0_never_came_says_so(lone_runs: dict) -> None:
    proc = lone_runs["rank1"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(
        r"\[rank 1\] FAIL  store\s+rank 1 could not reach the store at 127\.0\.0\.1:\d+ "
        r"within 1 s \(Connection refused\)",
        proc.stdout,
    )
    assert "[rank 1]" in proc.stdout and "Traceback" not in proc.stderr
