"""Where a job's tasks run (issue 21 item 2): which python, which container, which extra srun options.

Unit tables for hpc_ddp.scheduler.slurm.runtime, and the lines `submit --print-sbatch` generates from them
(pyxis cannot run here: its srun line is checked as text). The real job through a stand-in `apptainer` is
tests/test_launch_slurm_submit.py::test_submit_wait_runs_4_ranks_on_2_nodes."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from conftest import run_module

from hpc_ddp.errors import UsageError
from hpc_ddp.launch.slurm import submitter
from hpc_ddp.scheduler.slurm import request, runtime

pytestmark = [pytest.mark.deadline(60)]

EXE = "/home/me/.venv/bin/python"


def rt(
    python: str | None = None,
    setup: tuple[str, ...] = (),
    image: str | None = None,
    mounts: str | None = None,
    sif: str | None = None,
    srun: tuple[str, ...] = (),
) -> runtime.Runtime:
    return runtime.check(python, setup, image, mounts, sif, srun)


@pytest.mark.unit
@pytest.mark.parametrize(
    "given, task, steps",
    [
        (rt(), EXE, EXE),  # nothing chosen: the submitting interpreter, on both sides
        (rt(setup=("source /shared/venv/bin/activate",)), "python", "python"),  # the setup lines choose
        (
            rt(python="/opt/py/bin/python", setup=("module load x",)),
            "/opt/py/bin/python",
            "/opt/py/bin/python",
        ),
        (rt(sif="/img.sif"), "python", EXE),  # the image's python; the host steps: this interpreter
        (rt(sif="/img.sif", setup=("module load apptainer",)), "python", "python"),
        (rt(image="nvcr.io/nvidia/pytorch:24.05-py3", python="/usr/bin/python3"), "/usr/bin/python3", EXE),
    ],
)
def test_which_python_the_tasks_and_the_batch_steps_run(
    given: runtime.Runtime, task: str, steps: str
) -> None:
    assert runtime.task_interpreter(given, EXE) == task
    assert runtime.batch_interpreter(given, EXE) == steps


@pytest.mark.unit
@pytest.mark.parametrize(
    "given, command, srun",
    [
        (rt(), f"{EXE} -u -m hpc_ddp.launch.slurm.start", []),
        (
            rt(sif="/images/torch 24.sif"),
            "apptainer exec --nv --bind /runs/a '/images/torch 24.sif' python -u -m hpc_ddp.launch.slurm.start",
            [],
        ),
        (
            rt(image="nvcr.io#nvidia/pytorch:24.05-py3", mounts="/data:/data:ro", srun=("--mpi=pmix",)),
            "python -u -m hpc_ddp.launch.slurm.start",
            [
                "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
                "--container-mounts=/runs/a:/runs/a,/data:/data:ro",
                "--mpi=pmix",
            ],
        ),
        (
            rt(image="img"),
            "python -u -m hpc_ddp.launch.slurm.start",
            ["--container-image=img", "--container-mounts=/runs/a:/runs/a"],
        ),
        (
            rt(srun=("--mpi=pmix", "--network=sn_all")),
            f"{EXE} -u -m hpc_ddp.launch.slurm.start",
            ["--mpi=pmix", "--network=sn_all"],
        ),
    ],
)
def test_the_task_command_and_the_extra_srun_options(
    given: runtime.Runtime, command: str, srun: list[str]
) -> None:
    assert runtime.task_command(given, EXE, "/runs/a") == command
    assert runtime.srun_options(given, "/runs/a") == srun


@pytest.mark.unit
@pytest.mark.parametrize(
    "given, needle",
    [
        (rt(), f"the tasks run {EXE}, the submitting interpreter (no --setup or --python given)"),
        (
            rt(setup=("conda activate torch",)),
            "the tasks run `python` as the setup lines leave PATH (--setup",
        ),
        (rt(python="/opt/py/bin/python"), "the tasks run /opt/py/bin/python (--python)"),
        (
            rt(sif="/img.sif"),
            f"`python` from the image's PATH, in the Apptainer image /img.sif; the batch steps run {EXE} on the host",
        ),
        (rt(image="img", setup=("x",)), "in the pyxis image img; the batch steps run `python` on the host"),
    ],
)
def test_the_script_says_which_python_in_a_comment(given: runtime.Runtime, needle: str) -> None:
    line = runtime.explain(given, EXE)
    assert line.startswith("# hpc_ddp: ") and needle in line, line


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            {"image": "a", "sif": "b"},
            "--container-image 'a' and --apptainer 'b': choose one container runner",
        ),
        ({"mounts": "/d:/d"}, "--container-mounts '/d:/d' without --container-image"),
        ({"python": " "}, "--python is empty"),
        ({"srun": ("mpi=pmix",)}, "--srun-arg 'mpi=pmix': expected an srun option"),
        ({"srun": ("--output=x",)}, "--output is the kit's: one log per task"),
        ({"srun": ("--cpus-per-task=4",)}, "--cpus-per-task is set by --cpus-per-task"),
        ({"srun": ("--container-image=x",)}, "is set by --container-image"),
        # Issue 33 item 10: a short option with its value glued on, as srun reads it.
        ({"srun": ("-c2",)}, "--srun-arg '-c2': -c is set by --cpus-per-task"),
        ({"srun": ("-otask.log",)}, "-o is the kit's: one log per task"),
        ({"srun": ("-K1",)}, "-K is the kit's"),
    ],
)
def test_bad_combinations_are_usage_errors(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=None) as caught:
        rt(**kwargs)  # type: ignore[arg-type]
    assert needle in str(caught.value)


def srun_line(text: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return shlex.split(line)


@pytest.mark.unit
def test_a_pyxis_job_passes_the_image_and_mounts_to_srun(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    req = request.SlurmRequest(
        2,
        4,
        gpus_per_node=4,
        minutes=10,
        signal_delay_s=120,
        job_name="hpc_ddp",
        cpus_per_task=8,
        runtime=rt(image="nvcr.io#nvidia/pytorch:24.05-py3", mounts="/data:/data", srun=("--mpi=pmix",)),
    )
    text = submitter.sbatch_text(req, folder, "hpc_ddp.train", (f"--folder={folder}",))
    argv = srun_line(text)
    assert argv[argv.index("--kill-on-bad-exit=1") :] == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=8",
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts={folder}:{folder},/data:/data",
        "--mpi=pmix",
        "python",
        "-u",
        "-m",
        "hpc_ddp.launch.slurm.start",
        "-u",
        "-m",
        "submitit.core._submit",
        str(folder / "submitit"),
    ]
    assert "# hpc_ddp: the tasks run `python` from the image's PATH, in the pyxis image" in text


@pytest.mark.process
def test_submit_print_sbatch_with_apptainer_and_srun_args(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc = run_module(
        "hpc_ddp.submit",
        "--print-sbatch",
        "--folder",
        str(folder),
        "--apptainer",
        "/images/torch.sif",
        "--srun-arg=--mpi=pmix",
        "--setup",
        "module load apptainer",
    )
    assert proc.returncode == 0, proc.stderr
    argv = srun_line(proc.stdout)
    tail = argv[argv.index("--kill-on-bad-exit=1") :]
    assert tail[:10] == [
        "--kill-on-bad-exit=1",
        "--mpi=pmix",
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        str(folder),
        "/images/torch.sif",
        "python",
        "-u",
    ]
    # The batch steps run on the host with the python the setup lines leave.
    assert "\nstep=$(python -m hpc_ddp.launch.slurm.batch begin " in proc.stdout


@pytest.mark.process
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--container-image", "a", "--apptainer", "b.sif"], "choose one container runner"),
        (["--container-mounts", "/d:/d"], "without --container-image"),
        (["--srun-arg", "pmix"], "expected an srun option"),
    ],
)
def test_bad_combinations_exit_2_with_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_module("hpc_ddp.submit", "--print-sbatch", "--folder", str(tmp_path / "run"), *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert needle in proc.stderr
