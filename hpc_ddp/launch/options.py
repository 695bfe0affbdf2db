"""The launcher's options, typed and checked once: what `python -m hpc_ddp.submit` was asked, for either path.

`read(ns)` turns the parsed flags into `LaunchOptions` (and the training options, `TrainConfig`), raising a
UsageError at the first flag that is wrong, in the order a user reads them: the job's shape, the training
options and --min-nodes against that shape, the doctor's options, then the path's own (a local run's stop
grace and requeue mode; a Slurm job's sbatch request: time limit, signal delay, CPUs, job name, container,
srun options). Nothing downstream checks a flag again or reads the namespace: the local launcher
(hpc_ddp.launch.local.run) and the Slurm submitter (hpc_ddp.launch.slurm.submitter) take these.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from hpc_ddp.errors import UsageError
from hpc_ddp.launch.shape import JobShape, job_shape
from hpc_ddp.run.config import TrainConfig, check_min_nodes, from_namespace
from hpc_ddp.scheduler.slurm import runtime
from hpc_ddp.scheduler.slurm.request import (
    SlurmRequest,
    check_signal_delay,
    mem_text,
    parse_extras,
    parse_time,
)

TRAIN, DOCTOR = "hpc_ddp.train", "hpc_ddp.doctor"


@dataclass(frozen=True)
class LocalOptions:
    """`--local`: the ranks run here, supervised by the local launcher."""

    all_ranks: bool  # every rank's lines on the console, not rank 0's alone
    stop_grace_s: float | None  # after Ctrl-C/SIGTERM, the ranks' time to save (None: the launcher's default)


@dataclass(frozen=True)
class SlurmOptions:
    """A Slurm job: the sbatch request, and what `submit` does with it."""

    request: SlurmRequest  # nodes, tasks, time, resources, container and srun options: sbatch's side
    print_sbatch: bool  # show the script, submit nothing
    wait: bool  # follow the job to its end, and exit as it did

    @property
    def job_name(self) -> str:
        return self.request.job_name


@dataclass(frozen=True)
class LaunchOptions:
    """What to launch and how: exactly one of `local` and `slurm` is set."""

    shape: JobShape
    module: str  # what every task runs: hpc_ddp.train, or hpc_ddp.doctor (--doctor)
    task_argv: tuple[
        str, ...
    ]  # the module's own options beyond the training ones (the doctor's --collective)
    local: LocalOptions | None = None
    slurm: SlurmOptions | None = None

    @property
    def trains(self) -> bool:
        return self.module == TRAIN


def read(ns: argparse.Namespace) -> tuple[LaunchOptions, TrainConfig]:
    """Every launcher flag of `ns` (hpc_ddp.submit's parser) checked once, in order (see the module
    docstring); raises UsageError naming the flag and the fix."""
    shape = job_shape(ns.nodes, ns.gpus_per_node, ns.tasks_per_node)
    cfg = from_namespace(ns)
    check_min_nodes(cfg, shape.nodes, shape.tasks_per_node)
    if ns.collective and not ns.doctor:
        raise UsageError("--collective is a doctor option: add --doctor (or drop --collective)")
    module = DOCTOR if ns.doctor else TRAIN
    task_argv = ("--collective",) if ns.collective else ()
    if ns.local:
        return LaunchOptions(shape, module, task_argv, local=_local(ns, cfg)), cfg
    return LaunchOptions(shape, module, task_argv, slurm=_slurm(ns, shape, cfg)), cfg


def _local(ns: argparse.Namespace, cfg: TrainConfig) -> LocalOptions:
    if ns.print_sbatch or ns.wait:
        raise UsageError("--print-sbatch and --wait are for Slurm jobs; drop them with --local")
    grace = ns.stop_grace_s
    if grace is not None and not (math.isfinite(grace) and grace >= 0):
        raise UsageError(f"--stop-grace-s {grace:g}: must be 0 or more seconds (0 kills at once)")
    if cfg.requeue_by == "scontrol":
        raise UsageError(
            "--requeue-by scontrol: a local run is no Slurm job that scontrol could requeue; its "
            "launcher restarts it after a preemption. Fix: drop --requeue-by"
        )
    return LocalOptions(ns.all_ranks, grace)


def _slurm(ns: argparse.Namespace, shape: JobShape, cfg: TrainConfig) -> SlurmOptions:
    # --spare-nodes K: the allocation holds K nodes more than the job trains on (hpc_ddp.launch.spares).
    request = dataclasses.replace(request_from(ns, shape), nodes=shape.nodes + cfg.spare_nodes)
    return SlurmOptions(request, ns.print_sbatch, ns.wait)


def request_from(ns: argparse.Namespace, shape: JobShape) -> SlurmRequest:
    """The sbatch request of the Slurm flags, each checked (raises UsageError)."""
    minutes = parse_time(ns.time)
    check_signal_delay(ns.signal_delay_s, minutes)
    if ns.cpus_per_task is not None and ns.cpus_per_task <= 0:
        raise UsageError(f"--cpus-per-task {ns.cpus_per_task}: must be at least 1")
    if not ns.job_name.strip() or any(c.isspace() for c in ns.job_name):
        raise UsageError(f"--job-name {ns.job_name!r}: use a name without spaces, e.g. --job-name resnet50")
    return SlurmRequest(
        nodes=shape.nodes,
        tasks_per_node=shape.tasks_per_node,
        gpus_per_node=shape.gpus_per_node,
        minutes=minutes,
        signal_delay_s=ns.signal_delay_s,
        job_name=ns.job_name,
        cpus_per_task=ns.cpus_per_task,
        mem=mem_text(ns.mem_gb) if ns.mem_gb is not None else None,
        partition=ns.partition,
        account=ns.account,
        qos=ns.qos,
        constraint=ns.constraint,
        exclusive=ns.exclusive,
        setup=tuple(ns.setup),
        extras=tuple(parse_extras(ns.slurm).items()),
        runtime=runtime.check(
            ns.python, ns.setup, ns.container_image, ns.container_mounts, ns.apptainer, ns.srun_arg
        ),
    )
