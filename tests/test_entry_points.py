"""Small mistakes through every door get one line and exit 2, never a traceback: the installed console scripts,
a seed beyond 64 bits, a memory request that is no positive number, and a task module that exists but fails
to import its own dependency (which is not "module not found").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_environ, die_with_test, run_module
from test_entry_usage_errors import assert_usage_error
from test_run_folder_rules import train


def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: what pip installs as `hpc-ddp-submit` and `hpc-ddp-train`."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section, re.M))


@pytest.mark.parametrize(
    "script, args, expected",
    [
        ("hpc-ddp-submit", ["--local", "--nodes", "0"], "--nodes 0: must be at least 1"),
        ("hpc-ddp-submit", ["--local", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ("hpc-ddp-train", ["--epochs", "0"], "--epochs 0: must be at least 1"),
    ],
)
def test_console_scripts_report_usage_errors_in_one_line_with_exit_2(
    script: str, args: list[str], expected: str, tmp_path: Path
) -> None:
    module, function = console_scripts()[script].split(":")
    # What the script pip generates runs (its argv[0] is the script's name).
    code = f"import sys; sys.argv[0] = {script!r}; from {module} import {function}; sys.exit({function}())"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tmp_path,
        env=clean_environ(),
        text=True,
        capture_output=True,
        timeout=60,
        preexec_fn=die_with_test,
    )
    where = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, where
    assert "Traceback" not in proc.stdout + proc.stderr, where
    assert len(proc.stderr.splitlines()) == 1 and expected in proc.stderr, where


@pytest.mark.slow
@pytest.mark.deadline(30)  # 3-4.5 s (measured)
def test_a_seed_beyond_64_bits_is_one_line_and_any_64_bit_seed_trains(tmp_path: Path) -> None:
    proc = run_module(
        "hpc_ddp.train", "--seed", "99999999999999999999999", "--folder", str(tmp_path), timeout=60
    )
    assert_usage_error(
        proc,
        "hpc_ddp.train",
        "--seed 99999999999999999999999: must be a 64-bit integer, from "
        "-9223372036854775808 to 9223372036854775807",
    )
    code, out = train(tmp_path / "largest", "--seed", str(2**63 - 1), "--epochs", "2", "--max-steps", "40")
    assert code == 0, out


@pytest.mark.parametrize(
    "mem, sbatch_line",
    [("0.0001", "#SBATCH --mem=1M"), ("1.5", "#SBATCH --mem=1536M"), ("64", "#SBATCH --mem=64G")],
)
def test_memory_is_rounded_up_never_to_zero(mem: str, sbatch_line: str, tmp_path: Path) -> None:
    proc = run_module(
        "hpc_ddp.submit", "--print-sbatch", "--mem-gb", mem, "--folder", str(tmp_path), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert sbatch_line in proc.stdout.splitlines()  # --mem=0 would give the job all of a node's memory


@pytest.mark.parametrize("mem", ["nan", "inf", "0", "-2"])
def test_memory_that_is_no_positive_number_is_a_usage_error(mem: str, tmp_path: Path) -> None:
    proc = run_module(
        "hpc_ddp.submit", "--print-sbatch", "--mem-gb", mem, "--folder", str(tmp_path), timeout=60
    )
    assert_usage_error(proc, "hpc_ddp.submit", f"--mem-gb {float(mem)}: must be a positive number of GB")


@pytest.mark.slow
@pytest.mark.deadline(30)  # 1.5-4 s
def test_a_task_module_whose_own_import_fails_is_not_reported_as_missing(tmp_path: Path) -> None:
    # Its name starts like the missing module's, which used to pass for "the task module is missing".
    (tmp_path / "mytask_v2.py").write_text(
        "import mytask  # the version it replaced, not installed here\n\n\n"
        "def build(config):\n    raise AssertionError('never called')\n"
    )
    proc = run_module(
        "hpc_ddp.train",
        "--task",
        "mytask_v2:build",
        "--folder",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=60,
    )
    assert_usage_error(
        proc,
        "hpc_ddp.train",
        "--task 'mytask_v2:build': mytask_v2 was found, but importing it "
        "failed: No module named 'mytask' (mytask_v2.py line 1). Fix: install that module",
    )
