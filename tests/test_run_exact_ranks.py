"""Issue 32 on 2 gloo ranks through the local launcher: what one rank cannot show.

FSDP with BatchNorm (finding 5): each rank's batches move its own running statistics, FSDP2 does not
synchronize buffers, and a sharded checkpoint keeps one copy. The run stopped at step 5 (rank 0 notes a
SIGUSR2 there, tests/exact_tasks.py) and resumed must evaluate as the uninterrupted one did, end with the
same model.pth, and `checkpoint export` of its last checkpoint must equal that model.pth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import clean_environ
from test_launch_local import finish, start

from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.storage import Local

pytestmark = [pytest.mark.slow, pytest.mark.deadline(240)]

FSDP_BN = (
    "--task",
    "exact_tasks:batchnorm",
    "--strategy",
    "fsdp",
    "--nodes",
    "1",
    "--gpus-per-node",
    "2",
    "--deterministic",
    "--epochs",
    "2",
    "--batch-size",
    "8",
    "--eval-every-steps",
    "4",
    "--log-every-s",
    "0",
)


def evals(folder: Path) -> list[tuple[int, dict]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["metrics"]) for r in map(json.loads, lines) if r["event"] == "eval"]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_fsdp_batchnorm_buffers_resume_exactly_and_export_equals_model_pth(tmp_path: Path) -> None:
    code, out = finish(start(tmp_path / "straight", *FSDP_BN))
    assert code == 0, out
    stopped = tmp_path / "stopped"
    code, out = finish(start(stopped, *FSDP_BN, EXACT_STOP_STEP="5", EXACT_STOP_MARK=str(tmp_path / "stop-")))
    assert code == 0, out
    assert "Resuming from " in out and ", step 5" in out, out
    assert [s for s, _ in evals(stopped)] == [4, 8, 12]
    assert evals(stopped) == evals(tmp_path / "straight")
    a, b = weights(tmp_path / "straight" / "model.pth"), weights(stopped / "model.pth")
    assert a.keys() == b.keys() and any("running_mean" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    latest = store.read_latest(stopped, storage=Local())
    assert latest is not None
    exported = tmp_path / "exported.pth"
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.checkpoint", "export", str(latest), str(exported)],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    c = weights(exported)
    assert c.keys() == b.keys() and all(torch.equal(c[k], b[k]) for k in c)
