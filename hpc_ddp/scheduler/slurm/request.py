"""The Slurm side of `submit`, as pure functions: flags -> submitit parameters, and Slurm's answers -> meaning.

Nothing here runs a command or reads `os.environ`: `submitter` (the thin shell) passes the environment and
the text that `sbatch` printed; hpc_ddp.scheduler.slurm.parse reads the other commands. Every rule here is
testable with a table.

The job that `submit` builds and `slurm/ddp.sbatch` are the same job in two forms; both carry:

- `--signal=USR2@<s>` without `B:`: the preemption signal goes to every task, not just to the batch shell;
- `--requeue` and `--open-mode=append`: a requeued run may start again, and appends to its logs;
- `--no-kill`: a node that fails does not end the job; Slurm removes it, srun's step ends ("Node failure on
  node2"), and the batch shell, which outlives the step, records the attempt and decides (requeue away from
  the node, go on with fewer nodes, or stop: never a job left pending on nodes that are gone). Without it
  Slurm requeues the job itself and ends the batch shell meanwhile, so whether anything recorded the attempt
  or stopped a job that no longer fits was a race. Losing the batch shell's own node ends the job (Slurm
  does not requeue it then): hpc_ddp.launch.slurm.lost;
- `srun --kill-on-bad-exit=1`: one failing task ends the step instead of leaving the others in a collective;
- `srun --cpus-per-task=N`: since Slurm 22.05, srun no longer inherits sbatch's `--cpus-per-task`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpc_ddp.cluster.env import without_launcher
from hpc_ddp.errors import UsageError
from hpc_ddp.scheduler.slurm.runtime import Runtime

SIGNAL = "USR2"  # submitit's default too; NCCL has been known to catch USR1
SRUN_FLAGS = ("--kill-on-bad-exit=1",)  # plus --cpus-per-task=N when it is known

# sbatch options that `submit` sets from its own flags: `--slurm` must not set them behind the flag's back.
_OWN_OPTIONS = {
    "nodes": "--nodes",
    "ntasks-per-node": "--tasks-per-node",
    "gpus-per-node": "--gpus-per-node",
    "cpus-per-task": "--cpus-per-task",
    "mem": "--mem-gb",
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "exclusive": "--exclusive",
    "job-name": "--job-name",
    "no-kill": "the kit: a failed node is left to the batch shell, which decides",
    "signal": "--signal-delay-s",
    "output": "--folder",
    "error": "--folder",
}

_TIME = re.compile(r"^(?:(?P<days>\d+)-)?(?P<hours>\d{1,2}):(?P<minutes>\d{2}):(?P<seconds>\d{2})$")
_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def parse_time(text: str) -> int:
    """`--time`: minutes ("90") or `[D-]HH:MM:SS` ("1-02:00:00") -> whole minutes, seconds rounded up."""
    value = text.strip()
    if value.isdigit():
        minutes = int(value)
    else:
        match = _TIME.match(value)
        if match is None or int(match["minutes"]) > 59 or int(match["seconds"]) > 59:
            raise UsageError(
                f"--time {text!r}: expected minutes (e.g. 90) or [D-]HH:MM:SS (e.g. 04:00:00 or 1-00:00:00)"
            )
        seconds = (
            (int(match["days"] or 0) * 24 + int(match["hours"])) * 60 + int(match["minutes"])
        ) * 60 + int(match["seconds"])
        minutes = -(-seconds // 60)
    if minutes <= 0:
        raise UsageError(
            f"--time {text!r}: must be at least 1 minute (Slurm reads 0 as 'no limit', which would "
            "never send the preemption signal)"
        )
    return minutes


def check_signal_delay(delay_s: int, minutes: int) -> None:
    if delay_s <= 0 or delay_s > 65535:
        raise UsageError(f"--signal-delay-s {delay_s}: must be between 1 and 65535 seconds (Slurm's range)")
    if delay_s >= minutes * 60:
        raise UsageError(
            f"--signal-delay-s {delay_s} is not below --time ({minutes * 60} s): the preemption "
            "signal would come at once. Fix: a longer --time or a smaller --signal-delay-s"
        )


def parse_extras(items: Sequence[str]) -> dict[str, Any]:
    """`--slurm KEY=VALUE` (or a bare `--slurm KEY` for a flag) -> sbatch options {key: value or True}."""
    extras: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not _KEY.match(key) or (sep and not value):
            raise UsageError(
                f"--slurm {item!r}: expected KEY=VALUE with an sbatch long option name, e.g. "
                "--slurm mail-type=END (or KEY alone for a flag, e.g. --slurm hold)"
            )
        if key in _OWN_OPTIONS:
            owner = _OWN_OPTIONS[key]
            if not owner.startswith("--"):
                raise UsageError(f"--slurm {item!r}: {key} is set by {owner}")
            raise UsageError(f"--slurm {item!r}: {key} is set by {owner}; use that flag instead")
        extras[key] = value if sep else True
    return extras


def submit_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to run sbatch in: `environ` minus what an enclosing job or launcher put there. sbatch
    exports the submitting environment into the new job (--export=ALL), and srun reads SLURM_* as defaults:
    a stale SLURM_CPUS_PER_TASK or SLURM_NTASKS_PER_NODE from the outer job would silently reshape the inner
    one. SLURM_CONF and the user's SBATCH_* stay (hpc_ddp.cluster.env: the launcher variables)."""
    return without_launcher(environ)


def mem_text(mem_gb: float) -> str:
    """--mem-gb as sbatch's --mem: whole GB, else MB rounded up. Never 0: Slurm reads --mem=0 as "all of the
    node's memory"."""
    if not (math.isfinite(mem_gb) and mem_gb > 0):
        raise UsageError(f"--mem-gb {mem_gb}: must be a positive number of GB, e.g. --mem-gb 64")
    if mem_gb == int(mem_gb):
        return f"{int(mem_gb)}G"
    return f"{math.ceil(mem_gb * 1024)}M"


def srun_args(cpus_per_task: int | None) -> list[str]:
    return [*SRUN_FLAGS, *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else [])]


@dataclass(frozen=True)
class SlurmRequest:
    """The validated Slurm side of a submission (the job shape comes from `launch.shape.JobShape`)."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    minutes: int
    signal_delay_s: int
    job_name: str
    cpus_per_task: int | None = None
    mem: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    setup: tuple[str, ...] = ()
    extras: tuple[tuple[str, Any], ...] = ()
    runtime: Runtime = Runtime()  # which python, which container, extra srun options

    def executor_parameters(self) -> dict[str, Any]:
        """Keyword arguments for submitit's `SlurmExecutor.update_parameters` (its native names)."""
        optional = {
            "gpus_per_node": self.gpus_per_node or None,
            "cpus_per_task": self.cpus_per_task,
            "mem": self.mem,
            "partition": self.partition,
            "account": self.account,
            "qos": self.qos,
            "constraint": self.constraint,
            "exclusive": True if self.exclusive else None,
        }
        params: dict[str, Any] = {
            "job_name": self.job_name,
            "nodes": self.nodes,
            "ntasks_per_node": self.tasks_per_node,
            "time": self.minutes,
            "signal_delay_s": self.signal_delay_s,
            # One log per task, stdout and stderr interleaved in the order they happened.
            "stderr_to_stdout": True,
            "srun_args": srun_args(self.cpus_per_task),
            "additional_parameters": {"requeue": True, "no_kill": True, **dict(self.extras)},
            "wckey": None,  # submitit's default "submitit" is refused where wckeys are enforced
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.setup:
            params["setup"] = list(self.setup)
        return params


# bash runs a trap only once the foreground command has returned: srun (the tasks have ended by then) or the
# `end` step (whose own requeue signals this shell). So the line says what happened, not what is to come.
TRAP = (
    "trap 'echo \"[hpc_ddp] the batch shell got SIGTERM (scancel, a requeue or the time limit); it ends once "
    "the attempt is recorded\" >&2' TERM"
)
# The preemption signals are the tasks' (hpc_ddp.run.loop.preemption); one that reaches this shell (`scancel -b
# --signal=USR2`, `--signal=B:USR2`) would end it with the job's record unwritten: noted, never fatal.
USR_TRAP = (
    "trap 'echo \"[hpc_ddp] the batch shell got a preemption signal: it is for the tasks\" >&2' USR1 USR2"
)


# A job that went on with fewer nodes (--min-nodes, hpc_ddp.launch.slurm.min_nodes) still has the task count
# sbatch computed at submission in its environment, and srun would start that many tasks on the nodes left
# (4 on one node of a 2 x 2 job, measured on Slurm 22.05): a count above what the allocation holds at
# --ntasks-per-node comes from the allocation instead. Any other count is the user's, and stays.
TASK_COUNT = (
    "if [[ ${SLURM_NTASKS_PER_NODE:-} =~ ^[0-9]+$ ]] && (( ${SLURM_NTASKS:-0} > SLURM_NTASKS_PER_NODE * "
    "${SLURM_JOB_NUM_NODES:-0} )); then export SLURM_NTASKS=$((SLURM_NTASKS_PER_NODE * SLURM_JOB_NUM_NODES)); "
    "export SLURM_NPROCS=$SLURM_NTASKS; fi"
)


def with_batch_steps(
    params: dict[str, Any], python: str, argv: Sequence[str], submitit_dir: str, select: str = ""
) -> dict[str, Any]:
    """The executor parameters plus the batch shell's steps around srun (hpc_ddp.launch.slurm.batch), as
    slurm/ddp.sbatch has them: `begin` in the setup lines, `end` (given srun's status) in the teardown lines.
    The trap keeps the shell alive on SIGTERM (scancel, a requeue): `end` still decides. srun's own lines land
    in the batch log, `<job id>_0_log.out`.

    `select`: a job array's (hpc_ddp.launch.sweep.array): a shell line that sets the positional parameters to
    this element's training options, which the steps then get instead of `argv`, and `element` to the id
    submitit names the element's log by (`<array id>_<index>`, the job id of an array of one)."""
    import shlex

    module = f"{python} -m hpc_ddp.launch.slurm.batch"
    options = shlex.join(["--", *argv]) if not select else '-- "$@"'
    job = "${element}" if select else "${SLURM_JOB_ID}"  # `select` sets $element: ARRAY_INDEX, or the job id
    log = shlex.quote(submitit_dir) + f'/"{job}_0_log.out"'
    setup = [
        USR_TRAP,
        *params.get("setup", []),
        *([select] if select else []),
        "export HPC_DDP_BATCH=1  # the tasks leave requeueing to this shell's `end` step",
        f"step=$({module} begin --log {log} {options}) || exit $?",
        'eval "$step"  # fsdp: malloc settings; --spare-nodes: an srun function for all nodes but the spares',
        TRAP,
        TASK_COUNT,
    ]
    teardown = ["status=$?  # srun's", f'{module} end --status "$status" {options}', "exit $?"]
    return {**params, "setup": setup, "teardown": teardown}


# ----- Slurm's answers ------------------------------------------------------------------------------------

_SBATCH_FIXES = (
    ("partition", "check --partition (`sinfo -s` lists the partitions)"),
    ("unrecognized option", "check the --slurm option names (`sbatch --help`)"),
    ("invalid option", "check the --slurm option names (`sbatch --help`)"),
    ("time", "check --time (minutes, or [D-]HH:MM:SS) and the partition's limit (`sinfo -s`)"),
    ("account", "check --account (`sacctmgr show assoc user=$USER`)"),
    ("qos", "check --qos (`sacctmgr show assoc user=$USER format=qos`)"),
    ("feature", "check --constraint (`sinfo -o '%N %f'` lists node features)"),
    ("memory", "ask for less --mem-gb than a node has (`sinfo -N -l`)"),
    ("gres", "check --gpus-per-node: this partition may have no (or fewer) GPUs (`sinfo -o '%P %G'`)"),
    (
        "node configuration is not available",
        ("ask for no more nodes, CPUs, GPUs or memory than the partition's nodes have (`sinfo -N -l`)"),
    ),
    ("node count", "ask for no more --nodes than the partition has (`sinfo -s`)"),
)


def sbatch_error(output: str) -> str:
    """One line from sbatch's refusal: its own error text, then the flag to fix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [
        re.sub(r"^sbatch:\s*(error:\s*)?", "", line)
        for line in lines
        if line.startswith("sbatch:") and 'Try "sbatch --help"' not in line
    ]
    errors = (
        [re.sub(r"^Batch job submission failed:\s*", "", e) for e in errors] or lines[-1:] or ["no output"]
    )
    seen = list(dict.fromkeys(errors))  # sbatch often says the same thing twice in two wordings
    reason = "; ".join(seen)
    fix = next((fix for key, fix in _SBATCH_FIXES if key in reason.lower()), "check the Slurm options")
    return f"sbatch refused the job: {reason}. Fix: {fix}"


# Pending reasons that waiting will not cure: the job asks for more than the partition or account allows.
_HOPELESS = (
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "MaxNodePerJob",
    "MaxCpuPerJob",
    "MaxGRESPerJob",
    "MaxWallDurationPerJob",
)


def pending_hint(reason: str) -> str:
    """squeue's pending reason, with a warning when Slurm will never start the job as asked."""
    if any(key in reason for key in _HOPELESS):
        return (
            f"{reason}: Slurm will not start this job as asked (more nodes, GPUs or time than the partition "
            "or account allows; `sinfo -s`, `scontrol show partition`). scancel it and fix the flags"
        )
    return reason
