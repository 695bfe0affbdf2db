"""On the real local Slurm cluster (env/slurm/cluster.sh): submit, sbatch, preemption, failure, cancel, time limit.

Every job is real: sbatch, srun across the emulated nodes node1/node2, gloo between them, sacct, scontrol
requeue. Each test has its own run folder. Runs are tiny; the bitwise comparison of a preempted run with an
uninterrupted one shares the uninterrupted run with the basic submit test (`reference`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import workers
from conftest import DATA, ROOT, clean_environ, die_with_test

from hpc_ddp import exitcodes
from hpc_ddp.launch.slurm import submitter
from hpc_ddp.ledger import attempts
from hpc_ddp.scheduler.slurm import states
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.states import JobState

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.deadline(120)]  # 10-21 s each (measured)

DDP_SBATCH = ROOT / "slurm" / "ddp.sbatch"
HANG_GUARD_S = 600  # only against a hung job; no assertion depends on time
# slow_tasks:slow has dropout and momentum: a resume is bitwise equal only if RNG, optimizer and data
# position all come back. 512 samples / 4 ranks / batch 32 = 4 steps per epoch.
DETERMINISTIC = ["--task", "slow_tasks:slow", "--deterministic", "--save-every-epochs", "0", "--epochs", "12"]
FINAL_STEP = 48


def submit_argv(folder: Path | None, *args: str) -> list[str]:
    """`submit` on 2 x 2, in `folder` (None: its default folder, under the working directory)."""
    where = ["--folder", str(folder)] if folder is not None else []
    return [
        sys.executable,
        "-m",
        "hpc_ddp.submit",
        "--nodes",
        "2",
        "--tasks-per-node",
        "2",
        "--time",
        "10",
    ] + [*where, *args]


def run_submit(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        submit_argv(folder, *args),
        env=env or clean_environ(),
        capture_output=True,
        text=True,
        check=False,
        timeout=HANG_GUARD_S,
        preexec_fn=die_with_test,
    )


def start_submit(
    folder: Path | None, *args: str, cwd: Path | None = None, **env: str
) -> tuple[subprocess.Popen[str], str]:
    """`submit --wait` in the background; returns it and the job id from its first line."""
    proc = subprocess.Popen(
        submit_argv(folder, *args, "--wait"),
        cwd=cwd,
        env=clean_environ(**env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_test,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    match = re.match(r"Submitted job (\d+):", first)
    assert match, first + proc.communicate()[0]
    return proc, match.group(1)


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen[str]) -> None:
    """Until `needle` appears in the log at `path` (fails if the submitter ends first)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while needle not in submitter._read(path):
        assert proc.poll() is None, f"{needle!r} never appeared:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{needle!r} never appeared in {path}"
        time.sleep(0.1)


CLIENT = SlurmClient()


def job_state(job_id: str) -> JobState | None:
    """The job's current run as accounting has it, else as the controller has it."""
    history = CLIENT.history(job_id)
    if history is not None:
        return history.current
    info = CLIENT.job(job_id)
    return info.state if info is not None and not info.gone else None


def wait_job(job_id: str) -> str:
    """Until the job has ended and its last process is gone (the controller says so); its final state."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        info, state = CLIENT.job(job_id), job_state(job_id)
        if info is not None and (info.gone or info.state.done) and state is not None and state.done:
            return state.state
        assert time.monotonic() < deadline, f"job {job_id} still {state}"
        time.sleep(0.5)


def sacct_records(job_id: str, settle_s: float = 60) -> list[str]:
    """Every record of an ended job, requeued runs included: e.g. ['REQUEUED', 'COMPLETED'].

    slurmctld sends a job's end to slurmdbd on its own time, so accounting may lag the controller that said the
    job is over: read again, up to `settle_s`, until the last record ends a run (states.Kind.terminal). A job
    cancelled on its way back to pending (the batch shell's stop after Slurm requeued it) never gets a record
    after its last REQUEUED one: settled once the controller says the job is over (waiting the whole
    `settle_s` for it cost a minute)."""
    deadline = time.monotonic() + settle_s
    while True:
        out = subprocess.run(
            ["sacct", "-X", "-D", "-n", "-P", "-o", "State", "-j", job_id],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        records = [line.split()[0] for line in out.splitlines() if line.strip()]
        settled = bool(records) and states.meaning(states.state_word(records[-1])).kind.terminal
        if records and records[-1] == "REQUEUED":
            info = CLIENT.job(job_id)
            settled = info is not None and (info.gone or info.state.done)
        if settled or time.monotonic() >= deadline:
            return records
        time.sleep(0.5)


def rank_logs(folder: Path, job_id: str) -> list[str]:
    return [submitter._read(submitter.log_path(folder, job_id, rank)) for rank in range(4)]


def placements(logs: list[str]) -> dict[int, str]:
    """{rank: host} from the 'Process R initialized on HOST' lines."""
    found = {}
    for text in logs:
        for rank, host in re.findall(r"Process (\d+) initialized on (\S+) ", text):
            found[int(rank)] = host
    return found


def losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"^Epoch \d+, Loss: ([\d.]+)$", text, re.MULTILINE)]


def tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in tensors(value, f"{prefix}/{key}").items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


def final_checkpoint(folder: Path) -> dict[str, Any]:
    latest = (folder / "checkpoints" / "latest").read_text().strip()
    return torch.load(folder / "checkpoints" / Path(latest).name, weights_only=True)


# ----- submit --wait, from inside a (pretend) job ------------------------------------------------------


@pytest.fixture(scope="module")
def reference(
    slurm_cluster: str, tmp_path_factory: pytest.TempPathFactory, time_limit_job: dict[str, Any]
) -> dict[str, Any]:
    """One uninterrupted 2 x 2 deterministic run, submitted from an environment that carries another job's
    variables (the real ones of a batch shell on this cluster, plus stale ones srun would read).
    (`time_limit_job` is requested only to start that job first.)"""
    folder = tmp_path_factory.mktemp("reference") / "run"
    standin = tmp_path_factory.mktemp("apptainer")
    (standin / "bin").mkdir()
    (standin / "bin" / "apptainer").write_text(STANDIN_APPTAINER.replace("{record}", str(standin)))
    (standin / "bin" / "apptainer").chmod(0o755)
    outer = {
        **clean_environ(SLOW_TASK_SLEEP_S="0", PATH=f"{standin / 'bin'}:{os.environ['PATH']}"),
        "SLURM_CPUS_PER_TASK": "3",
        "SRUN_CPUS_PER_TASK": "3",
        "SLURM_HPC_DDP_CANARY": "outer",
        "MASTER_PORT": "1",
    }
    outer.update(json.loads((DATA / "slurm_env" / "batch_2x2.json").read_text()))
    # Except SLURM_CONF: a site's, not a job's (hpc_ddp.cluster.env.SITE_VARS); the recorded one names the
    # machine's first cluster, and this module may run on the second (tests/workers.py, conftest's slurm_cluster).
    if "SLURM_CONF" in os.environ:
        outer["SLURM_CONF"] = os.environ["SLURM_CONF"]
    args = [
        *DETERMINISTIC,
        "--partition",
        slurm_cluster,
        "--setup",
        f"source {Path(sys.executable).parent / 'activate'}",  # the python the tasks run (issue 21)
        "--setup",
        f"env | grep -E '^(SLURM|SRUN|MASTER)_' | sort > {folder}/batch_env.txt",
        "--apptainer",
        IMAGE,
    ]
    proc = run_submit(folder, *args, "--wait", env=outer)
    printed = run_submit(folder, *args, "--print-sbatch", env=outer)
    records = [p.read_text().splitlines() for p in sorted(standin.glob("args.*"))]
    return {"folder": folder, "proc": proc, "outer": outer, "printed": printed.stdout, "apptainer": records}


IMAGE = "/images/hpc ddp.sif"
# A stand-in for Apptainer on the job's PATH: it records its arguments and the python it finds, then runs the
# command as `apptainer exec` would in an image whose python is the host's (the real one needs an image).
STANDIN_APPTAINER = """#!/bin/bash
{ printf '%s\\n' "$@"; echo "SLURM_PROCID=${SLURM_PROCID:-}"; echo "python=$(command -v python)"; } > "{record}/args.$$"
[[ $1 == exec ]] || { echo "stand-in apptainer: expected exec, got $1" >&2; exit 2; }
shift
while [[ $1 == -* ]]; do case $1 in --bind|-B) shift 2 ;; *) shift ;; esac; done
shift  # the image
exec "$@"
"""


def test_submit_wait_runs_4_ranks_on_2_nodes(reference: dict[str, Any]) -> None:
    proc, folder = reference["proc"], reference["folder"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.match(r"Submitted job (\d+):", proc.stdout).group(1)  # type: ignore[union-attr]
    assert placements(rank_logs(folder, job_id)) == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    if workers.second_cluster(Path(__file__)):  # the job went to that cluster (conftest's slurm_cluster)
        assert int(job_id) >= 12000, job_id  # its ids start there (env/slurm/cluster.sh FIRST_JOB_ID_BESIDE)
    assert f"Model saved by rank 0 to {folder / 'model.pth'}" in proc.stdout
    assert list(folder.rglob("model.pth")) == [folder / "model.pth"]
    curve = losses(proc.stdout)  # --wait showed rank 0's log
    assert len(curve) == 12 and curve[-1] < curve[0]
    assert proc.stdout.rstrip().endswith(f"[submit] job {job_id} completed; run folder {folder}")
    assert sacct_records(job_id) == ["COMPLETED"]
    # Issue 23: accounting said PENDING after the controller had it running, and --wait said "requeued".
    assert "requeued" not in proc.stdout
    # What was submitted is what --print-sbatch shows, its last line ended (issue 23).
    assert (folder / "submitit" / f"{job_id}_submission.sh").read_text() == reference["printed"]
    assert reference["printed"].endswith("\nexit $?\n")
    assert folder.stat().st_mode & 0o777 == 0o700


def test_the_tasks_ran_in_the_apptainer_image_with_the_python_the_setup_lines_chose(
    reference: dict[str, Any],
) -> None:
    """Issue 21 item 2: `--setup 'source <venv>/bin/activate' --apptainer IMAGE`: every task ran through
    `apptainer exec --nv --bind <run folder> IMAGE python ...` (a stand-in that records its arguments and runs
    the rest), and `python` there is the one the setup line put first on PATH, not the submitter's path."""
    folder, records = reference["folder"], reference["apptainer"]
    assert reference["proc"].returncode == 0, reference["proc"].stdout
    assert len(records) == 4, records
    ranks = set()
    for record in records:
        assert record[:9] == [
            "exec",
            "--nv",
            "--bind",
            str(folder),
            IMAGE,
            "python",
            "-u",
            "-m",
            "hpc_ddp.launch.slurm.start",
        ], record
        found = dict(line.split("=", 1) for line in record if line.startswith(("SLURM_PROCID=", "python=")))
        ranks.add(found["SLURM_PROCID"])
        assert Path(found["python"]).parent == Path(os.path.realpath(Path(sys.executable).parent)), found
    assert ranks == {"0", "1", "2", "3"}
    assert (
        "# hpc_ddp: the tasks run `python` from the image's PATH, in the Apptainer image"
        in reference["printed"]
    )


def test_a_job_submitted_from_a_job_gets_none_of_its_variables(reference: dict[str, Any]) -> None:
    job_env = dict(
        line.split("=", 1) for line in (reference["folder"] / "batch_env.txt").read_text().splitlines()
    )
    assert job_env["SLURM_CONF"] == reference["outer"]["SLURM_CONF"]
    assert job_env["SLURM_JOB_ID"] != reference["outer"]["SLURM_JOB_ID"]
    assert job_env["SLURM_JOB_NAME"] == "hpc_ddp"
    for leaked in ("SLURM_HPC_DDP_CANARY", "SRUN_CPUS_PER_TASK", "SLURM_CPUS_PER_TASK", "MASTER_PORT"):
        assert leaked not in job_env, leaked


# ----- the static script --------------------------------------------------------------------------------


def test_ddp_sbatch_with_cpu_overrides(slurm_cluster: str, tmp_path: Path) -> None:
    """`sbatch --gpus-per-node=0 --ntasks-per-node=2 ... slurm/ddp.sbatch`; python comes from env/job.env."""
    venv_bin = str(Path(sys.executable).parent)
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "job.env").write_text(f'export PATH="{venv_bin}:$PATH"\necho "job.env sourced"\n')
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--partition={slurm_cluster}",
            "--nodes=2",
            "--gpus-per-node=0",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            str(DDP_SBATCH),
            "--folder",
            str(tmp_path / "run"),
            "--epochs",
            "3",
        ],
        cwd=tmp_path,
        env=clean_environ(PATH=path),
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    assert wait_job(job_id) == "COMPLETED"
    log = (tmp_path / f"hpc_ddp-{job_id}.out").read_text()
    assert "job.env sourced" in log and f"python {venv_bin}/python" in log
    assert "tasks per node 2(x2), 1 CPU(s) per task" in log
    assert placements([log]) == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    assert list((tmp_path / "run").rglob("model.pth")) == [tmp_path / "run" / "model.pth"]
    assert "Model saved by rank 0" in log
    curve = losses(log)
    assert len(curve) == 3 and curve[-1] < curve[0]


@pytest.mark.deadline(240)  # 55 s measured
def test_ddp_sbatch_requeues_for_tasks_without_scontrol_in_their_run_folder(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Tasks that cannot run scontrol leave "mode": "exit" in preempted.json and the batch shell requeues. It
    must find that file where the tasks put it: here their default runs/<job id>, under the working directory
    srun gives them from SLURM_WORKING_DIR (set where the job was submitted), not the batch shell's."""
    workdir = tmp_path / "tasks"
    workdir.mkdir()
    venv_bin = str(Path(sys.executable).parent)
    env = clean_environ(
        PATH=f"{venv_bin}:{os.environ['PATH']}", SLURM_WORKING_DIR=str(workdir), SLOW_TASK_SLEEP_S="0.1"
    )
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--partition={slurm_cluster}",
            "--nodes=2",
            "--gpus-per-node=0",
            "--ntasks-per-node=1",  # two ranks: what is checked is the batch shell's, not the ranks' number
            "--cpus-per-task=1",
            str(DDP_SBATCH),
            "--task",
            "slurm_tasks:without_scontrol",
            "--epochs",
            "20",
            "--save-every-epochs",
            "0",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    log = tmp_path / f"hpc_ddp-{job_id}.out"
    deadline = time.monotonic() + HANG_GUARD_S
    while "Epoch 0," not in submitter._read(log):  # training: 19 epochs of 0.8 s to go
        state = job_state(job_id)
        assert state is None or not state.done, submitter._read(log)
        assert time.monotonic() < deadline, f"job {job_id} never trained"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    assert wait_job(job_id) == "COMPLETED", submitter._read(log)
    assert sacct_records(job_id) == ["REQUEUED", "COMPLETED"]
    text = log.read_text()
    # Issue 33 item 10: the outcome once ("attempt 1 preempted: preempted: saved ..." before).
    assert text.count("[hpc_ddp] attempt 1 preempted: saved a checkpoint, to be resumed; requeue 1 of") == 1
    assert text.count(f"[hpc_ddp] requeued job {job_id}") == 1
    folder = workdir / "runs" / job_id
    record = json.loads((folder / "preempted.json").read_text())
    assert {k: record[k] for k in ("requeue", "signal", "mode")} == {
        "requeue": True,
        "signal": "SIGUSR2",
        "mode": "exit",
    }
    # The facts rank 0 leaves for the batch shell, which decides (issue 18).
    assert record["stop_votes"] == 0 and record["requeue_votes"] >= 1 and isinstance(record["step"], int)
    assert "Resuming from" in text and (folder / "model.pth").is_file()
    assert not (tmp_path / "runs").exists()


@pytest.mark.deadline(240)
def test_ddp_sbatch_ends_a_hung_job_with_the_verdict(slurm_cluster: str, tmp_path: Path) -> None:
    """Under srun on two nodes: rank 1 stops in its loss function; the watchdogs name it, the job ends with 76
    and the batch log says who, where and on which node, as the local launcher does."""
    venv_bin = str(Path(sys.executable).parent)
    env = clean_environ(PATH=f"{venv_bin}:{os.environ['PATH']}")
    folder = tmp_path / "run"
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--partition={slurm_cluster}",
            "--nodes=2",
            "--gpus-per-node=0",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            str(DDP_SBATCH),
            "--task",
            "hang_tasks:in_loss",
            "--hang-timeout-s",
            "5",
            "--max-restarts",
            "0",
            "--folder",
            str(folder),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    assert wait_job(job_id) == "FAILED"
    log = (tmp_path / f"hpc_ddp-{job_id}.out").read_text()
    verdict = json.loads((folder / "hang.json").read_text())
    assert verdict["culprits"] == [1] and verdict["host"] == "node1", log
    assert "[hpc_ddp] hang at step 3: rank 1 (node1, pid " in log
    assert "has been in forward and backward" in log and "ranks 0,2-3 wait for it" in log
    assert job_state(job_id).exit_code == exitcodes.HANG


# ----- preemption, failure, cancel, time limit ------------------------------------------------------------


@pytest.mark.deadline(300)  # 39-52 s, + 14-18 s for `reference` when run alone (measured)
def test_usr2_requeues_once_and_resumes_bitwise_equal(reference: dict[str, Any], tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc, job_id = start_submit(folder, *DETERMINISTIC, SLOW_TASK_SLEEP_S="0.1")
    wait_for_line(submitter.log_path(folder, job_id), "Epoch 0,", proc)  # training, 44 steps to go
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out
    assert out.count(f"[submit] job {job_id} was requeued") == 1, out  # once per requeue (issue 23)
    assert out.rstrip().endswith("completed; run folder " + str(folder))
    assert sacct_records(job_id) == ["REQUEUED", "COMPLETED"]  # requeued exactly once
    logs = rank_logs(folder, job_id)
    # hpc_ddp's handler ran, not submitit's (which would checkpoint and requeue from rank 0 alone).
    assert not any("Caught signal" in text for text in logs)
    # Rank 0 says what happened, the batch shell's `end` decides within --max-requeue (issue 18: before, rank 0
    # decided: "SIGUSR2: preempted: checkpoint saved, requeue 1 of 3").
    assert logs[0].count("SIGUSR2: preempted: checkpoint saved at step ") == 1
    assert logs[0].count("preempted: saved a checkpoint, to be resumed; requeue 1 of --max-requeue 3") == 1
    assert logs[0].count(f"requeued job {job_id}") == 1
    # Exactly one checkpoint from the preempted run, at the agreed step it resumed from; then the final one.
    resumed = re.findall(r"Resuming from (\S+) at epoch \d+, step (\d+)", logs[0])
    assert len(resumed) == 1
    path, step = Path(resumed[0][0]), int(resumed[0][1])
    assert 4 <= step < FINAL_STEP and path.name == f"ckpt-{step:08d}.pt"
    assert sorted(p.name for p in (folder / "checkpoints").glob("ckpt-*.pt")) == [
        path.name,
        f"ckpt-{FINAL_STEP:08d}.pt",
    ]
    # Each with its SHA-256 next to it (hpc_ddp.run.checkpoint), and nothing else.
    assert sorted(p.name for p in (folder / "checkpoints").glob("ckpt-*.sha256")) == [
        f"{path.name}.sha256",
        f"ckpt-{FINAL_STEP:08d}.pt.sha256",
    ]
    # Model and optimizer end bitwise equal to the uninterrupted run.
    ref = reference["folder"]
    assert_bitwise_equal(
        tensors(torch.load(folder / "model.pth", weights_only=True)),
        tensors(torch.load(ref / "model.pth", weights_only=True)),
    )
    assert_bitwise_equal(
        tensors(final_checkpoint(folder)["optimizer"]), tensors(final_checkpoint(ref)["optimizer"])
    )


def test_a_raising_task_fails_the_job_and_shows_that_ranks_error(slurm_cluster: str, tmp_path: Path) -> None:
    # --max-restarts 0: the first failure ends the job (tests/test_launch_slurm_survive.py retries). One task a
    # node (the last --tasks-per-node counts): rank 1 is node2's, and the job starts two torch imports, not four.
    proc = run_submit(
        tmp_path / "run",
        *("--tasks-per-node", "1", "--task", "slow_tasks:crash", "--epochs", "3", "--max-restarts", "0"),
        "--wait",
    )
    assert proc.returncode == 1, proc.stdout
    job_id = re.match(r"Submitted job (\d+):", proc.stdout).group(1)  # type: ignore[union-attr]
    assert (
        f"[submit] job {job_id} stopped after 1 attempt(s): rank 1 failed first (on node2): RuntimeError: boom "
        "from rank 1 (tests/slow_tasks.py:crash)" in proc.stdout
    )
    assert sacct_records(job_id) == ["FAILED"]


def test_scancel_saves_reports_cancelled_and_is_not_requeued(slurm_cluster: str, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc, job_id = start_submit(  # one task a node: two ranks are enough to save on SIGTERM together
        folder,
        "--tasks-per-node",
        "1",
        "--task",
        "slow_tasks:slow",
        "--epochs",
        "100",
        SLOW_TASK_SLEEP_S="0.05",
    )
    wait_for_line(submitter.log_path(folder, job_id), "Epoch 0,", proc)
    subprocess.run(["scancel", job_id], check=True)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)  # the guard: --wait must not hang on a cancelled job
    assert proc.returncode == 75, out
    assert f"[submit] job {job_id} was cancelled; the ranks saved a checkpoint first" in out
    assert sacct_records(job_id) == ["CANCELLED"]
    log = rank_logs(folder, job_id)[0]
    assert "SIGTERM: stopped by SIGTERM: checkpoint saved, not requeued" in log
    assert list((folder / "checkpoints").glob("ckpt-*.pt"))
    # The batch shell's line about SIGTERM comes once the tasks have ended, and says so (issue 23).
    trap = "[hpc_ddp] the batch shell got SIGTERM (scancel, a requeue or the time limit); it ends once the"
    assert log.index("checkpoint saved, not requeued") < log.index(trap), log
    assert "waiting for them" not in log


@pytest.mark.deadline(240)
def test_a_job_cancelled_while_pending_after_a_requeue_is_reported_as_cancelled_and_its_advice_resumes(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Issue 23: after a requeue the attempts record says "requeue", and --wait kept silent ~95 s before it
    reported the scancel. A 2 x 1 job: USR2, the batch shell requeues it, it is held pending, then cancelled.
    Issue 33 items 6 and 7: submitted without --folder; the same command, run again while the job waits for
    its requeue, is refused (the two would take turns on one folder); after the cancel, the command `--wait`
    advises really resumes, from the checkpoint the preemption saved."""
    args = ("--tasks-per-node", "1", "--task", "slow_tasks:slow", "--epochs", "6")
    proc, job_id = start_submit(None, *args, cwd=tmp_path, SLOW_TASK_SLEEP_S="0.2")
    folder = tmp_path / "runs" / "hpc_ddp-slow_tasks-slow"  # the command's own (issue 33 item 6)
    wait_for_line(submitter.log_path(folder, job_id), "Epoch 0,", proc)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    assert proc.stdout is not None
    seen = []
    while not (line := proc.stdout.readline()).startswith(f"[submit] job {job_id} was requeued"):
        assert line, "".join(seen)  # --wait ended before the requeue
        seen.append(line)
    subprocess.run(
        ["scontrol", "hold", job_id], check=False
    )  # it stays pending (if it has not restarted yet)
    again = subprocess.run(
        submit_argv(None, *args), cwd=tmp_path, env=clean_environ(), capture_output=True, text=True
    )
    assert again.returncode == exitcodes.USAGE, again.stdout + again.stderr
    assert f"run folder {folder} belongs to job {job_id}, still " in again.stderr  # PENDING, held
    assert "Submitted job" not in again.stdout
    subprocess.run(["scancel", job_id], check=True)
    rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    out = "".join(seen) + line + rest
    assert proc.returncode == exitcodes.PREEMPTED, out
    assert out.count("was requeued") == 1, out
    last = out.rstrip().splitlines()[-1]
    head = (
        f"[submit] job {job_id} was cancelled; the ranks saved a checkpoint first: run the same command to "
        f"resume from {folder}: "
    )
    assert last.startswith(head), out
    assert sacct_records(job_id) == ["REQUEUED", "CANCELLED"]
    command = shlex.split(last[len(head) :])
    assert command[-2:] == ["--folder", str(folder)] and "--wait" in command
    resumed = subprocess.run(
        command,
        cwd=ROOT,
        env=clean_environ(SLOW_TASK_SLEEP_S="0"),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    first = next(a for a in attempts.read(folder) if a.job == job_id)
    second = [a for a in attempts.read(folder) if a.job != job_id]
    assert len(second) == 1 and second[0].resumed_from == first.checkpoint is not None, resumed.stdout


@pytest.fixture(scope="module")
def time_limit_job(slurm_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """--time 1 (Slurm's shortest) with --signal-delay-s 5. Slurm checks time limits every 30 s and sends the
    signal at the first check that is less than 30 s before "limit - delay": here 25-55 s into a run, and
    always 30 s or more before the kill at the limit. The first run sleeps 2 s per epoch for 60 epochs, so the
    signal finds it training; the requeued run has no sleep and finishes within the 25 s before its own
    signal (under heavy load it may take one more requeue: --max-requeue 5).
    Submitted without --wait, first thing in the module, so that its wait for Slurm's clock overlaps the
    other tests (a 2 x 2 job fits on the cluster beside it). One task a node: the claim is the batch shell's
    and the ranks' agreed save, and each task is one more import of torch on a saturated machine."""
    folder = tmp_path_factory.mktemp("time_limit") / "run"
    proc = run_submit(
        folder,
        "--tasks-per-node",
        "1",
        "--time",
        "1",
        "--signal-delay-s",
        "5",
        "--task",
        "slurm_tasks:slow_until_requeued",
        "--epochs",
        "60",
        "--save-every-epochs",
        "0",
        "--max-requeue",
        "5",
        env=clean_environ(SLOW_TASK_SLEEP_S="0.25"),
    )
    assert proc.returncode == 0, proc.stderr
    job_id = re.match(r"Submitted job (\d+):", proc.stdout).group(1)  # type: ignore[union-attr]
    yield {"folder": folder, "proc": proc, "job_id": job_id}
    state = job_state(job_id)
    if state is not None and not state.done:  # a failed or deselected test must not leave it running
        subprocess.run(["scancel", job_id], check=False)


@pytest.mark.deadline(300)  # 1 s after the others (its job runs meanwhile); alone, Slurm's clock: 60-90 s
def test_time_limit_signal_checkpoints_requeues_and_finishes(time_limit_job: dict[str, Any]) -> None:
    proc, job_id = time_limit_job["proc"], time_limit_job["job_id"]
    log = submitter.log_path(time_limit_job["folder"], job_id)
    assert (
        f"tail -F {log}" in proc.stdout and f"sacct -j {job_id}" in proc.stdout
    )  # what it says without --wait
    assert wait_job(job_id) == "COMPLETED"
    records = sacct_records(job_id)
    assert records[-1] == "COMPLETED" and records.count("REQUEUED") >= 1, records
    text = submitter._read(log)
    assert "SIGUSR2: preempted: checkpoint saved at step " in text
    assert "preempted: saved a checkpoint, to be resumed; requeue 1 of --max-requeue 5" in text  # the batch
    # shell's decision (issue 18)
    assert "Resuming from" in text and "Model saved by rank 0" in text
    assert "TIMEOUT" not in records


def test_a_container_image_without_pyxis_stops_at_once_naming_pyxis(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Issue 33 item 9: this cluster has no pyxis, so srun refuses --container-image (exit 255) before any task
    starts. Before: requeued once, then stopped as a "crash loop (an error in the code or data)". A usage
    error: said once, naming pyxis, never requeued, exit 2."""
    image = "nvcr.io#nvidia/pytorch:24.05-py3"
    args = ("--tasks-per-node", "1", "--container-image", image, "--task", "slow_tasks:slow", "--wait")
    proc = run_submit(tmp_path / "run", *args)
    assert proc.returncode == exitcodes.USAGE, proc.stdout + proc.stderr
    job_id = re.match(r"Submitted job (\d+):", proc.stdout).group(1)  # type: ignore[union-attr]
    line = "srun does not know --container-image: the pyxis plugin (srun --container-image) is not installed"
    assert proc.stdout.count(line) == 1, proc.stdout
    assert "crash loop" not in proc.stdout and "requeued" not in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("a usage error, not retried: the line above says what to fix")
    assert sacct_records(job_id) == ["FAILED"]


# ----- Slurm says no -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--partition", "no-such-partition"],
            (
                "sbatch refused the job: invalid partition specified: "
                "no-such-partition; Invalid partition name specified. Fix: check "
                "--partition"
            ),
        ),
        (["--slurm", "no-such-option=1"], "sbatch refused the job: unrecognized option '--no-such-option=1'"),
    ],
)
def test_slurm_refusals_exit_2_with_one_line(
    slurm_cluster: str, tmp_path: Path, args: list[str], needle: str
) -> None:
    proc = run_submit(tmp_path / "run", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "run").exists()
