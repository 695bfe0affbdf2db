"""GPU checks: NCCL, device pinning, bf16 training with save and resume, doctor. Skipped without CUDA.

Run on a GPU machine with `bash env/gpu-check.sh` (it also runs `doctor` and `bench overhead` there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_module

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster import placement
from hpc_ddp.cluster.group import process_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.deadline(300),
]  # not measured (no GPU where the deadlines were set): generous


def test_nccl_group_of_one_rank_on_its_pinned_gpu() -> None:
    env = dist_env.detect({})
    device = placement.select_device(env.local_rank, env.local_world_size, torch.cuda.device_count())
    assert device == torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with process_group(env, device) as backend:
        assert backend == "nccl"
        t = torch.ones(1024, device=device)
        torch.distributed.all_reduce(t)
        assert t.device == device and float(t.sum()) == 1024.0
        assert placement.gpu_uuid(device)  # a physical identity to compare across ranks


def test_bf16_training_saves_and_resumes_on_gpu(tmp_path: Path) -> None:
    first = run_module(
        "hpc_ddp.train", "--task", "mlp", "--amp", "bf16", "--epochs", "1", "--folder", str(tmp_path)
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "cuda:0, nccl" in first.stdout and "Model saved by rank 0" in first.stdout
    second = run_module(
        "hpc_ddp.train", "--task", "mlp", "--amp", "bf16", "--epochs", "2", "--folder", str(tmp_path)
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Resuming from " in second.stdout and "at epoch 1" in second.stdout
    state = torch.load(tmp_path / "model.pth", weights_only=True)
    assert all(t.device.type == "cpu" for t in state.values())  # loadable on a machine without a GPU


def test_doctor_passes_on_gpu(tmp_path: Path) -> None:
    proc = run_module("hpc_ddp.doctor", "--folder", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cuda" in proc.stdout and "FAIL" not in proc.stdout.split("doctor:")[0]


def test_a_hang_on_nccl_is_named_with_the_nccl_defaults_set(tmp_path: Path) -> None:
    """The watchdog on NCCL: one rank on its GPU stops in its loss function; verdict, hang.json, exit 76."""
    from conftest import clean_environ

    env = clean_environ(HANG_RANK="0")
    proc = run_module(
        "hpc_ddp.train",
        "--task",
        "hang_tasks:in_loss",
        "--hang-timeout-s",
        "5",
        "--folder",
        str(tmp_path),
        env=env,
        timeout=120,
    )
    assert proc.returncode == 76, proc.stdout + proc.stderr
    assert "hang at step 3: rank 0 (" in proc.stdout + proc.stderr
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in proc.stdout and (tmp_path / "hang.json").is_file()
