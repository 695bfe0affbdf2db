"""Shared fixtures: a clean environment, subprocess runners, and the real local Slurm cluster."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import workers

from hpc_ddp.cluster.env import without_launcher
from hpc_ddp.cluster.placement import THREAD_VARS
from hpc_ddp.run import startup

# Every pytest worker imports torch for the in-process tests: the way a rank does (hpc_ddp/run/startup.py), the
# collector paused and the result frozen, so that no collection in this long-lived process walks torch's objects
# again (the in-process tests about a fifth less CPU on the 2-core test machine).
startup.import_torch()

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
CLUSTER = ROOT / "env" / "slurm" / "cluster.sh"

# tests/deadline.py: every test has a deadline (pyproject's deadline_s, the marker); tests/standins.py: Slurm's
# commands fail unless the test is marked slurm or brings its own fakes; tests/costs.py: every test has a cost
# marker (unit, process, ranks, slurm, scenario), and each run ends with the seconds per test file;
# tests/workers.py: who may run beside whom under pytest-xdist.
pytest_plugins = ["deadline", "standins", "workers", "costs"]

_PYTEST_PID = os.getpid()
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: no dlopen between fork and exec


def pytest_report_header(config: pytest.Config) -> str:
    """Which torch the run is on, first thing in the log: a CUDA build where there is no GPU imports about 2.5 times
    slower (3.6 s against 1.4 s here), and the suite, which starts hundreds of processes, runs that much slower."""
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    return f"torch {torch.__version__} ({build}) from {Path(torch.__file__).parent}"


def die_with_test() -> None:
    """preexec_fn for every process a test starts: SIGKILL it when the test process dies, however it dies (a
    run stopped by its deadline leaves nothing behind). Linux ties it to the starting thread: use it only for
    children started on pytest's main thread."""
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _PYTEST_PID:  # the test process died before prctl took effect
        os._exit(1)


def local_checkpoints(cfg: Any) -> Any:
    """The checkpoint store of `cfg`'s run folder on this machine's filesystem: what --checkpoint-storage local
    builds (hpc_ddp.run.checkpoint.store.of_run), for a test that makes a Trainer itself."""
    from hpc_ddp.run.checkpoint.store import of_run

    return of_run(cfg.folder, "local")


def clean_environ(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables (the test runner itself may run inside a Slurm job) or thread
    counts (hpc_ddp.cluster.env's table, hpc_ddp.cluster.placement.THREAD_VARS)."""
    env = {k: v for k, v in without_launcher(os.environ).items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    env.update(extra)
    return env


def run_module(
    module: str, *args: str, cwd: Path | None = None, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m module args` in a clean environment; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env or clean_environ(),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=die_with_test,
    )


# A deterministic 2 x 1 local run (tests/slow_tasks.py:slow: dropout, momentum), --deterministic: an interrupted
# and resumed run of these arguments must end bitwise equal to it, whatever its per-step sleep. Two nodes of one
# rank: what the tests need is ranks on more than one node; a third and fourth rank would only cost seconds of
# CPU each (a rank's start-up is mostly importing torch).
DETERMINISTIC_2X1 = (
    "--tasks-per-node",
    "1",
    "--task",
    "slow_tasks:slow",
    "--epochs",
    "3",
    "--batch-size",
    "16",
    "--deterministic",
    "--lr",
    "0.005",
)
STEPS_PER_EPOCH_2X1 = 512 // 2 // 16  # slow_tasks' 512 samples over 2 ranks, batch 16


@pytest.fixture(scope="session")
def uninterrupted_2x1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DETERMINISTIC_2X1 run once, uninterrupted: the folder of the reference end that every test interrupting
    a run of those arguments compares with (tests/test_run_preemption.py, tests/test_launch_local_retry.py);
    one run for all of them (under pytest-xdist, tests/workers.py puts its readers on one worker)."""
    from test_launch_local import finish, start  # a test module's helpers: imported when first needed

    folder = tmp_path_factory.mktemp("uninterrupted_2x1")
    code, out = finish(start(folder, *DETERMINISTIC_2X1, SLOW_TASK_SLEEP_S="0"))
    assert code == 0, out
    return folder


@pytest.fixture(scope="module")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[str]:
    """The real local Slurm cluster (env/slurm/cluster.sh), started by env/test.sh; its partition name.

    For the files tests/workers.py puts on the second cluster (when env/test.sh started one), SLURM_CONF points
    there while the module runs: every Slurm command the tests and their processes run reaches it. Module
    scope, so that the module's own shared fixtures (a job run once for several tests) see it too."""
    # HPC_DDP_SLURM_DIR names a cluster other than the one /etc/slurm/slurm.conf links to (a developer's own,
    # started with HPC_DDP_SLURM_BESIDE=1): its SLURM_CONF too, unless one is set, so no job reaches another.
    state = workers.second_cluster(request.path) or (
        os.environ.get("HPC_DDP_SLURM_DIR") if not os.environ.get("SLURM_CONF") else None
    )
    with pytest.MonkeyPatch.context() as patch:
        if state:
            patch.setenv("HPC_DDP_SLURM_DIR", state)
            patch.setenv("SLURM_CONF", str(Path(state) / "etc" / "slurm.conf"))
        required = os.environ.get("HPC_DDP_REQUIRE_SLURM") == "1"
        ok = (
            shutil.which("sbatch") is not None
            and subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True).returncode
            == 0
        )
        if not ok:
            where = f"HPC_DDP_SLURM_DIR={state} HPC_DDP_SLURM_BESIDE=1 " if state else ""
            if required:
                pytest.fail(
                    f"the local Slurm cluster is not running: `{where}bash env/slurm/cluster.sh start` (see its log)"
                )
            pytest.skip(f"no local Slurm cluster (start it with `{where}bash env/slurm/cluster.sh start`)")
        yield "debug"
