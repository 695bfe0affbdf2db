"""env/gpu-check.sh, the prepared GPU check, run here in its CPU mode (`--cpu`) so that it cannot rot unseen.

Every step but the two that need a GPU (nvidia-smi, tests/test_gpu.py) runs with its shortest settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_environ

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "env" / "gpu-check.sh"


@pytest.mark.deadline(420)  # a one-rank doctor, three one-rank fsdp runs, one quick bench section
def test_gpu_check_runs_its_cpu_steps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", str(out)],
        cwd=tmp_path,
        env=clean_environ(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=400,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    sections = [line for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert sections == [
        "== versions",
        "== GPU tests: skipped (--cpu)",
        "== doctor (1 rank, --collective)",
        "== fsdp (1 CPU rank, linear)",
        "== meta construction (1 CPU rank)",
        "== bench overhead (--quick with --cpu)",
    ], text
    meta = (out / "meta.log").read_text()
    assert "meta construction: 12 parameters bitwise equal to the CPU build of seed 7" in meta, meta
    fsdp = (out / "fsdp.log").read_text()
    assert "Resuming from " in fsdp and "ckpt-00000002 at epoch 0, step 2" in fsdp, fsdp
    assert (out / "fsdp" / "export.pth").is_file()
    assert "torch " in text and "nvidia-smi" not in text
    assert "doctor: 0 FAIL" in (out / "doctor.log").read_text()
    report = json.loads((out / "bench.json").read_text())
    assert list(report["sections"]) == ["overhead"] and report["settings"]["quick"] is True
    assert report["settings"]["world_size"] == 1
    assert "target  kit / hand loop, tuned threads" in (out / "bench.log").read_text()


def test_gpu_check_refuses_an_unknown_option(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpus"],
        cwd=tmp_path,
        env=clean_environ(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "env/gpu-check.sh: unknown option --cpus; usage: bash env/gpu-check.sh [--cpu] [OUT_DIR]"
    ]
