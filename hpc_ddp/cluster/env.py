"""Who am I in the job? Derive ranks, counts and the rendezvous address from the launcher's variables.

`detect(environ)` reads only the mapping it is given (tests pass a dict, the task passes `os.environ`) and
returns a frozen `DistEnv`. The launchers are tried in a fixed order:

1. torchrun (`TORCHELASTIC_RUN_ID`): it can run *inside* an srun step, where the SLURM_* variables describe
   the step (one task per node) and not the torch ranks, so it must win.
2. Slurm task variables (`SLURM_PROCID` ...): one task per GPU, started by `srun` (or by our local launcher,
   which sets the same variables).
3. A single process.

For Slurm every field prefers the step-level variable over the job-level one: an `srun` step may use part of
the allocation, or place an uneven number of tasks per node, and only the step variables say so.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from hpc_ddp.cluster import hostlist
from hpc_ddp.errors import ClusterConfigError
from hpc_ddp.variables import CHANNELS, IN_PLACE

Launcher = Literal["torchrun", "slurm", "single"]
T = TypeVar("T")

# Ports are derived as PORT_BASE + job_id % PORT_SPAN: unprivileged (>= 1024) and below Linux's ephemeral
# floor (32768, net.ipv4.ip_local_port_range), so an outgoing connection never sits on our port. Two jobs
# whose ids differ by less than PORT_SPAN never collide (a rule on the id's last 4 digits aliases every 10^4).
PORT_BASE = 10000
PORT_SPAN = 32768 - PORT_BASE

# ----- The launcher variables: one table ----------------------------------------------------------------
# Every variable a launcher sets for its tasks is named here and nowhere else. `detect` reads them; whatever
# starts tasks or jobs of its own (the local launcher, sbatch from inside a job, the bench, the tests) first
# removes them all from what it passes on (`without_launcher`): inherited, they describe the *outer* job, and
# a task started with them would believe it is one of that job's ranks.
#
# Slurm variable names, as data. The first name that is set wins: step-level before job-level. Measured inside
# `srun -N1 -n1 -w node2` in a `-N2` allocation (tests/data/slurm_env/step_node2_1x1.json): SLURM_NODEID=0
# (relative to the step, so the step's first node is node 0), SLURM_NNODES=1 and SLURM_NTASKS=1 (srun rewrites
# them for the step), but SLURM_JOB_NUM_NODES=2 and SLURM_NODELIST=SLURM_JOB_NODELIST=node[1-2] (the job's).
# So SLURM_NNODES must come before SLURM_JOB_NUM_NODES, and only SLURM_STEP_NODELIST names the step's hosts.
SLURM_VARS: dict[str, tuple[str, ...]] = {
    "rank": ("SLURM_PROCID",),
    "local_rank": ("SLURM_LOCALID",),
    "node_rank": ("SLURM_NODEID",),
    "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
    "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    # An element of a job array: the array's id and its index (its own SLURM_JOB_ID is another number).
    "array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "array_task_id": ("SLURM_ARRAY_TASK_ID",),
    # srun exports these to its tasks; the batch shell and salloc have neither (they have SLURM_PROCID=0 too).
    "step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),
    # This task's node as Slurm names it (what ExcNodeList takes): the host name may differ.
    "node_name": ("SLURMD_NODENAME",),
    # The job's, not the step's: its whole allocation (attempts.jsonl's nodes), the node count it asked for
    # (the batch shell's: hpc_ddp.scheduler.slurm.env), its --ntasks-per-node (set only when given), and the
    # directory srun starts the tasks in.
    "job_nodelist": ("SLURM_JOB_NODELIST",),
    "job_num_nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "ntasks_per_node": ("SLURM_NTASKS_PER_NODE",),
    "working_dir": ("SLURM_WORKING_DIR",),
    # How srun bound this task's CPUs (hpc_ddp.cluster.placement), and what the job asked for (the doctor).
    "cpu_bind": ("SLURM_CPU_BIND",),
    "cpu_bind_type": ("SLURM_CPU_BIND_TYPE",),
    "cpu_bind_list": ("SLURM_CPU_BIND_LIST",),
    "cpus_per_task": ("SLURM_CPUS_PER_TASK",),
}

# What torchrun sets; the first seven are also what `DistEnv.torch_env` writes for user code.
TORCHRUN_VARS: dict[str, tuple[str, ...]] = {
    "rank": ("RANK",),
    "local_rank": ("LOCAL_RANK",),
    "world_size": ("WORLD_SIZE",),
    "local_world_size": ("LOCAL_WORLD_SIZE",),
    "node_rank": ("GROUP_RANK",),
    "master_addr": ("MASTER_ADDR",),
    "master_port": ("MASTER_PORT",),
    "job_id": ("TORCHELASTIC_RUN_ID",),
    "num_nodes": ("GROUP_WORLD_SIZE",),  # torchrun >= 2.0
}

# How often the job was started again: Slurm raises SLURM_RESTART_COUNT at every requeue (the local launcher sets
# it the same way at every restart); torchrun's agent numbers its rounds in TORCHELASTIC_RESTART_COUNT, out of
# TORCHELASTIC_MAX_RESTARTS. Read by `restart_count`, and nowhere else.
SLURM_RESTART_VAR = "SLURM_RESTART_COUNT"
# A step started inside the allocation after a failure (--spare-nodes, hpc_ddp.launch.slurm.inplace) keeps the
# job's SLURM_RESTART_COUNT: the batch shell numbers it in HPC_DDP_IN_PLACE (1, 2, ...), and its restart count
# is SLURM_RESTART_COUNT + IN_PLACE_STRIDE x that number. A job without restarts in place numbers its
# attempts as before; `requeues` gives back Slurm's count (what accounting and the controller number runs by),
# `in_place` the step's number, and `order` sorts attempts as they happened.
IN_PLACE_STRIDE = 1000
TORCHRUN_RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")

# Everything else Slurm, srun, salloc, submitit and torchrun set for a task goes by these prefixes (srun reads
# SLURM_*/SRUN_* as defaults: a stale SLURM_CPUS_PER_TASK from an outer job would reshape an inner one). The
# kit's own channels between processes (hpc_ddp.variables.CHANNELS: HPC_DDP_BATCH, the run folder's file and
# lock, the live progress line) belong to the job that set them, like a launcher's variables.
SLURM_PREFIX = "SLURM_"  # every variable Slurm sets for a job's processes but SLURMD_NODENAME
LAUNCHER_PREFIXES = (SLURM_PREFIX, "SLURMD_", "SRUN_", "SALLOC_", "SUBMITIT_", "TORCHELASTIC_")
LAUNCHER_NAMES = frozenset({name for names in TORCHRUN_VARS.values() for name in names} | CHANNELS)
# Kept: which cluster to talk to is the site's setting, not the job's. (SBATCH_* are kept too: Slurm never sets
# them, so they are the user's own defaults.)
SITE_VARS = frozenset({"SLURM_CONF"})

# The torch variables that name a rank. sbatch copies the submitting shell's environment into the job, so a
# stale `export RANK=0` from an earlier experiment would arrive in every task: they must agree with Slurm or fail.
TORCH_RANK_VARS = {
    TORCHRUN_VARS[field][0]: field for field in ("rank", "local_rank", "world_size", "local_world_size")
}


def is_launcher_var(name: str) -> bool:
    """Set by a launcher for its tasks (and so never to be passed on to tasks or jobs started from one)."""
    return name not in SITE_VARS and (name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES)


def without_launcher(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` minus every launcher variable: what a process may pass on to the tasks or jobs it starts."""
    return {k: v for k, v in environ.items() if not is_launcher_var(k)}


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as derived by `detect`."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int  # 0 for a single process: the store picks a free port
    job_id: str | None
    launcher: Launcher
    nodes: tuple[str, ...] = ()  # the step's hosts, in Slurm order (empty outside Slurm)
    overrides: tuple[str, ...] = ()  # explicit MASTER_ADDR/MASTER_PORT that replaced derived values
    restart: int = 0  # which start of the job this is, 0 the first (`restart_count`)
    node: str = (
        ""  # this task's node as the scheduler names it (SLURMD_NODENAME, what ExcNodeList takes), else
    )
    # the host name

    @property
    def is_restart(self) -> bool:
        """Started again by its launcher (a requeue, a local restart, a torchrun round after the first): such a
        start continues from the run's own latest checkpoint, whatever --resume says (hpc_ddp.run.checkpoint.resume)."""
        return self.restart > 0

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one rank that logs progress and writes checkpoints."""
        return self.rank == 0

    def torch_env(self) -> dict[str, str]:
        """The variables torch and user code expect (what torchrun would have set)."""
        fields = (
            "rank",
            "local_rank",
            "world_size",
            "local_world_size",
            "node_rank",
            "master_addr",
            "master_port",
        )
        return {TORCHRUN_VARS[field][0]: str(getattr(self, field)) for field in fields}


def port_for_job(job_id: str) -> int:
    """The rendezvous port every rank derives from the job id alone, without talking to the others.

    Het-job components ("123+0", "123+1") are one job and one world: they share the port of 123. Array
    tasks ("123_4", "123_5") are separate jobs that may land on the same node: they get 123+4, 123+5.
    Anything else that is not a plain decimal id is hashed.
    """
    head = job_id.strip().split("+")[0]
    base, _, task = head.partition("_")
    if _decimal(base) and (not task or _decimal(task)):
        number = int(base) + (int(task) if task else 0)
    else:
        number = zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def slurm_job_id(environ: Mapping[str, str]) -> str | None:
    """The job's id as Slurm's commands take it and the run's records name it (pure): `ARRAY_TASK` ("123_4") for
    an element of a job array (`scontrol requeue 123_4` requeues that element alone, `sacct -j 123` lists every
    element), else SLURM_JOB_ID; None outside a job."""
    array, task = _first(environ, SLURM_VARS["array_job_id"]), _first(environ, SLURM_VARS["array_task_id"])
    if array and task and _decimal(array[1].strip()) and _decimal(task[1].strip()):
        return f"{array[1].strip()}_{task[1].strip()}"
    job = _first(environ, SLURM_VARS["job_id"])
    return job[1] if job else None


def _decimal(text: str) -> bool:
    # str.isdigit() alone accepts "²" or Arabic-Indic digits, which int() rejects or reads differently.
    return text.isascii() and text.isdigit()


def restart_count(environ: Mapping[str, str]) -> int:
    """Which start of the job this is, 0 the first: the one reader of the restart variables (pure).

    Slurm and the local launcher: SLURM_RESTART_COUNT (also in the batch shell, which is no srun step:
    hpc_ddp.launch.slurm.batch names an attempt with this). Under torchrun: its round, TORCHELASTIC_RESTART_COUNT;
    inside a requeued Slurm job each requeue makes room for torchrun's rounds (SLURM_RESTART_COUNT x
    (TORCHELASTIC_MAX_RESTARTS + 1) + the round), so that every start of the job has its own number and a
    requeue's first round is a restart too. Anything unreadable counts as 0."""
    slurm = _count(environ.get(SLURM_RESTART_VAR))
    if not environ.get("TORCHELASTIC_RUN_ID"):
        return slurm + IN_PLACE_STRIDE * _count(environ.get(IN_PLACE))
    rounds = _count(environ.get(TORCHRUN_RESTART_VARS[1])) + 1
    return slurm * rounds + _count(environ.get(TORCHRUN_RESTART_VARS[0]))


def requeues(restart: int) -> int:
    """Slurm's SLURM_RESTART_COUNT of an attempt's restart count (pure): the run accounting knows it by."""
    return restart % IN_PLACE_STRIDE


def in_place(restart: int) -> int:
    """How many restarts inside the allocation came before this attempt's step (0: its first step; pure)."""
    return restart // IN_PLACE_STRIDE


def order(restart: int) -> tuple[int, int]:
    """A sort key of restart counts in the order the attempts happened: by requeue, then step (pure)."""
    return (requeues(restart), in_place(restart))


def _count(text: str | None) -> int:
    return int(text) if text and _decimal(text) else 0


def detect(environ: Mapping[str, str], host: str = "") -> DistEnv:
    """Derive this process's `DistEnv` from `environ` (torchrun > Slurm task > single process). `host` is this
    machine's name (a task passes socket.gethostname()), its node where Slurm does not name it.

    Raises:
        ClusterConfigError: the variables are inconsistent, non-numeric, or describe a launch that would hang.
    """
    if environ.get("TORCHELASTIC_RUN_ID"):
        env = _from_torchrun(environ)
    elif "SLURM_PROCID" in environ and _in_srun_step(environ):
        env = _from_slurm(environ)
    else:
        if environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"):
            _refuse_batch_shell(environ)
        env = _single(environ)
    return replace(env, restart=restart_count(environ), node=environ.get("SLURMD_NODENAME") or host)


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name, "") != "":
            return name, environ[name]
    return None


def _int(environ: Mapping[str, str], names: tuple[str, ...], fix: str) -> int:
    found = _first(environ, names)
    if found is None:
        raise ClusterConfigError(f"{' or '.join(names)} is not set. {fix}")
    name, value = found
    if value.startswith("-") and _decimal(value[1:]):
        raise ClusterConfigError(f"{name}={value} is negative. {fix}")
    if not _decimal(value):  # stricter than int(): no "1_0", " 3" or non-ASCII digits
        raise ClusterConfigError(f"{name}={value!r} is not a non-negative integer. {fix}")
    return int(value)


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    # srun exports SLURM_STEP_ID/SLURM_STEPID to its tasks; the batch shell and salloc have neither, only the
    # job's SLURM_PROCID=0. Our local launcher sets them as srun would.
    return _first(environ, SLURM_VARS["step_id"]) is not None


def _expected_tasks(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """How many tasks a plain `srun` in this allocation would start, and the variable that says so."""
    # `sbatch -N2` without -n sets no SLURM_NTASKS (tests/data/slurm_env/batch_N2_no_ntasks.json), but
    # SLURM_TASKS_PER_NODE=1(x2): srun would start 2 tasks, so this shell is not the whole job either.
    for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
        value = environ.get(name, "")
        if _decimal(value):
            return f"{name}={value}", int(value)
    value = environ.get("SLURM_TASKS_PER_NODE", "")
    try:
        return f"SLURM_TASKS_PER_NODE={value}", sum(hostlist.parse_tasks_per_node(value))
    except hostlist.HostlistError:
        pass
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = environ.get(name, "")
        if _decimal(value):
            return f"{name}={value}", int(value)
    return None


def _refuse_batch_shell(environ: Mapping[str, str]) -> None:
    """Inside an allocation but outside srun: fine for a one-task job, a hang or a lie for more."""
    expected = _expected_tasks(environ)
    if expected is not None and expected[1] > 1:
        found, ntasks = expected
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        raise ClusterConfigError(
            f"running in Slurm job {job} ({found}) but outside srun, so this would be 1 process instead of "
            f"{ntasks}. Launch each task with srun: `srun python -m hpc_ddp.train ...` (or "
            "`sbatch slurm/ddp.sbatch ...`)"
        )


def _check_leftovers(environ: Mapping[str, str], derived: dict[str, int]) -> None:
    """A RANK/WORLD_SIZE/... left in the environment must agree with the launcher, never silently win."""
    for var, field in TORCH_RANK_VARS.items():
        if environ.get(var, "") not in ("", str(derived[field])):
            raise ClusterConfigError(
                f"{var}={environ[var]} is set in the environment but Slurm says {field}={derived[field]} "
                f"(SLURM_PROCID={environ.get('SLURM_PROCID')}, world size {derived['world_size']}). It was probably "
                f"exported in the shell that ran sbatch. Fix: `unset {var}` before submitting, or launch with torchrun"
            )


def _rendezvous(
    environ: Mapping[str, str], nodes: list[str], job_id: str | None, world_size: int
) -> tuple[str, int, tuple[str, ...]]:
    """MASTER_ADDR/PORT: explicit variables win (and are reported); else the first node and the job's port."""
    derived_addr = nodes[0] if nodes else None
    derived_port = port_for_job(job_id) if job_id else None
    overrides = []
    addr = environ.get("MASTER_ADDR") or derived_addr
    if environ.get("MASTER_ADDR") and environ["MASTER_ADDR"] != derived_addr:
        overrides.append(f"MASTER_ADDR={environ['MASTER_ADDR']} (derived: {derived_addr})")
    if addr is None:
        if world_size > 1:  # never fall back to localhost: each node would form its own world and hang
            raise ClusterConfigError(
                "cannot find the rendezvous host: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset and "
                "MASTER_ADDR is not given. Launch with srun inside an allocation, or export MASTER_ADDR"
            )
        addr = "127.0.0.1"
    port = derived_port if derived_port is not None else 0
    if environ.get("MASTER_PORT"):
        try:
            port = int(environ["MASTER_PORT"])
        except ValueError:
            raise ClusterConfigError(
                f"MASTER_PORT={environ['MASTER_PORT']!r} is not an integer. "
                "Fix: unset it (the port is derived from the job id) or set a number"
            ) from None
        if not 1 <= port <= 65535:
            raise ClusterConfigError(
                f"MASTER_PORT={port} is outside 1-65535. Fix: unset it or pick a valid port"
            )
        if port != derived_port:
            overrides.append(f"MASTER_PORT={port} (derived: {derived_port})")
    return addr, port, tuple(overrides)


def _parse(parser: Callable[[str], T], found: tuple[str, str]) -> T:
    """Run a hostlist parser on a variable's value; its error names the variable as well as the value."""
    name, value = found
    try:
        return parser(value)
    except hostlist.HostlistError as e:
        raise ClusterConfigError(
            f"{name}: {e}. Fix: check the job's srun/sbatch line; hpc_ddp reads the "
            "variables Slurm sets, so this one was changed or set by hand"
        ) from e


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    fix = "Are you inside `srun`? Check the job's srun line."
    rank = _int(environ, SLURM_VARS["rank"], fix)
    local_rank = _int(environ, SLURM_VARS["local_rank"], fix)
    node_rank = _int(environ, SLURM_VARS["node_rank"], fix)
    world_size = _int(environ, SLURM_VARS["world_size"], fix)
    num_nodes = _int(environ, SLURM_VARS["num_nodes"], fix)
    nodelist = _first(environ, SLURM_VARS["nodelist"])
    tasks = _first(environ, SLURM_VARS["tasks_per_node"])
    job = _first(environ, SLURM_VARS["job_id"])
    job_id = slurm_job_id(environ)
    nodes = _parse(hostlist.expand, nodelist) if nodelist else []
    per_node = _parse(hostlist.parse_tasks_per_node, tasks) if tasks else [world_size // max(num_nodes, 1)]
    if world_size == 0 or num_nodes == 0:
        raise ClusterConfigError(f"Slurm reports {world_size} tasks on {num_nodes} nodes. {fix}")
    if rank >= world_size:
        raise ClusterConfigError(
            f"SLURM_PROCID={rank} but the step has {world_size} tasks "
            f"({(_first(environ, SLURM_VARS['world_size']) or ('SLURM_NTASKS',))[0]}): rank must be < "
            f"world size. {fix}"
        )
    if node_rank >= num_nodes:
        raise ClusterConfigError(f"SLURM_NODEID={node_rank} but the step has {num_nodes} nodes. {fix}")
    if nodelist and len(nodes) != num_nodes:
        raise ClusterConfigError(
            f"{nodelist[0]}={nodelist[1]} names {len(nodes)} hosts but the step has {num_nodes} nodes. {fix}"
        )
    if len(per_node) == 1 and num_nodes > 1:
        per_node = per_node * num_nodes
    if len(per_node) != num_nodes or sum(per_node) != world_size:
        raise ClusterConfigError(
            f"{tasks[0] if tasks else 'tasks per node'}={tasks[1] if tasks else per_node} does not "
            f"add up to {world_size} tasks on {num_nodes} nodes. {fix}"
        )
    local_world_size = per_node[node_rank]
    if local_rank >= local_world_size:
        where = f"{tasks[0]}={tasks[1]}" if tasks else f"{world_size} tasks on {num_nodes} nodes"
        raise ClusterConfigError(
            f"SLURM_LOCALID={local_rank} but node {node_rank} runs {local_world_size} tasks "
            f"of this step ({where}): local rank must be < tasks on this node. {fix}"
        )
    derived = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "local_world_size": local_world_size,
    }
    _check_leftovers(environ, derived)
    # The port from the job's own SLURM_JOB_ID, unique among the jobs that exist, also for an array element:
    # its ARRAY_TASK (123_4 -> port of 127) could be another running job's id (127) on the same node.
    addr, port, overrides = _rendezvous(environ, nodes, job[1] if job else job_id, world_size)
    _check_rank0_host(environ, rank, addr, nodes)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        job_id=job_id,
        launcher="slurm",
        nodes=tuple(nodes),
        overrides=overrides,
    )


def _check_rank0_host(environ: Mapping[str, str], rank: int, addr: str, nodes: list[str]) -> None:
    """Rank 0 hosts the store on its own node; everyone else dials MASTER_ADDR. They must be the same host.

    Slurm's default block distribution puts task 0 on the step's first node; `--distribution=arbitrary` or a
    hostfile may not, and then every other rank would wait at a host where nobody listens. Rank 0 knows its
    node (SLURMD_NODENAME) and fails at once instead.
    """
    here = environ.get("SLURMD_NODENAME")
    if rank == 0 and here and nodes and addr == nodes[0] and here != nodes[0]:
        raise ClusterConfigError(
            f"rank 0 runs on {here} but the rendezvous host is {nodes[0]}, the first node of the step: the tasks "
            "are not in block order. Fix: srun --distribution=block, or export MASTER_ADDR=<rank 0's host>"
        )


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    fix = "These are set by torchrun; was the environment changed after it started?"
    values = {
        field: _int(environ, names, fix)
        for field, names in TORCHRUN_VARS.items()
        if field in ("rank", "local_rank", "world_size", "local_world_size")
    }
    given = _first(environ, TORCHRUN_VARS["node_rank"])
    node_rank = _int(environ, TORCHRUN_VARS["node_rank"], fix) if given else 0
    if values["rank"] >= values["world_size"] or values["local_rank"] >= values["local_world_size"]:
        raise ClusterConfigError(
            f"torchrun gave RANK={values['rank']} WORLD_SIZE={values['world_size']} "
            f"LOCAL_RANK={values['local_rank']} LOCAL_WORLD_SIZE={values['local_world_size']}: "
            f"a rank is out of range. {fix}"
        )
    addr = environ.get("MASTER_ADDR")
    if not addr:
        raise ClusterConfigError(f"MASTER_ADDR is not set. {fix}")
    port = _int(environ, TORCHRUN_VARS["master_port"], fix)
    if _first(environ, TORCHRUN_VARS["num_nodes"]):
        num_nodes = _int(environ, TORCHRUN_VARS["num_nodes"], fix)
    else:  # torchrun < 2.0 did not export it
        num_nodes = max(1, values["world_size"] // values["local_world_size"])
    if node_rank >= num_nodes:
        raise ClusterConfigError(
            f"torchrun gave GROUP_RANK={node_rank} but there are {num_nodes} nodes "
            f"(GROUP_WORLD_SIZE): node rank must be < nodes. {fix}"
        )
    return DistEnv(
        rank=values["rank"],
        local_rank=values["local_rank"],
        world_size=values["world_size"],
        local_world_size=values["local_world_size"],
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        job_id=environ["TORCHELASTIC_RUN_ID"],
        launcher="torchrun",
    )


def _single(environ: Mapping[str, str]) -> DistEnv:
    world = environ.get("WORLD_SIZE")
    if world not in (None, "", "1"):
        raise ClusterConfigError(
            f"WORLD_SIZE={world} is set but no launcher is detected (no torchrun, no srun step), so the other "
            f"{world} ranks would never arrive. Fix: launch with torchrun or srun, or `unset WORLD_SIZE RANK`"
        )
    for var in ("RANK", "LOCAL_RANK"):
        if environ.get(var) not in (None, "", "0"):
            raise ClusterConfigError(
                f"{var}={environ[var]} is set but this is a single process (no torchrun, no "
                f"srun step). Fix: `unset {var}` or launch with torchrun/srun"
            )
    addr, port, overrides = _rendezvous(environ, [], None, 1)
    return DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr=addr,
        master_port=port,
        job_id=environ.get("SLURM_JOB_ID"),
        launcher="single",
        overrides=overrides,
    )
