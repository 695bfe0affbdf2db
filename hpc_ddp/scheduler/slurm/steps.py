"""A job step started on given nodes of the allocation, by the batch shell (--spare-nodes: the steps of
hpc_ddp.launch.slurm.inplace). The only place that places a step: srun's variables and its host file.

srun reads its node and task counts from SLURM_NNODES/SLURM_JOB_NUM_NODES and SLURM_NTASKS/SLURM_NPROCS, and
with SLURM_HOSTFILE set it lays the tasks out in the file's order (`--distribution=arbitrary`). Variables,
not options: the job submitit writes has its own srun line, which only the environment can steer, so the
first step goes through a shell function named `srun` that sets them (`first_step`), and records its
arguments in the file HPC_DDP_STEP_ARGS names, for `run` to start the next steps the same way. Measured on
Slurm 22.05: 4 tasks on node2,node3 of node[1-3] with a host file "node2 node2 node3 node3": ranks 0-1 on
node2, SLURM_STEP_NODELIST=node[2-3]. The host file lists the nodes in the allocation's order: the kit finds
the rendezvous host as the first node of the step's list (hpc_ddp.cluster.env), where rank 0 must be.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from hpc_ddp.scheduler.slurm import env as slurm_env
from hpc_ddp.variables import IN_PLACE, STEP_ARGS


def step_environ(nodes: Sequence[str], per_node: int, hostfile: str) -> dict[str, str]:
    """The variables that make `srun` start a step on `nodes`, `per_node` tasks on each, inside a larger
    allocation, its tasks listed in `hostfile` (`hostfile_text`) (pure)."""
    tasks = str(len(nodes) * per_node)
    count = str(len(nodes))
    return {
        "SLURM_HOSTFILE": hostfile,
        "SLURM_NNODES": count,
        "SLURM_JOB_NUM_NODES": count,
        "SLURM_NTASKS": tasks,
        "SLURM_NPROCS": tasks,
    }


def hostfile_text(nodes: Sequence[str], per_node: int) -> str:
    """One line per task, in rank order: each node `per_node` times, in the step's order (pure)."""
    return "".join(f"{n}\n" * per_node for n in nodes)


def allocation(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The job's nodes as the batch environment lists them (the allocation it started with)."""
    return slurm_env.job_nodes(environ) or ()


def batch_host(environ: Mapping[str, str]) -> str:
    """The node this (the batch shell's) process runs on, as Slurm names it; "" when not said."""
    return slurm_env.value(environ, "node_name")


def shell_function(nodes: Sequence[str], per_node: int, hostfile: str, args_file: str) -> str:
    """The text `begin` prints for the batch script to eval (pure): an `srun` function that records its
    arguments (for the steps after it) and starts the first step on `nodes`."""
    assigned = " ".join(f"{k}={shlex.quote(v)}" for k, v in step_environ(nodes, per_node, hostfile).items())
    quoted = shlex.quote(args_file)
    return (
        f"export {STEP_ARGS}={quoted}\n"
        f'srun() {{ printf \'%s\\0\' "$@" > {quoted}; {assigned} command srun "$@"; }}\n'
    )


def write_hostfile(path: str, nodes: Sequence[str], per_node: int) -> str:
    with open(path, "w") as f:
        f.write(hostfile_text(nodes, per_node))
    return path


def first_step(nodes: Sequence[str], per_node: int, job: str) -> str:
    """Write the first step's files (its host file, and an empty one for its arguments) in this node's
    temporary folder, and return the shell text that starts it (`shell_function`)."""
    fd, args_file = tempfile.mkstemp(prefix=f"hpc_ddp-step-{job}-")
    os.close(fd)
    hostfile = write_hostfile(f"{args_file}.hosts", nodes, per_node)
    return shell_function(nodes, per_node, hostfile, args_file)


def remove_step_files(environ: Mapping[str, str]) -> None:
    """The files `first_step` made, once the batch shell starts no more steps."""
    args_file = environ.get(STEP_ARGS) or ""
    if args_file:
        for path in (args_file, f"{args_file}.hosts"):
            Path(path).unlink(missing_ok=True)


def step_args(environ: Mapping[str, str]) -> list[str] | None:
    """The first step's srun arguments, as its `srun` function recorded them; None when it did not."""
    try:
        raw = Path(environ.get(STEP_ARGS) or "").read_bytes()
    except OSError:
        return None
    args = [a.decode() for a in raw.split(b"\0")[:-1]]
    return args or None


def _note(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    print(
        f"[hpc_ddp] the batch shell got {name} while a step ran: the tasks got it too; waiting for them",
        file=sys.stderr,
        flush=True,
    )


@dataclass(frozen=True)
class Ran:
    status: int  # srun's exit status, as bash's $? says it (128 + a signal)
    lines: tuple[str, ...]  # srun's own stderr lines
    environ: dict[str, str]  # the batch shell's environment with the step's number: `end` judges with it


def run(
    nodes: Sequence[str], number: int, args: Sequence[str], per_node: int, environ: Mapping[str, str]
) -> Ran:
    """Start step in place `number` (srun with the first step's arguments, on `nodes`) and wait for its end;
    srun's stderr goes on to this shell's (the batch log) and is kept for the judge. SIGTERM (scancel, the
    time limit) and the preemption signals reach the tasks from Slurm: this process notes them and waits."""
    hostfile = write_hostfile(f"{environ.get(STEP_ARGS)}.{number}.hosts", nodes, per_node)
    env = {**environ, **step_environ(nodes, per_node, hostfile), IN_PLACE: str(number)}
    before = {s: signal.signal(s, _note) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    lines: list[str] = []
    try:
        proc = subprocess.Popen(["srun", *args], env=env, stderr=subprocess.PIPE, text=True, errors="replace")
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            lines.append(line.rstrip("\n"))
        code = proc.wait()
    except OSError as e:
        lines.append(f"srun: error: cannot start srun: {e}")
        code = 1
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        Path(hostfile).unlink(missing_ok=True)
    status = code if code >= 0 else 128 - code
    return Ran(status, tuple(lines), {**environ, IN_PLACE: str(number)})
