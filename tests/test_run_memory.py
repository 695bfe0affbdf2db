"""The ranks' allocator: freed heap memory goes back to the system when trimmed (hpc_ddp.run.memory), and the
kit's launchers start ranks with glibc's settings unless the user set them (hpc_ddp.cluster.allocator)."""

from __future__ import annotations

import os

import pytest
import torch

from hpc_ddp.run import memory


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_trim_gives_freed_heap_memory_back() -> None:
    # 64 KiB tensors come from malloc's heap, not mmap; every 64th kept alive, so the heap cannot shrink from
    # its top and the freed ones stay resident until trimmed.
    tensors = [torch.ones(16384) for _ in range(4096)]  # 256 MiB
    kept = tensors[::64]
    before = resident_mib()
    del tensors
    freed = resident_mib()
    assert memory.trim()
    after = resident_mib()
    assert before - freed < 64 < freed - after, (before, freed, after)
    assert all(bool((t == 1).all()) for t in kept)  # what is alive is untouched


def test_the_ranks_allocator_settings_are_the_strategys_and_the_users_win() -> None:
    """fsdp's ranks start with the kit's malloc settings, ddp's with glibc's defaults (a fixed mmap threshold
    maps, faults in and unmaps DDP's per-step gradients: issue 41); a GLIBC_TUNABLES of the user's, even empty,
    is kept. The local launcher sets them per rank; a Slurm job's batch shell evaluates `begin`'s exports."""
    from conftest import ROOT

    from hpc_ddp.cluster import allocator
    from hpc_ddp.launch.local.srun_env import LocalJob, child_environ
    from hpc_ddp.scheduler.slurm.submit import submission_environ

    def submitted(environ: dict[str, str]) -> dict[str, str]:  # what sbatch exports into the job
        with pytest.MonkeyPatch.context() as mp:
            for key in list(os.environ):
                mp.delenv(key)
            for key, value in environ.items():
                mp.setenv(key, value)
            with submission_environ():
                return dict(os.environ)

    fsdp = LocalJob(1, 1, ROOT, [], 0, "local", job_id="123", strategy="fsdp")
    ddp = LocalJob(1, 1, ROOT, [], 0, "local", job_id="123")
    assert child_environ({}, fsdp, 0, 0)[allocator.VAR] == allocator.SETTINGS
    assert allocator.VAR not in child_environ({}, ddp, 0, 0)
    assert allocator.VAR not in submitted({})  # the job's `begin` decides, from the run's options
    assert allocator.exports({}, "fsdp") == f"export {allocator.VAR}={allocator.SETTINGS}\n"
    assert allocator.exports({}, "ddp") == ""
    for mine in ("", "glibc.malloc.arena_max=2"):  # empty: glibc's own defaults
        assert child_environ({allocator.VAR: mine}, fsdp, 0, 0)[allocator.VAR] == mine
        assert child_environ({allocator.VAR: mine}, ddp, 0, 0)[allocator.VAR] == mine
        assert submitted({allocator.VAR: mine})[allocator.VAR] == mine
        assert allocator.exports({allocator.VAR: mine}, "fsdp") == ""
    sbatch = (ROOT / "slurm" / "ddp.sbatch").read_text()
    assert f"export {allocator.VAR}" not in sbatch  # `begin` prints it, for fsdp
    assert 'eval "$step"' in sbatch
