"""Tables for GPU choice (`select_device`), CPU shares (`plan_cpus`) and the shared-GPU check (`shared_gpus`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import clean_environ, die_with_test
from hypothesis import given
from hypothesis import strategies as st

from hpc_ddp.cluster import placement
from hpc_ddp.cluster.placement import CpuPlan, plan_cpus, select_device, shared_gpus
from hpc_ddp.errors import ClusterConfigError


@pytest.mark.parametrize(
    "local_rank, local_world, cuda_count, expected",
    [
        (0, 1, 0, "cpu"),
        (3, 4, 0, "cpu"),
        (0, 1, 1, "cuda:0"),
        (
            3,
            4,
            1,
            "cuda:0",
        ),  # --gpus-per-task=1 / --gpu-bind: the task's one GPU is index 0, whatever LOCAL_RANK
        (1, 2, 2, "cuda:1"),
        (3, 4, 4, "cuda:3"),  # --gpus-per-node 4: all visible, one each
        (1, 2, 8, "cuda:1"),  # more visible than ranks: rank i takes index i
        (0, 1, 8, "cuda:0"),
    ],
)
def test_select_device(local_rank: int, local_world: int, cuda_count: int, expected: str) -> None:
    assert select_device(local_rank, local_world, cuda_count) == torch.device(expected)


@pytest.mark.parametrize("local_rank, local_world, cuda_count", [(3, 4, 2), (0, 4, 2), (2, 3, 2), (7, 8, 3)])
def test_select_device_refuses_to_stack_ranks(local_rank: int, local_world: int, cuda_count: int) -> None:
    with pytest.raises(
        ClusterConfigError,
        match=rf"sees {cuda_count} GPUs but its node runs {local_world} tasks.*local rank "
        rf"{local_rank}.*Fix: one task per GPU",
    ):
        select_device(local_rank, local_world, cuda_count)


# --- CPU plan ---------------------------------------------------------------------------------------------

EIGHT = list(range(8))


@pytest.mark.parametrize(
    "affinity, local_rank, local_world, environ, expected",
    [
        # Even split of the mask among the node's ranks, pinned, threads = share.
        (EIGHT, 0, 4, {}, CpuPlan((0, 1), 2, "8 CPUs split among 4 ranks", pin=True)),
        (EIGHT, 3, 4, {}, CpuPlan((6, 7), 2, "8 CPUs split among 4 ranks", pin=True)),
        (EIGHT, 1, 2, {}, CpuPlan((4, 5, 6, 7), 4, "8 CPUs split among 2 ranks", pin=True)),
        # The mask is what this process may use (taskset, a container, a Slurm allocation), in CPU order.
        ([7, 3, 5, 1], 1, 2, {}, CpuPlan((5, 7), 2, "4 CPUs split among 2 ranks", pin=True)),
        # Not divisible: equal shares (the slowest rank paces DDP anyway), the remainder stays idle.
        ([0, 1, 2, 3, 4], 1, 2, {}, CpuPlan((2, 3), 2, "5 CPUs split among 2 ranks", pin=True)),
        # The only rank on its node keeps everything and is not pinned.
        (EIGHT, 0, 1, {}, CpuPlan(tuple(EIGHT), 8, "only rank on its node", pin=False)),
        # More ranks than CPUs: one CPU each, round robin, one thread.
        ([0, 1], 0, 4, {}, CpuPlan((0,), 1, "4 ranks on 2 CPUs: oversubscribed", pin=True)),
        ([0, 1], 3, 4, {}, CpuPlan((1,), 1, "4 ranks on 2 CPUs: oversubscribed", pin=True)),
        # The user's OMP_NUM_THREADS wins: no pinning, their thread count.
        (
            EIGHT,
            1,
            4,
            {"OMP_NUM_THREADS": "3"},
            CpuPlan(tuple(EIGHT), 3, "OMP_NUM_THREADS set by the user", pin=False),
        ),
        (
            EIGHT,
            1,
            4,
            {"OMP_NUM_THREADS": "4,2"},
            CpuPlan(tuple(EIGHT), 4, "OMP_NUM_THREADS set by the user", pin=False),
        ),
        (
            EIGHT,
            1,
            4,
            {"OMP_NUM_THREADS": "0"},
            CpuPlan(tuple(EIGHT), 1, "OMP_NUM_THREADS set by the user", pin=False),
        ),
        (EIGHT, 1, 4, {"OMP_NUM_THREADS": ""}, CpuPlan((2, 3), 2, "8 CPUs split among 4 ranks", pin=True)),
        # srun --cpu-bind=cores already gave each task its own CPUs: keep the mask, use its size.
        (
            [2, 3],
            1,
            4,
            {"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "0xC"},
            CpuPlan((2, 3), 2, "bound by Slurm (mask_cpu:)", pin=False),
        ),
        # --cpu-bind=none, or a type without a list, is no binding: split as usual.
        (
            [0, 1, 2, 3],
            1,
            2,
            {"SLURM_CPU_BIND_TYPE": "none", "SLURM_CPU_BIND_LIST": ""},
            CpuPlan((2, 3), 2, "4 CPUs split among 2 ranks", pin=True),
        ),
        (
            [0, 1, 2, 3],
            1,
            2,
            {"SLURM_CPU_BIND_TYPE": "mask_cpu:"},
            CpuPlan((2, 3), 2, "4 CPUs split among 2 ranks", pin=True),
        ),
        # OMP_NUM_THREADS beats a Slurm binding too.
        (
            [2, 3],
            0,
            2,
            {"OMP_NUM_THREADS": "1", "SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "0xC"},
            CpuPlan((2, 3), 1, "OMP_NUM_THREADS set by the user", pin=False),
        ),
    ],
)
def test_plan_cpus(
    affinity: list[int], local_rank: int, local_world: int, environ: dict[str, str], expected: CpuPlan
) -> None:
    assert plan_cpus(affinity, local_rank, local_world, environ) == expected


def test_plan_cpus_bad_omp_num_threads() -> None:
    with pytest.raises(ClusterConfigError, match=r"OMP_NUM_THREADS='many' is not an integer.*Fix"):
        plan_cpus(EIGHT, 0, 2, {"OMP_NUM_THREADS": "many"})


@given(st.sets(st.integers(0, 255), min_size=1, max_size=64), st.integers(1, 16))
def test_shares_are_disjoint_equal_and_inside_the_mask(mask: set[int], local_world: int) -> None:
    plans = [plan_cpus(sorted(mask), rank, local_world, {}) for rank in range(local_world)]
    for plan in plans:
        assert plan.cpus and set(plan.cpus) <= mask
        assert plan.threads == len(plan.cpus)
    if local_world <= len(mask):
        taken = [cpu for plan in plans for cpu in plan.cpus]
        assert len(taken) == len(set(taken))  # disjoint
        assert len({plan.threads for plan in plans}) == 1  # equal
        assert len(taken) > len(mask) - local_world  # at most local_world - 1 CPUs left idle


def test_current_affinity_is_this_process_mask() -> None:
    cpus = placement.current_affinity()
    assert cpus and set(cpus) <= set(range(1024))


def test_apply_cpu_plan_pins_and_sizes_threads() -> None:
    # In a child process: pinning the test runner itself would slow every later test.
    code = """
import json, psutil, torch
from hpc_ddp.cluster import placement
cpu = placement.current_affinity()[-1]
placement.apply_cpu_plan(placement.CpuPlan((cpu,), 1, "test", pin=True))
print(json.dumps([cpu, psutil.Process().cpu_affinity(), torch.get_num_threads()]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_environ(),
        capture_output=True,
        text=True,
        preexec_fn=die_with_test,
        timeout=120,
        check=True,
    ).stdout
    cpu, mask, threads = json.loads(out.splitlines()[-1])
    assert (mask, threads) == ([cpu], 1)


# --- GPUs shared between ranks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "holdings, expected",
    [
        ([], []),
        ([(0, 0, ""), (1, 0, "")], []),  # CPU ranks hold no GPU
        ([(0, 0, "GPU-a"), (1, 0, "GPU-b"), (2, 1, "GPU-c"), (3, 1, "GPU-d")], []),
        ([(0, 0, "GPU-a"), (1, 0, "GPU-a")], [(0, [0, 1], "GPU-a")]),
        ([(0, 0, "GPU-a"), (1, 0, "GPU-b"), (2, 0, "GPU-a"), (3, 0, "GPU-a")], [(0, [0, 2, 3], "GPU-a")]),
        # The same id on two nodes is two GPUs (a fallback id like "name@bus" repeats across nodes).
        ([(0, 0, "A100@0"), (1, 1, "A100@0")], []),
        ([(0, 0, "x"), (1, 0, "x"), (2, 1, "y"), (3, 1, "y")], [(0, [0, 1], "x"), (1, [2, 3], "y")]),
    ],
)
def test_shared_gpus(
    holdings: list[tuple[int, int, str]], expected: list[tuple[int, list[int], str]]
) -> None:
    assert shared_gpus(holdings) == expected


def test_gpu_uuid_of_cpu_is_empty() -> None:
    assert placement.gpu_uuid(torch.device("cpu")) == ""


@pytest.mark.parametrize(
    "asked, gpu, cpus, workers, said",
    [
        (-1, False, 8, 0, False),  # auto on a CPU rank: its CPUs train
        (-1, True, 8, 2, False),  # auto on a GPU rank
        (-1, True, 1, 1, False),  # auto never exceeds the rank's CPUs: torch would warn (issue 37 item 4)
        (0, True, 1, 0, False),
        (1, False, 1, 1, False),
        (2, False, 1, 2, True),  # the user's count is kept, and said once in the kit's words
        (4, True, 8, 4, False),
    ],
)
def test_dataloader_workers_fit_the_cpus_the_rank_is_pinned_to(
    asked: int, gpu: bool, cpus: int, workers: int, said: bool
) -> None:
    chosen, note = placement.plan_workers(asked, gpu, cpus)
    assert chosen == workers and (note is not None) == said
    if note:
        assert note == (
            "--num-workers 2: each rank runs on 1 CPU, which its 2 DataLoader workers share with its training "
            "threads; 1 or fewer fit, and the default (-1) chooses for you"
        )
