"""Bad input on the command line: one line naming the problem and the fix, exit code 2, no traceback.

Every case runs the real entry point in a subprocess (`python -m ...`), the way a user would. Also: `--help`
and usage errors answer without importing torch or submitit (issue 2, item 11: fast start).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, run_module

SUBMIT = "hpc_ddp.submit"
TRAIN = "hpc_ddp.train"


def assert_usage_error(proc: subprocess.CompletedProcess[str], module: str, *expected: str) -> None:
    where = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, where
    assert "Traceback" not in proc.stderr + proc.stdout, where
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, where
    assert lines[0].startswith(f"python -m {module}: error: "), where
    for text in expected:
        assert text in lines[0], where


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "not-a-dir"
    path.write_text("")
    return path


SUBMIT_CASES = [
    (["--task", "resnet"], ["--task 'resnet': unknown task", "linear, mlp", "module.path:function"]),
    (["--task", "mytasks"], ["--task 'mytasks': unknown task"]),
    (["--nodes", "0"], ["--nodes 0: must be at least 1"]),
    (["--nodes", "-3"], ["--nodes -3: must be at least 1"]),
    (["--nodes", "two"], ["argument --nodes: invalid int value: 'two'"]),
    (["--gpus-per-node", "-1"], ["--gpus-per-node -1: must be 0 (CPU job) or more"]),
    (["--tasks-per-node", "0"], ["--tasks-per-node 0: must be at least 1"]),
    (
        ["--gpus-per-node", "2", "--tasks-per-node", "3"],
        ["--tasks-per-node 3 conflicts with --gpus-per-node 2", "one task per GPU", "Drop --tasks-per-node"],
    ),
    (["--print-sbatch"], ["--print-sbatch and --wait are for Slurm jobs; drop them with --local"]),
    (["--epochs", "0"], ["--epochs 0: must be at least 1"]),
    (["--lr", "-1"], ["--lr -1.0: must be a positive number", "--lr 0.01"]),
    (["--lr", "nan"], ["--lr nan: must be a finite number"]),
    (["--batch-size", "abc"], ["argument --batch-size: invalid int value: 'abc'", "(see --help)"]),
    (["--batch-size", "0"], ["--batch-size 0: must be at least 1"]),
    (["--amp", "fp8"], ["argument --amp: invalid choice: 'fp8'"]),
    (["--resume", "auto", "--overwrite"], ["--overwrite only applies with --resume never"]),
    (["--timeout-s", "0"], ["--timeout-s 0.0: must be positive"]),
    (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (
        ["--batchsize", "32"],
        ["unrecognized arguments: --batchsize 32 (did you mean --batch-size? see --help)"],
    ),
    (["--task", "mytasks:build"], ["--task 'mytasks:build': module 'mytasks' not found in"]),
    (["--min-nodes", "3"], ["--min-nodes 3 is more than the job's 2 node(s) (--nodes)"]),
    (["--min-nodes", "1"], ["ddp's full checkpoint resumes only", "Fix: --strategy fsdp --allow-resize"]),
    (
        ["--requeue-by", "scontrol"],
        ["--requeue-by scontrol: a local run is no Slurm job", "drop --requeue-by"],
    ),
    (["--requeue-by", "slurm"], ["argument --requeue-by: invalid choice: 'slurm'"]),
]


@pytest.mark.parametrize("args, expected", SUBMIT_CASES, ids=[" ".join(a) for a, _ in SUBMIT_CASES])
def test_submit_local_bad_input(args: list[str], expected: list[str], tmp_path: Path) -> None:
    proc = run_module(SUBMIT, "--local", *args, cwd=tmp_path, timeout=60)
    assert_usage_error(proc, SUBMIT, *expected)
    assert proc.stdout == ""
    assert not (tmp_path / "runs").exists()  # nothing was started, no run folder made


def test_a_mistyped_task_function_is_refused_at_submission_before_any_rank_starts(tmp_path: Path) -> None:
    """Issue 42: `--task mytasks:buidl` started the ranks, each of which failed on it; now submit reads the
    module's source (never runs it: its first line would leave a file) and refuses it, naming the one close."""
    (tmp_path / "mytasks.py").write_text("open('ran', 'w')\n\ndef build(config):\n    pass\n")
    proc = run_module(SUBMIT, "--local", "--task", "mytasks:buidl", cwd=tmp_path, timeout=60)
    assert_usage_error(
        proc, SUBMIT, "--task 'mytasks:buidl': mytasks has no function 'buidl'; did you mean build?"
    )
    assert proc.stdout == "" and not (tmp_path / "runs").exists() and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("sub, why", [("", "File exists"), ("sub", "Not a directory")])
def test_submit_local_unwritable_folder(a_file: Path, sub: str, why: str, tmp_path: Path) -> None:
    # A path under a plain file: unwritable even for root (a read-only directory is not, for root).
    folder = a_file / sub if sub else a_file
    proc = run_module(SUBMIT, "--local", "--folder", str(folder), cwd=tmp_path, timeout=60)
    assert_usage_error(proc, SUBMIT, f"run folder {folder} is not writable ({why})", "Fix: --folder")


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs")
def test_submit_local_folder_that_even_root_cannot_write(tmp_path: Path) -> None:
    # os.access() says yes to root for any directory; only a real write tells (sysfs refuses new files).
    proc = run_module(SUBMIT, "--local", "--folder", "/sys/kernel", cwd=tmp_path, timeout=60)
    assert_usage_error(proc, SUBMIT, "run folder /sys/kernel is not writable", "Fix: --folder")


TRAIN_CASES = [
    (["--task", "resnet"], ["--task 'resnet': unknown task"]),
    (["--epochs", "0"], ["--epochs 0: must be at least 1"]),
    (["--lr", "-1"], ["--lr -1.0: must be a positive number"]),
    (["--batch-size", "abc"], ["argument --batch-size: invalid int value: 'abc'"]),
    (["--keep", "-1"], ["--keep -1: must be at least 1"]),
    (["--nodes", "2"], ["unrecognized arguments: --nodes 2"]),  # a submit flag given to the task
]


@pytest.mark.parametrize("args, expected", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_train_bad_input(args: list[str], expected: list[str], tmp_path: Path) -> None:
    proc = run_module(TRAIN, *args, cwd=tmp_path, timeout=60)
    assert_usage_error(proc, TRAIN, *expected)
    assert proc.stdout == ""


ENV_CASES = [
    # sbatch copied a stale `export WORLD_SIZE=4` from the submitting shell, no launcher around it.
    ({"WORLD_SIZE": "4"}, ["WORLD_SIZE=4 is set but no launcher is detected", "unset WORLD_SIZE"]),
    # The batch shell of a 4-task job, without srun.
    (
        {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},
        ["Slurm job 77 (SLURM_NTASKS=4) but outside srun", "srun python -m hpc_ddp.train"],
    ),
    # An srun step whose leftover RANK disagrees with Slurm.
    (
        {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": "node1",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "RANK": "0",
        },
        ["RANK=0 is set in the environment but Slurm says rank=1", "unset RANK"],
    ),
]


@pytest.mark.parametrize(
    "environ, expected", ENV_CASES, ids=["stale-world-size", "batch-shell", "stale-rank"]
)
def test_train_bad_environment(environ: dict[str, str], expected: list[str], tmp_path: Path) -> None:
    proc = run_module(TRAIN, cwd=tmp_path, env=clean_environ(**environ), timeout=60)
    assert_usage_error(proc, TRAIN, *expected)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_train_unwritable_folder(a_file: Path, tmp_path: Path) -> None:
    # Found by rank 0 after the process group is up (only rank 0 writes), then raised on every rank.
    folder = a_file / "sub"
    proc = run_module(TRAIN, "--folder", str(folder), "--epochs", "1", cwd=tmp_path, timeout=120)
    assert_usage_error(proc, TRAIN, f"run folder {folder} is not writable (Not a directory)", "Fix: --folder")


# --- fast start -------------------------------------------------------------------------------------------

PROBE = """
import json, os, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
code = None
def _exit(c):  # tasks leave with os._exit (hpc_ddp.exitcodes.leave): turned back into SystemExit to report
    raise SystemExit(c)
os._exit = _exit
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "submitit", "psutil", "numpy"})
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize("module", [SUBMIT, TRAIN])
@pytest.mark.parametrize("args, code", [(["--help"], 0), (["--epochs", "0"], 2), (["--task", "nope"], 2)])
def test_help_and_usage_errors_import_nothing_heavy(
    module: str, args: list[str], code: int, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, module, *args],
        cwd=tmp_path,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(proc.stderr.splitlines()[-1])
    assert report == {"code": code, "heavy": []}, proc.stderr
    if code == 0:
        assert proc.stdout.startswith("usage: python -m ")


@pytest.mark.parametrize("module", [SUBMIT, TRAIN])
def test_help_exits_0(module: str, tmp_path: Path) -> None:
    proc = run_module(module, "--help", cwd=tmp_path, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert "--epochs" in proc.stdout and "--folder" in proc.stdout


# --- no abbreviated long options ------------------------------------------------------------------------
# argparse takes a unique prefix by default: `--fold x` silently became `--folder x`. Refused everywhere. The
# trailing valid-but-rejected option only makes an old, abbreviating parser stop with a different error
# instead of starting a run or submitting a job.
ABBREV_CASES = [
    (TRAIN, ["--fold", "x", "--epochs", "0"]),
    (SUBMIT, ["--local", "--fold", "x", "--epochs", "0"]),
    ("hpc_ddp.doctor", ["--fold", "x", "--epochs", "0"]),
    ("hpc_ddp.bench", ["--fold", "x", "--trials", "0"]),
]


@pytest.mark.parametrize("module, args", ABBREV_CASES, ids=[m for m, _ in ABBREV_CASES])
def test_abbreviated_options_are_refused(module: str, args: list[str], tmp_path: Path) -> None:
    proc = run_module(module, *args, cwd=tmp_path, timeout=60)
    assert_usage_error(proc, module, "unrecognized arguments: --fold", "did you mean --folder?", "--help")
    assert proc.stdout == ""
    assert not (tmp_path / "x").exists()


def test_bench_hand_refuses_abbreviated_options(tmp_path: Path) -> None:
    # An internal helper of the bench (argparse's own error format), but it must not guess either.
    proc = run_module(
        "hpc_ddp.bench.hand", "--thread", "tuned", "--out", "x", "--steps", "1", cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 2 and "unrecognized arguments: --thread" in proc.stderr, proc.stderr


# --- --config files (issue 37 item 3): one line naming the key, the value or the file -------------------------
CONFIG_CASES = [
    ("batchsize = 64\n", ["unknown key 'batchsize'; the nearest option is --batch-size"]),
    ("epoch = 3\n", ["unknown key 'epoch'; the nearest option is --epochs"]),
    (
        "weight-decay = 0.1\n",
        ["unknown key 'weight-decay' (keys are this command's long options"],
    ),  # none close
    ('epochs = "ten"\n', ['epochs = "ten": --epochs takes an integer']),
    ("deterministic = 1\n", ["deterministic = 1: --deterministic takes true or false"]),
    ('amp = "fp8"\n', ['amp = "fp8": choose one of none, bf16, fp16']),
    ("[train]\nepochs = 3\n", ["[train] is a table; every option is a key at the top level"]),
    ("epochs = = 3\n", ["not valid TOML (", "line 1"]),
    ("epochs = 0\n", ["--epochs 0: must be at least 1"]),  # a value of the right kind: the usual checks
]


@pytest.mark.parametrize("text, expected", CONFIG_CASES, ids=[t.splitlines()[0] for t, _ in CONFIG_CASES])
def test_a_bad_config_file_is_one_line(text: str, expected: list[str], tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(text)
    proc = run_module(SUBMIT, "--local", "--config", "run.toml", cwd=tmp_path, timeout=60)
    assert_usage_error(proc, SUBMIT, *expected)
    assert not (tmp_path / "runs").exists()


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    proc = run_module(TRAIN, "--config", "nowhere.toml", cwd=tmp_path, timeout=60)
    assert_usage_error(proc, TRAIN, "--config nowhere.toml: cannot read it (No such file or directory)")
