"""The launcher's options, typed and checked once (hpc_ddp.launch.options): a table of flags and what they
give, or the one line that refuses them (pure: the parser and the checks, nothing started)."""

from __future__ import annotations

import pytest

from hpc_ddp.errors import UsageError
from hpc_ddp.launch import options
from hpc_ddp.submit import build_argparser

pytestmark = pytest.mark.unit


def read(*argv: str) -> tuple[options.LaunchOptions, object]:
    return options.read(build_argparser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--nodes", "0", "--collective"], r"--nodes 0: must be at least 1"),  # the shape first
        (["--collective"], r"--collective is a doctor option"),
        (["--local", "--wait"], r"--print-sbatch and --wait are for Slurm jobs"),
        (["--local", "--print-sbatch"], r"--print-sbatch and --wait are for Slurm jobs"),
        (["--local", "--stop-grace-s", "-1"], r"--stop-grace-s -1: must be 0 or more"),
        (["--local", "--requeue-by", "scontrol"], r"--requeue-by scontrol: a local run is no Slurm job"),
        (["--job-name", "a b"], r"--job-name 'a b': use a name without spaces"),
        (["--cpus-per-task", "0"], r"--cpus-per-task 0: must be at least 1"),
        (["--time", "forever"], r"--time"),
    ],
)
def test_each_wrong_flag_is_refused_once_in_one_line(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        read(*argv)


def test_a_local_run_gets_typed_local_options_and_no_slurm_ones() -> None:
    launch, _ = read("--local", "--nodes", "1", "--all-ranks", "--stop-grace-s", "5", "--time", "forever")
    assert launch.slurm is None and launch.local == options.LocalOptions(all_ranks=True, stop_grace_s=5.0)
    assert (launch.shape.nodes, launch.module, launch.task_argv, launch.trains) == (
        1,
        options.TRAIN,
        (),
        True,
    )


def test_a_slurm_job_gets_its_checked_request() -> None:
    launch, cfg = read("--nodes", "2", "--doctor", "--collective", "--time", "01:30:00", "--print-sbatch")
    assert launch.local is None and launch.slurm is not None
    assert (launch.module, launch.task_argv, launch.trains) == (options.DOCTOR, ("--collective",), False)
    assert (launch.slurm.request.minutes, launch.slurm.request.nodes, launch.slurm.print_sbatch) == (
        90,
        2,
        True,
    )
    assert launch.slurm.job_name == launch.slurm.request.job_name
