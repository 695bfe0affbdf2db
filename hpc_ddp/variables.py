"""Every `HPC_DDP_*` environment variable, each listed once with its meaning and its kind.

- "user": a setting a user may give (documented in the README or a script's header).
- "channel": how one process of the kit tells another something (a batch shell its tasks, the local launcher
  its ranks). A channel belongs to the job that set it: inherited by a job started from inside that one, it
  would describe the outer job (HPC_DDP_BATCH=1 would tell the inner job's tasks that a batch shell requeues
  them, and none does), so `hpc_ddp.cluster.env.without_launcher` strips every channel (CHANNELS).
- "test": a knob of the test suite, the CI or the local Slurm cluster's scripts.

Code names a variable through the constants below (or `registered`), never by a string literal of its own;
tests/test_variables.py fails on any `HPC_DDP_` name in the tree that is not listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["user", "channel", "test"]


@dataclass(frozen=True)
class Variable:
    name: str
    kind: Kind
    meaning: str


BATCH = "HPC_DDP_BATCH"
FOLDER_FILE = "HPC_DDP_FOLDER_FILE"
FOLDER_LOCK = "HPC_DDP_FOLDER_LOCK"
LIVE_PROGRESS = "HPC_DDP_LIVE_PROGRESS"
SAVE_BACKOFF_S = "HPC_DDP_SAVE_BACKOFF_S"
SAVE_DELAY_S = "HPC_DDP_SAVE_DELAY_S"
RESUME_PROBE = "HPC_DDP_RESUME_PROBE"
IN_PLACE = "HPC_DDP_IN_PLACE"
STEP_ARGS = "HPC_DDP_STEP_ARGS"
LOCAL_JOB_ID = "HPC_DDP_LOCAL_JOB_ID"
SNAPSHOT_DIR = "HPC_DDP_SNAPSHOT_DIR"

VARIABLES: tuple[Variable, ...] = (
    # ----- channels between the kit's processes -----
    Variable(
        BATCH,
        "channel",
        "set to 1 by the kit's batch scripts (slurm/ddp.sbatch, submit's job) for their tasks: the batch shell's "
        "`end` step (hpc_ddp.launch.slurm.batch) decides and requeues after srun returns, rank 0 does not",
    ),
    Variable(
        FOLDER_FILE,
        "channel",
        "a file the batch script names for its tasks; global rank 0 writes the run folder's absolute path "
        "into it, and the batch shell's `end` step reads it (hpc_ddp.run.folder.tell_folder)",
    ),
    Variable(
        FOLDER_LOCK,
        "channel",
        "the token of the run folder's run.lock that the local launcher holds for its ranks: their rank 0 "
        "inherits the lock instead of taking it (hpc_ddp.run.folder.hold_folder)",
    ),
    Variable(
        LIVE_PROGRESS,
        "channel",
        "1 when the local launcher's console is a terminal: rank 0, whose stdout is a pipe, then sends its "
        "live progress line for the launcher to draw in place (hpc_ddp.run.records.metrics.live_mode)",
    ),
    Variable(
        IN_PLACE,
        "channel",
        "set by the batch shell of a job with --spare-nodes for each step it starts inside the allocation: how "
        "many restarts in place came before it in this allocation (hpc_ddp.cluster.env.restart_count; "
        "hpc_ddp.launch.slurm.inplace)",
    ),
    Variable(
        STEP_ARGS,
        "channel",
        "a file in which the batch shell's first srun of a job with --spare-nodes writes its arguments, so "
        "that the steps started inside the allocation run the same command (hpc_ddp.launch.slurm.inplace)",
    ),
    Variable(
        LOCAL_JOB_ID,
        "channel",
        "the fake job id a local sweep gives each trial's launcher, so that trials running at once never derive "
        "the same rendezvous port (hpc_ddp.launch.sweep.local)",
    ),
    # ----- user settings -----
    Variable(
        SNAPSHOT_DIR,
        "user",
        "where --snapshot-every-steps keeps each node's snapshots, <dir>/<job id>/<node name>/ (default "
        "/dev/shm/hpc_ddp: memory; docs/memory.md)",
    ),
    Variable(
        SAVE_BACKOFF_S,
        "user",
        "seconds before the first retry of a failed checkpoint write (default 1; the delays double)",
    ),
    Variable(
        SAVE_DELAY_S,
        "user",
        "seconds every checkpoint write waits before it starts (default 0): a slow file system on demand. The "
        "resume check (python -m hpc_ddp.doctor resume) sets it for its stopped run, so that a stop lands "
        "while a save is in flight; a user setting, not a channel, so that a local launcher passes it on",
    ),
    Variable(
        RESUME_PROBE,
        "user",
        "set by the resume check for the local run it starts: the task its probe (--task "
        "hpc_ddp.doctor.probe:build) wraps, where it writes its trace, and where it stops the run (JSON)",
    ),
    Variable(
        "HPC_DDP_JOB_ENV",
        "user",
        "slurm/ddp.sbatch: the site setup file it sources (default: env/job.env in the submit directory)",
    ),
    Variable("HPC_DDP_PYTHON", "user", "slurm/ddp.sbatch: the python the tasks run (as submit's --python)"),
    Variable(
        "HPC_DDP_SRUN_ARGS",
        "user",
        "slurm/ddp.sbatch: extra srun options for the tasks (as submit's --srun-arg)",
    ),
    Variable(
        "HPC_DDP_CONTAINER_IMAGE",
        "user",
        "slurm/ddp.sbatch: a pyxis/enroot image the tasks run in (as submit's --container-image)",
    ),
    Variable(
        "HPC_DDP_CONTAINER_MOUNTS",
        "user",
        "slurm/ddp.sbatch: pyxis mounts beside the run folder's (as submit's --container-mounts)",
    ),
    Variable(
        "HPC_DDP_APPTAINER",
        "user",
        "slurm/ddp.sbatch: an Apptainer/Singularity image the tasks run in with `exec --nv` (as submit's --apptainer)",
    ),
    Variable("HPC_DDP_VENV", "user", "env/setup.sh: where to create the virtual environment (default .venv)"),
    Variable(
        "HPC_DDP_TORCH", "user", "env/setup.sh: the CPU torch version to install on a machine without one"
    ),
    Variable("HPC_DDP_NO_UV", "user", "env/setup.sh: 1 installs the packages with pip instead of uv"),
    # ----- the test suite, the CI and the local Slurm cluster -----
    Variable("HPC_DDP_NO_SLURM", "test", "env/test.sh: 1 runs the suite without the local Slurm cluster"),
    Variable(
        "HPC_DDP_REQUIRE_SLURM",
        "test",
        "1 (set by env/test.sh): a Slurm test that cannot reach the local cluster fails instead of skipping",
    ),
    Variable(
        "HPC_DDP_REQUIRE_CHROMIUM",
        "test",
        "1 (set by env/test.sh): the report's screenshot test fails instead of skipping without chromium",
    ),
    Variable("HPC_DDP_REGEN_GOLDEN", "test", "1 rewrites the golden --print-sbatch file of the tests"),
    Variable(
        "HPC_DDP_CI_DEADLINE_S", "test", ".ci/run: the whole suite's deadline in seconds (default 3600)"
    ),
    Variable("HPC_DDP_SLURM_DIR", "test", "env/slurm/cluster.sh: the local cluster's state directory"),
    Variable(
        "HPC_DDP_SLURM_NODES", "test", "env/slurm/cluster.sh: how many nodes the local cluster emulates"
    ),
    Variable(
        "HPC_DDP_SLURM_BESIDE",
        "test",
        "env/slurm/cluster.sh: 1 starts a second local cluster beside the machine's first (own daemons and "
        "ports, the first one's node names; /etc/hosts and /etc/slurm/slurm.conf left alone)",
    ),
    Variable(
        "HPC_DDP_SLURM_FIRST_JOB_ID",
        "test",
        "env/slurm/cluster.sh: a second cluster's first job id (default 12000), so that a third one beside "
        "them derives no rendezvous port theirs use",
    ),
    Variable(
        "HPC_DDP_SLURM_DIR_2",
        "test",
        "env/test.sh: the second local cluster's state directory; set, tests/workers.py runs the files in "
        "its SECOND_CLUSTER there",
    ),
)

BY_NAME = {v.name: v for v in VARIABLES}
CHANNELS = frozenset(v.name for v in VARIABLES if v.kind == "channel")


def registered(name: str) -> str:
    """`name`, if it is listed here (KeyError otherwise): for code that builds a name it does not import."""
    return BY_NAME[name].name
