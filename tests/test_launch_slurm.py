"""The Slurm side without a cluster: request rules, Slurm's answers, the submitter, --print-sbatch, ddp.sbatch.

Flag tables and Slurm's answers (hpc_ddp.scheduler.slurm.request), the submitter's folder, follower and report
(hpc_ddp.launch.slurm.submitter), the --print-sbatch golden file, and the consistency of `slurm/ddp.sbatch`
with what `submit` generates.

The golden file is `tests/data/golden/print_sbatch.txt`; after an intended change, regenerate it with

    HPC_DDP_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_launch_slurm.py -k golden

and review the diff.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DATA, ROOT, clean_environ, die_with_test, run_module

from hpc_ddp import exitcodes
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.slurm import follow, outcome, submitter
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.scheduler.slurm import parse, request
from hpc_ddp.scheduler.slurm.states import JobState

GOLDEN = DATA / "golden" / "print_sbatch.txt"
DDP_SBATCH = ROOT / "slurm" / "ddp.sbatch"
GOLDEN_ARGS = [
    "--nodes",
    "2",
    "--gpus-per-node",
    "4",
    "--cpus-per-task",
    "8",
    "--mem-gb",
    "64",
    "--time",
    "04:00:00",
    "--partition",
    "gpu",
    "--account",
    "proj",
    "--qos",
    "high",
    "--constraint",
    "a100",
    "--exclusive",
    "--job-name",
    "golden",
    "--folder",
    "/shared/runs/golden",
    "--setup",
    "module load cuda/12.4",
    "--setup",
    "source /shared/venv/bin/activate",
    "--slurm",
    "mail-type=END",
    "--epochs",
    "5",
    "--print-sbatch",
]


# ----- pure rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("90", 90),
        ("1", 1),
        ("04:00:00", 240),
        ("1-00:00:00", 1440),
        ("2-03:04:05", 3065),
        ("0:00:30", 1),
        ("00:01:01", 2),
        (" 60 ", 60),
    ],
)
def test_parse_time_accepts_minutes_and_slurm_format(text: str, minutes: int) -> None:
    assert request.parse_time(text) == minutes


@pytest.mark.parametrize(
    "text", ["0", "00:00:00", "1h", "90m", "1:2:3", "01:60:00", "01:00:61", "-5", "", "1-2", "1.5", "01:00"]
)
def test_parse_time_refuses_with_the_expected_forms(text: str) -> None:
    with pytest.raises(UsageError, match=r"--time"):
        request.parse_time(text)


def test_signal_delay_must_fit_in_the_time_limit() -> None:
    request.check_signal_delay(120, 60)
    request.check_signal_delay(20, 1)
    for delay, minutes in ((60, 1), (0, 10), (70000, 10_000)):
        with pytest.raises(UsageError, match="--signal-delay-s"):
            request.check_signal_delay(delay, minutes)


def test_extras_become_sbatch_options_and_may_not_shadow_our_flags() -> None:
    assert request.parse_extras(["mail-type=END", "--hold", "comment=a=b"]) == {
        "mail-type": "END",
        "hold": True,
        "comment": "a=b",
    }
    with pytest.raises(UsageError, match="set by --nodes"):
        request.parse_extras(["nodes=3"])
    for bad in ("Mail_Type=END", "x=", "=y", "two words=1"):
        with pytest.raises(UsageError, match="KEY=VALUE"):
            request.parse_extras([bad])


def test_mem_text() -> None:
    assert request.mem_text(64) == "64G"
    assert request.mem_text(1.5) == "1536M"
    with pytest.raises(UsageError):
        request.mem_text(0)


def test_a_job_inside_a_job_passes_on_nothing_of_its_own_but_the_cluster() -> None:
    """The real variables of a batch shell (captured on the local cluster), plus what srun and torch add."""
    outer = json.loads((DATA / "slurm_env" / "batch_2x2.json").read_text())
    outer.update(
        {
            "SLURM_CPUS_PER_TASK": "3",
            "SRUN_CPUS_PER_TASK": "3",
            "SLURMD_NODENAME": "node1",
            "SUBMITIT_EXECUTOR": "slurm",
            "RANK": "0",
            "MASTER_PORT": "12345",
            "TORCHELASTIC_RUN_ID": "x",
            "SBATCH_ACCOUNT": "proj",
            "PATH": "/usr/bin",
            "HOME": "/root",
        }
    )
    clean = request.submit_environ(outer)
    assert clean == {
        "SLURM_CONF": outer["SLURM_CONF"],
        "SBATCH_ACCOUNT": "proj",
        "PATH": "/usr/bin",
        "HOME": "/root",
    }


@pytest.mark.parametrize(
    "output, expected",
    [
        (
            (
                "sbatch: error: invalid partition specified: nope\n"
                "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
            ),
            (
                "sbatch refused the job: invalid partition specified: nope; Invalid partition name specified. Fix: check "
                "--partition (`sinfo -s` lists the partitions)"
            ),
        ),
        (
            "sbatch: unrecognized option '--bogus=1'\nTry \"sbatch --help\" for more information\n",
            (
                "sbatch refused the job: unrecognized option '--bogus=1'. Fix: check the --slurm option names "
                "(`sbatch --help`)"
            ),
        ),
        (
            "sbatch: error: Batch job submission failed: Invalid feature specification\n",
            (
                "sbatch refused the job: Invalid feature specification. Fix: check --constraint (`sinfo -o '%N %f'` lists "
                "node features)"
            ),
        ),
        (
            (
                "sbatch: error: Memory specification can not be satisfied\n"
                "sbatch: error: Batch job submission failed: Requested node configuration is not available\n"
            ),
            (
                "sbatch refused the job: Memory specification can not be satisfied; Requested node configuration is not "
                "available. Fix: ask for less --mem-gb than a node has (`sinfo -N -l`)"
            ),
        ),
        ("", "sbatch refused the job: no output. Fix: check the Slurm options"),
    ],
)
def test_sbatch_refusals_become_one_line(output: str, expected: str) -> None:
    assert request.sbatch_error(output) == expected


@pytest.mark.parametrize(
    "text, state, done, exit_code",
    [
        ("RUNNING|0:0\n", "RUNNING", False, 0),
        ("COMPLETED|0:0\n", "COMPLETED", True, 0),
        ("CANCELLED by 0|0:15\n", "CANCELLED", True, 0),
        ("FAILED|75:0\n", "FAILED", True, 75),
        ("REQUEUED|0:0\nPENDING|0:0\n", "PENDING", False, 0),
        ("TIMEOUT|0:1\n", "TIMEOUT", True, 0),
        # A preempted run is over (issue 18: PREEMPTED was "active" here); whether the job comes back is the
        # controller's to say (tests/test_launch_slurm_follow.py).
        ("PREEMPTED|0:0\n", "PREEMPTED", True, 0),
    ],
)
def test_parse_sacct(text: str, state: str, done: bool, exit_code: int) -> None:
    rows = "".join(f"7|{line}|None\n" for line in text.splitlines())  # JobID|State|ExitCode|Reason
    parsed = parse.parse_sacct(rows)["7"].current
    assert (parsed.state, parsed.done, parsed.exit_code) == (state, done, exit_code)


def test_parse_sacct_and_scontrol_without_an_answer() -> None:
    assert parse.parse_sacct("") == {}
    assert parse.parse_job("slurm_load_jobs error: Invalid job id specified") is None
    parsed = parse.parse_job("JobId=7 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0 X=y")
    assert parsed is not None and parsed.state == JobState("FAILED", 1, 0)


def test_the_task_entry_pickles_by_reference() -> None:
    """submitit pickles the job function; a TaskEntry must load in a task without this test's module."""
    import cloudpickle

    data = cloudpickle.dumps(submitter.TaskEntry("hpc_ddp.train", ("--epochs=1",)))
    assert b"hpc_ddp.launch.slurm.submitter" in data and b"TaskEntry" in data


def test_a_task_entry_pickled_by_0_1_0_still_loads() -> None:
    """A job submitted before the move (tests/data/taskentry-0.1.0.pkl names hpc_ddp.slurm_job.TaskEntry) runs
    the current TaskEntry when it starts or is requeued after an upgrade."""
    import pickle

    data = (DATA / "taskentry-0.1.0.pkl").read_bytes()
    assert b"hpc_ddp.slurm_job" in data
    entry = pickle.loads(data)
    assert type(entry) is submitter.TaskEntry
    assert entry == submitter.TaskEntry("hpc_ddp.train", ("--epochs", "1"))


def test_folders_are_owner_only_and_others_writable_ones_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "a" / "run"
    submitter.prepare_folder(run)
    assert run.stat().st_mode & 0o777 == 0o700
    assert (run / "submitit").stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError, match="writable by others"):
        submitter.prepare_folder(shared)


# ----- following and reporting a job (files and states faked) ------------------------------------------


def test_the_log_follower_prints_whole_lines_without_submitits_chatter(tmp_path: Path) -> None:
    log, out = tmp_path / "1_0_log.out", io.StringIO()
    follower = follow._LogFollower(log, out)
    follower.poll()  # no file yet
    log.write_text("submitit INFO (x) - Starting with JobEnvironment(...)\nEpoch 0, Loss: 1.0\nEpoch 1, Lo")
    follower.poll()
    assert out.getvalue() == "Epoch 0, Loss: 1.0\n"
    with open(log, "a") as f:
        f.write("ss: 0.5\nsubmitit WARNING (x) - Bypassing signal SIGCONT\n")
    follower.poll()
    assert out.getvalue() == "Epoch 0, Loss: 1.0\nEpoch 1, Loss: 0.5\n"


def report(tmp_path: Path, state: JobState, since: float = 0.0) -> tuple[int, str]:
    out = io.StringIO()
    code = outcome.report("7", CheckpointStore(tmp_path, Local()), 4, state, since, out)
    return code, out.getvalue()


def test_report_says_what_ended_the_job_and_picks_the_exit_code(tmp_path: Path) -> None:
    (tmp_path / "submitit").mkdir()
    assert report(tmp_path, JobState("COMPLETED")) == (
        0,
        f"[submit] job 7 completed; run folder {tmp_path}\n",
    )
    code, text = report(tmp_path, JobState("CANCELLED"))
    assert (code, text) == (1, "[submit] job 7 was cancelled (exit code 0)\n")
    (tmp_path / "preempted.json").write_text("{}")
    code, text = report(tmp_path, JobState("CANCELLED"))
    assert code == 75 and "was cancelled; the ranks saved a checkpoint first: run the same command" in text
    assert report(tmp_path, JobState("CANCELLED"), since=time.time() + 60)[0] == 1  # an older save
    code, text = report(tmp_path, JobState("FAILED", 75), since=time.time() + 60)
    assert code == 75 and "stopped after a signal and was not requeued" in text


def test_report_shows_the_error_of_the_rank_that_failed_first(tmp_path: Path) -> None:
    sub = tmp_path / "submitit"
    sub.mkdir()
    for rank in range(4):
        (sub / f"7_{rank}_log.out").write_text(
            f"Process {rank} initialized\nTraceback (most recent call last):\n  File x\n"
            + ("ValueError: the real cause\n" if rank == 2 else "RuntimeError: Connection closed by peer\n")
        )
    for rank, age in ((0, 5), (2, 10), (3, 1)):  # rank 2's error result is the oldest
        result = sub / f"7_{rank}_result.pkl"
        result.write_bytes(b"\x80\x05\x95(\x8c\x05error\x94")
        os.utime(result, (time.time() - age, time.time() - age))
    code, text = report(tmp_path, JobState("FAILED", 1))
    assert code == 1
    assert text.splitlines() == [
        "[submit] job 7 ended FAILED (exit code 1)",
        f"[submit] rank 2 failed; the end of {sub / '7_2_log.out'}:",
        "[submit]     Traceback (most recent call last):",
        "[submit]       File x",
        "[submit]     ValueError: the real cause",
    ]
    for result in sub.glob("*_result.pkl"):
        result.unlink()
    assert outcome.failing_rank("7", tmp_path, 4) == 0  # no result files: the first log with a traceback


# ----- the CLI, without a cluster ----------------------------------------------------------------------


def print_sbatch(*args: str) -> str:
    proc = run_module("hpc_ddp.submit", *args, "--print-sbatch")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def normalized(text: str) -> str:
    return text.replace(shlex.quote(sys.executable), "{python}")


def test_print_sbatch_matches_the_golden_file(tmp_path: Path) -> None:
    proc = run_module("hpc_ddp.submit", *GOLDEN_ARGS, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = normalized(proc.stdout)
    if os.environ.get("HPC_DDP_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "--print-sbatch output changed; if intended: HPC_DDP_REGEN_GOLDEN=1 pytest tests/test_launch_slurm.py -k golden"
    )
    assert not Path("/shared/runs/golden").exists() and list(tmp_path.iterdir()) == []  # submitted nothing
    assert "every task runs: python -m hpc_ddp.train --epochs=5 --folder=/shared/runs/golden" in proc.stderr


def test_print_sbatch_is_valid_bash_with_the_resource_lines(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(print_sbatch(*GOLDEN_ARGS[:-1]))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    lines = set(script.read_text().splitlines())
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=64G",
        "#SBATCH --time=240",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=a100",
        "#SBATCH --exclusive",
        "#SBATCH --job-name=golden",
        "#SBATCH --mail-type=END",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "module load cuda/12.4",
        "source /shared/venv/bin/activate",
    ):
        assert line in lines, line


def test_ddp_sbatch_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(DDP_SBATCH)], check=False).returncode == 0


def _sbatch_options(text: str) -> dict[str, str]:
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            options[key] = value
    return options


def _srun_flags(text: str) -> dict[str, str]:
    """The srun options of a script's srun line (a continued line is joined first)."""
    joined = text.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.strip().startswith("srun "))
    words = iter(shlex.split(line)[1:])
    flags = {}
    for word in words:
        if not word.startswith("--"):
            break
        key, _, value = word.partition("=")
        flags[key] = next(words) if key in ("--output", "--error") else value  # submitit's `--output PATH`
    return flags


def test_ddp_sbatch_and_print_sbatch_are_the_same_job() -> None:
    """Same defaults, signal, requeue and log mode, and the same srun flags (bar submitit's own output ones)."""
    static = DDP_SBATCH.read_text()
    generated = print_sbatch(
        "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "8", "--time", "01:00:00"
    )
    ours, theirs = _sbatch_options(static), _sbatch_options(generated)
    for key in (
        "job-name",
        "nodes",
        "gpus-per-node",
        "ntasks-per-node",
        "cpus-per-task",
        "signal",
        "requeue",
        "open-mode",
    ):
        assert ours[key] == theirs[key], key
    assert request.parse_time(ours["time"]) == int(theirs["time"])
    assert "B:" not in ours["signal"] and ours["signal"] == f"{request.SIGNAL}@120"
    static_srun, generated_srun = _srun_flags(static), _srun_flags(generated)
    for submitit_own in ("--unbuffered", "--output", "--error"):
        generated_srun.pop(submitit_own, None)
    assert static_srun.keys() == generated_srun.keys() == {"--kill-on-bad-exit", "--cpus-per-task"}
    assert static_srun["--kill-on-bad-exit"] == generated_srun["--kill-on-bad-exit"] == "1"
    assert (
        static_srun["--cpus-per-task"] == "${SLURM_CPUS_PER_TASK:-1}"
        and generated_srun["--cpus-per-task"] == "8"
    )
    # Counts come from Slurm: the srun line repeats none of them.
    assert not re.search(r"srun[^\n]*(--nodes|--ntasks|-N |-n )", static.replace("\\\n", " "))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--time", "1h"], "--time '1h': expected minutes"),
        (["--time", "0"], "at least 1 minute"),
        (["--time", "1", "--signal-delay-s", "90"], "--signal-delay-s 90 is not below --time"),
        (["--slurm", "nodes=4"], "use that flag instead"),
        (["--mem-gb", "-1"], "--mem-gb -1"),
        (["--job-name", "two words"], "--job-name"),
    ],
)
def test_bad_slurm_flags_exit_2_with_one_line(args: list[str], needle: str) -> None:
    proc = run_module("hpc_ddp.submit", "--nodes", "2", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert needle in proc.stderr


def test_no_sbatch_on_path_exits_2_with_one_line(tmp_path: Path) -> None:
    env = clean_environ(PATH=str(Path(sys.executable).parent))  # python, but no Slurm commands
    proc = run_module("hpc_ddp.submit", "--nodes", "2", "--folder", str(tmp_path / "run"), env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        (
            "python -m hpc_ddp.submit: error: sbatch not found on PATH: this machine is not a Slurm submit host. Fix: "
            "run on a login node (or load the Slurm module), use --print-sbatch to see the script, or --local"
        )
    ]
    assert not (tmp_path / "run").exists()


# ----- slurm/ddp.sbatch's own logic, with srun and scontrol faked --------------------------------------

FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun_args"
# Global rank 0 tells the batch script the run folder it resolved (hpc_ddp.run.folder.tell_folder).
printf '%s\\n' "${HPC_DDP_FOLDER_FILE:-}" > "$FAKE_DIR/folder_file"
if [[ -n ${FAKE_TELL:-} ]]; then printf '%s\\n' "$FAKE_TELL" > "$HPC_DDP_FOLDER_FILE"; fi
if [[ -n ${FAKE_RECORD:-} ]]; then mkdir -p "$FAKE_FOLDER" && printf '%s\\n' "$FAKE_RECORD" > "$FAKE_FOLDER/preempted.json"; fi
touch "$FAKE_DIR/srun_started"
while [[ -n ${FAKE_HOLD:-} && ! -e $FAKE_DIR/release ]]; do sleep 0.05; done
exit "${FAKE_STATUS:-0}"
"""


def fake_batch(
    tmp_path: Path,
    args: list[str],
    folder: Path,
    status: int,
    record: dict[str, object] | None,
    hold: bool = False,
    tell: bool = True,
    **extra_env: str,
) -> subprocess.Popen[str]:
    """Run slurm/ddp.sbatch as Slurm would run the batch shell, with a fake srun, scontrol and sinfo on PATH.
    The fake tasks write `record` to `folder`/preempted.json and, if `tell`, tell the script that folder."""
    (tmp_path / "tmp").mkdir(exist_ok=True)  # the script's TMPDIR
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    # Only the calls that act are recorded; `scontrol show job` (the batch step's look at the job) says nothing.
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[[ $1 == show ]] && exit 0\nprintf "%s\\n" "$*" >> "$FAKE_DIR/scontrol_calls"\n'
    )
    # The batch step asks which of the job's nodes are down before a requeue: none.
    (bin_dir / "sinfo").write_text('#!/bin/bash\nprintf "node1 idle\\nnode2 idle\\n"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = clean_environ(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_DIR=str(tmp_path),
        FAKE_FOLDER=str(folder),
        FAKE_STATUS=str(status),
        FAKE_RECORD=json.dumps(record) if record else "",
        FAKE_HOLD="1" if hold else "",
        FAKE_TELL=str(folder) if tell else "",
        TMPDIR=str(tmp_path / "tmp"),
        SLURM_JOB_ID="123",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_TASKS_PER_NODE="2(x2)",
        SLURM_CPUS_PER_TASK="3",
        SLURM_SUBMIT_DIR=str(tmp_path),
        **extra_env,
    )
    return subprocess.Popen(
        ["bash", str(DDP_SBATCH), *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=die_with_test,
    )


@pytest.mark.parametrize(
    "record, status, requeued",
    [
        ({"requeue": True, "signal": "SIGUSR2", "mode": "exit"}, 75, True),  # tasks could not run scontrol
        ({"requeue": True, "signal": "SIGUSR2", "mode": "scontrol"}, 75, False),  # rank 0 already requeued
        ({"requeue": False, "signal": "SIGTERM", "mode": "exit"}, 75, False),  # scancel: stays cancelled
        (None, 0, False),
        (None, 1, True),  # a failure: started again from the latest checkpoint (--max-restarts)
    ],
)
@pytest.mark.parametrize("folder_args", [["--folder", "out/a"], ["--folder=out/a"], []])
def test_ddp_sbatch_requeues_only_for_a_preempted_exit_that_asks_for_it(
    tmp_path: Path, record: dict[str, object] | None, status: int, requeued: bool, folder_args: list[str]
) -> None:
    folder = tmp_path / ("out/a" if folder_args else "runs/123")  # train's default: runs/<job id>
    proc = fake_batch(tmp_path, [*folder_args, "--epochs", "2"], folder, status, record)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    calls = tmp_path / "scontrol_calls"
    assert (calls.read_text() == "requeue 123\n") if requeued else not calls.exists()
    assert (tmp_path / "srun_args").read_text().splitlines() == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=3",
        "python",
        "-u",
        "-m",
        "hpc_ddp.train",
        *folder_args,
        "--epochs",
        "2",
    ]
    assert out.startswith(
        "[ddp.sbatch] job 123 (restart 0): 2 node(s) node[1-2], tasks per node 2(x2), 3 CPU(s)"
    )
    assert_folder_file_removed(tmp_path)


def assert_folder_file_removed(tmp_path: Path) -> None:
    """The script chose a fresh file in its TMPDIR for the tasks, and removed it at the end."""
    told = Path((tmp_path / "folder_file").read_text().strip())
    assert told.parent == tmp_path / "tmp" and told.name.startswith("hpc_ddp-123.")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_ddp_sbatch_reads_the_run_folder_the_tasks_resolved_not_its_arguments(tmp_path: Path) -> None:
    """The task may resolve its folder otherwise than the script's arguments say (an edited srun line, srun's
    working directory from SLURM_WORKING_DIR ...): preempted.json is where the task says it is."""
    record = {"requeue": True, "signal": "SIGUSR2", "mode": "exit"}
    proc = fake_batch(tmp_path, ["--folder", "out/a"], tmp_path / "elsewhere" / "b", 75, record)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert (tmp_path / "scontrol_calls").read_text() == "requeue 123\n"
    assert not (tmp_path / "out").exists()
    assert_folder_file_removed(tmp_path)


def test_ddp_sbatch_finds_the_run_folder_itself_when_the_tasks_never_told_it(tmp_path: Path) -> None:
    """The batch step resolves the tasks' options as they do (runs/<job id> by default): it still finds
    preempted.json, and requeues, when rank 0 never wrote its folder to HPC_DDP_FOLDER_FILE."""
    record = {"requeue": True, "signal": "SIGUSR2", "mode": "exit"}
    proc = fake_batch(tmp_path, [], tmp_path / "runs" / "123", 75, record, tell=False)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert (tmp_path / "scontrol_calls").read_text() == "requeue 123\n"
    assert "[hpc_ddp] attempt 1 preempted" in err
    assert_folder_file_removed(tmp_path)


def test_rank_0_tells_its_run_folder_to_the_file_ddp_sbatch_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    told = tmp_path / "folder_file"
    told.write_text("")  # ddp.sbatch makes it with mktemp
    monkeypatch.chdir(tmp_path)
    run_folder.tell_folder(Path("runs/7"), {"HPC_DDP_FOLDER_FILE": str(told)})
    assert told.read_text() == f"{tmp_path}/runs/7\n"  # absolute: the batch shell may be elsewhere
    run_folder.tell_folder(Path("runs/8"), {})  # not under ddp.sbatch: nothing to tell
    run_folder.tell_folder(Path("runs/8"), {"HPC_DDP_FOLDER_FILE": ""})
    assert told.read_text() == f"{tmp_path}/runs/7\n"


@pytest.mark.slow
def test_train_tells_the_folder_it_resolved(tmp_path: Path) -> None:
    """A real one-process `python -m hpc_ddp.train` with its default folder, runs/<job id>."""
    told = tmp_path / "folder_file"
    proc = run_module(
        "hpc_ddp.train",
        "--epochs",
        "1",
        cwd=tmp_path,
        env=clean_environ(HPC_DDP_FOLDER_FILE=str(told), SLURM_JOB_ID="4242"),
    )
    assert proc.returncode == 0, proc.stderr
    assert told.read_text() == f"{tmp_path}/runs/4242\n"
    assert (tmp_path / "runs" / "4242" / "model.pth").is_file()


def test_ddp_sbatch_keeps_waiting_for_the_tasks_after_sigterm(tmp_path: Path) -> None:
    """scancel signals the batch shell too; if it died, the job would end before the tasks had saved."""
    proc = fake_batch(
        tmp_path, [], tmp_path / "runs" / "123", 75, {"requeue": False, "mode": "scontrol"}, hold=True
    )
    while not (tmp_path / "srun_started").exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(15)
    while "SIGTERM" not in (err := proc.stderr.readline()):  # type: ignore[union-attr]
        assert err, "the trap never ran"
    assert proc.poll() is None  # still waiting for srun
    (tmp_path / "release").touch()
    assert proc.wait(timeout=60) == 75


def test_pending_reasons_that_waiting_will_not_cure_say_so() -> None:
    assert request.pending_hint("Resources") == "Resources"
    assert request.pending_hint("PartitionConfig").startswith(
        "PartitionConfig: Slurm will not start this job as asked"
    )
    assert "scancel it" in request.pending_hint("QOSMaxNodePerJobLimit")


def test_report_shows_a_hang_verdict_whatever_srun_made_of_the_exit_codes(tmp_path: Path) -> None:
    verdict = {
        "line": "hang at step 3: rank 1 (node2, pid 9) has been in data loading for 41 s",
        "run_id": "7-0",
    }
    (tmp_path / "hang.json").write_text(json.dumps(verdict))
    code, text = report(tmp_path, JobState("FAILED", 137))  # srun's code after it killed the others
    assert code == exitcodes.HANG
    assert text == (f"[submit] job 7: {verdict['line']}; every rank's report: {tmp_path / 'hang.json'}\n")
    assert report(tmp_path, JobState("FAILED", 1), since=time.time() + 60)[0] == 1  # an older verdict


def test_report_names_a_non_finite_loss_and_exits_65(tmp_path: Path) -> None:
    (tmp_path / "submitit").mkdir()
    code, text = report(tmp_path, JobState("FAILED", exitcodes.NONFINITE))
    assert code == exitcodes.NONFINITE == 65
    assert text == (
        f"[submit] job 7 stopped: the loss became NaN or infinite (exit code 65); every rank stopped "
        "before applying that update and nothing was saved after the last finite step (see the log "
        f"above). Fix: check the data, a smaller --lr or --clip-grad, then resume from {tmp_path}\n"
    )
    # A hang verdict of this submission still decides: srun's code may be anything then.
    (tmp_path / "hang.json").write_text(json.dumps({"line": "hang at step 3", "run_id": "7-0"}))
    assert report(tmp_path, JobState("FAILED", exitcodes.NONFINITE))[0] == exitcodes.HANG


@pytest.mark.parametrize(
    "env, folder_args, srun_head",
    [
        (
            {"HPC_DDP_APPTAINER": "/images/torch.sif", "HPC_DDP_SRUN_ARGS": "--mpi=pmix --network=x"},
            ["--folder", "out/a"],
            [
                "--mpi=pmix",
                "--network=x",
                "apptainer",
                "exec",
                "--nv",
                "--bind",
                "{tmp}/out/a",
                "/images/torch.sif",
            ],
        ),
        (
            {
                "HPC_DDP_CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:24.05-py3",
                "HPC_DDP_CONTAINER_MOUNTS": "/d:/d",
            },
            ["--folder=/abs/b"],
            ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3", "--container-mounts=/abs/b:/abs/b,/d:/d"],
        ),
        ({"HPC_DDP_APPTAINER": "/i.sif"}, [], ["apptainer", "exec", "--nv", "--bind", "{tmp}", "/i.sif"]),
        ({"HPC_DDP_PYTHON": "/opt/py/bin/python"}, [], []),
    ],
)
def test_ddp_sbatch_runs_the_tasks_where_its_variables_say(
    tmp_path: Path, env: dict[str, str], folder_args: list[str], srun_head: list[str]
) -> None:
    """slurm/ddp.sbatch's HPC_DDP_* variables (issue 21): the srun line it builds, with a fake srun."""
    if "HPC_DDP_PYTHON" in env:  # a pinned python: the batch steps run it too, so it must exist
        env = {"HPC_DDP_PYTHON": sys.executable}
    proc = fake_batch(tmp_path, [*folder_args, "--epochs", "2"], tmp_path / "runs" / "123", 0, None, **env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    python = env.get("HPC_DDP_PYTHON", "python")
    expected = [s.replace("{tmp}", str(tmp_path)) for s in srun_head]
    assert (tmp_path / "srun_args").read_text().splitlines() == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=3",
        *expected,
        python,
        "-u",
        "-m",
        "hpc_ddp.train",
        *folder_args,
        "--epochs",
        "2",
    ]
    if "HPC_DDP_APPTAINER" in env and folder_args:
        assert (tmp_path / "out" / "a").is_dir()  # a bind's source must exist


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"HPC_DDP_APPTAINER": "/i.sif", "HPC_DDP_CONTAINER_IMAGE": "img"}, "choose one container runner"),
        ({"HPC_DDP_CONTAINER_MOUNTS": "/d:/d"}, "HPC_DDP_CONTAINER_MOUNTS without HPC_DDP_CONTAINER_IMAGE"),
    ],
)
def test_ddp_sbatch_refuses_two_containers_with_one_line(
    tmp_path: Path, env: dict[str, str], needle: str
) -> None:
    proc = fake_batch(tmp_path, [], tmp_path / "runs" / "123", 0, None, **env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "srun_args").exists()
