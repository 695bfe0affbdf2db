"""Where a rank runs: its GPU, its CPUs, and its thread count.

GPU rule (`select_device`), for every way Slurm hands out GPUs:
  - one visible GPU -> `cuda:0`. `--gpus-per-task=1` or `--gpu-bind` leave each task exactly one visible
    device, which is index 0 in that task, whatever its LOCAL_RANK.
  - at least LOCAL_WORLD_SIZE visible -> `cuda:<local_rank>` (`--gpus-per-node`, `--gres`: all visible).
  - none -> `cpu`.
  - anything else (2 visible, 4 tasks) is a misconfiguration that would stack ranks on one GPU: error.
CUDA_VISIBLE_DEVICES is never rewritten: Slurm may already have cut it to e.g. "4,5", and replacing it with
str(local_rank) (submitit's `export(set_cuda_visible_devices=True)`) points at the wrong physical GPU.

CPU rule (`plan_cpus`): the ranks of one node split the CPUs they may use (the affinity mask) evenly and
disjointly, and each sets torch's intra-op threads to the size of its share. Left alone, every rank starts
one thread per core of the whole machine, N ranks x all cores, and they fight (2x slower on 2 cores).

DataLoader workers (`plan_workers`): a rank's workers inherit its CPUs, so their number is chosen from the
share the rank is pinned to, the number torch's DataLoader checks against ("suggested max number of worker").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_ddp.cluster.env import SLURM_VARS
from hpc_ddp.errors import ClusterConfigError
from hpc_ddp.log import count

# Thread counts a user may export. `plan_cpus` honours OMP_NUM_THREADS; a process that compares or starts runs
# with the kit's own thread plan (the bench, the tests) removes them from what it passes on.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

if TYPE_CHECKING:
    import torch


def select_device(local_rank: int, local_world_size: int, cuda_count: int) -> torch.device:
    """The torch device for this rank, from the number of GPUs it can see (see the module docstring)."""
    import torch

    if cuda_count <= 0:
        return torch.device("cpu")
    if cuda_count == 1:
        return torch.device("cuda", 0)
    if cuda_count >= local_world_size:
        return torch.device("cuda", local_rank)
    raise ClusterConfigError(
        f"this task sees {cuda_count} GPUs but its node runs {local_world_size} tasks, so ranks would share "
        f"GPUs (local rank {local_rank} has none of its own). Fix: one task per GPU (--ntasks-per-node equal "
        "to --gpus-per-node), or --gpus-per-task=1"
    )


@dataclass(frozen=True)
class CpuPlan:
    """The CPUs a rank pins itself to and how many intra-op threads it runs."""

    cpus: tuple[int, ...]
    threads: int
    reason: str  # shown by doctor and in the start line
    pin: bool  # False: keep the current mask (user or Slurm already decided)


def _slurm_bound(environ: Mapping[str, str]) -> bool:
    """Did srun already bind each task to its own CPUs (--cpu-bind=cores/map_cpu/mask_cpu...)?"""
    bind = environ.get(SLURM_VARS["cpu_bind_type"][0], "")
    return bool(bind) and not bind.startswith("none") and bool(environ.get(SLURM_VARS["cpu_bind_list"][0]))


def plan_cpus(
    affinity: Sequence[int], local_rank: int, local_world_size: int, environ: Mapping[str, str]
) -> CpuPlan:
    """Pure rule: which CPUs and how many threads for this rank (nothing is applied here)."""
    mask = tuple(sorted(affinity))
    if environ.get("OMP_NUM_THREADS"):
        try:  # OpenMP allows a list per nesting level ("4,2"); the first is the outer team's size
            threads = max(1, int(environ["OMP_NUM_THREADS"].split(",")[0]))
        except ValueError:
            raise ClusterConfigError(
                f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']!r} is not an integer. "
                "Fix: unset it (hpc_ddp sizes threads per rank) or set a number"
            ) from None
        return CpuPlan(mask, threads, "OMP_NUM_THREADS set by the user", pin=False)
    if _slurm_bound(environ):
        how = environ[SLURM_VARS["cpu_bind_type"][0]]
        return CpuPlan(mask, len(mask), f"bound by Slurm ({how})", pin=False)
    if local_world_size <= 1:
        return CpuPlan(mask, len(mask), "only rank on its node", pin=False)
    share = len(mask) // local_world_size
    if share == 0:
        # More ranks than CPUs: disjoint shares are impossible; give each one CPU round-robin, one thread.
        cpu = mask[local_rank % len(mask)]
        return CpuPlan(
            (cpu,),
            1,
            f"{count(local_world_size, 'rank')} on {count(len(mask), 'CPU')}: oversubscribed",
            pin=True,
        )
    cpus = mask[local_rank * share : (local_rank + 1) * share]
    return CpuPlan(
        cpus, share, f"{count(len(mask), 'CPU')} split among {count(local_world_size, 'rank')}", pin=True
    )


AUTO_GPU_WORKERS = 2  # --num-workers -1 on a GPU rank: enough to keep a GPU fed from a map-style dataset


def plan_workers(asked: int, gpu: bool, cpus: int) -> tuple[int, str | None]:
    """DataLoader workers per rank, and a line to say once when the count is the user's and exceeds the
    rank's CPUs (pure). `asked` is --num-workers (-1: auto); `cpus` the CPUs this rank is pinned to.

    auto: none on a CPU rank (its CPUs train), else AUTO_GPU_WORKERS, but no more than the rank's CPUs, so
    torch's DataLoader never warns about the count the kit chose. A count the user asked for is kept: it may
    pay on a task whose workers wait on I/O; the line says what it shares."""
    cpus = max(1, cpus)
    if asked < 0:
        return (min(AUTO_GPU_WORKERS, cpus) if gpu else 0), None
    if asked <= cpus:
        return asked, None
    return asked, (
        f"--num-workers {asked}: each rank runs on {count(cpus, 'CPU')}, which its {asked} DataLoader workers "
        f"share with its training threads; {cpus} or fewer fit, and the default (-1) chooses for you"
    )


def apply_cpu_plan(plan: CpuPlan) -> None:
    """Pin this process to `plan.cpus` and size torch's thread pools (side effects, once per process)."""
    import psutil
    import torch

    if plan.pin:
        psutil.Process().cpu_affinity(list(plan.cpus))
    torch.set_num_threads(plan.threads)
    try:
        # Inter-op threads only serve parallel graph branches, which a DDP step doesn't have; one pool per
        # core per rank is pure oversubscription. Can only be set before any inter-op work started.
        torch.set_num_interop_threads(max(1, min(plan.threads, 2)))
    except RuntimeError:
        pass


def place(
    local_rank: int,
    local_world_size: int,
    environ: Mapping[str, str],
    cuda_count: int | None = None,
    pin: bool = True,
) -> tuple[torch.device, CpuPlan]:
    """Put this process where its rank belongs, in this order: choose its GPU (`select_device`) and make it the
    current CUDA device, so that NCCL and every allocation without an index land on it; then plan its CPUs
    (`plan_cpus`), pin to them and size torch's thread pools. Training, the doctor's all-reduce benchmark and
    the bench's checkpoint section all place themselves with this one sequence.

    `cuda_count`: the GPUs this process sees (default: torch's count). `pin=False` sizes the threads but keeps
    the CPU mask: for a process that goes on to start others, which would inherit it (the bench).
    Raises ClusterConfigError for a GPU count or OMP_NUM_THREADS that cannot work.
    """
    import torch

    device = select_device(
        local_rank, local_world_size, torch.cuda.device_count() if cuda_count is None else cuda_count
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plan = plan_cpus(current_affinity(), local_rank, local_world_size, environ)
    apply_cpu_plan(plan if pin else dataclasses.replace(plan, pin=False))
    return device, plan


def current_affinity() -> list[int]:
    """The CPUs this process may run on (what Slurm, taskset or a container allows)."""
    import psutil

    try:
        return list(psutil.Process().cpu_affinity())
    except (AttributeError, NotImplementedError):  # platforms without affinity (macOS)
        return list(range(os.cpu_count() or 1))


def gpu_uuid(device: torch.device) -> str:
    """A physical GPU's identity: two ranks with the same UUID share one GPU, whatever their indices."""
    import torch

    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    return (
        str(getattr(props, "uuid", ""))
        or f"{props.name}@{props.pci_bus_id if hasattr(props, 'pci_bus_id') else device.index}"
    )


def shared_gpus(holdings: Sequence[tuple[int, int, str]]) -> list[tuple[int, list[int], str]]:
    """Given (rank, node_rank, uuid) for every rank, list (node, ranks, uuid) where ranks share one GPU."""
    seen: dict[tuple[int, str], list[int]] = {}
    for rank, node, uuid in holdings:
        if uuid:
            seen.setdefault((node, uuid), []).append(rank)
    return [(node, ranks, uuid) for (node, uuid), ranks in seen.items() if len(ranks) > 1]
