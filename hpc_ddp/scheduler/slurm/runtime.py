"""Where a job's tasks run (pure): which `python`, inside which container, with which extra srun options.

Three choices of the interpreter, first that applies:

1. `--python PATH`: pinned; the tasks (and, without a container, the batch shell's steps) run PATH.
2. `--setup` lines or a container: plain `python`, resolved inside the job, after the setup lines (module
   load, `source venv/bin/activate`, `conda activate`) or inside the image. The interpreter that submitted the
   job may not exist on the compute nodes, and is never the one a setup line selects.
3. Neither: the submitting interpreter's absolute path (a shared venv, the usual case without setup lines).

Containers wrap each task, never the batch shell: its steps (`hpc_ddp.launch.slurm.batch`) run Slurm's commands
(scontrol, sacct, scancel), which live on the host, not in an image. So with a container they run the host's
python: `python` after the setup lines, or the submitting interpreter. Both sides need hpc_ddp installed.

- pyxis/enroot: srun's own `--container-image` (and `--container-mounts`, plus the run folder, mounted at the
  same path: the tasks write checkpoints there and the batch shell reads them).
- Apptainer/Singularity: `apptainer exec --nv --bind <run folder> IMAGE python ...` as each task's command:
  `--nv` makes the node's GPUs and driver visible; `--bind` makes the run folder (often on /shared, which
  Apptainer does not bind by default) the same path inside. `APPTAINER_BIND` adds more.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_ddp.errors import UsageError

# srun options that the kit sets itself: `--srun-arg` must not set them behind the flag's (or the log's) back.
_LOGS = "is the kit's: one log per task in <folder>/submitit"
_OWN_SRUN = {
    "--output": _LOGS,
    "-o": _LOGS,
    "--error": _LOGS,
    "-e": _LOGS,
    "--cpus-per-task": "is set by --cpus-per-task: use that flag",
    "-c": "is set by --cpus-per-task: use that flag",
    "--kill-on-bad-exit": "is the kit's: one failing task ends the step",
    "-K": "is the kit's: one failing task ends the step",
    "--container-image": "is set by --container-image: use that flag",
    "--container-mounts": "is set by --container-mounts: use that flag",
}


@dataclass(frozen=True)
class Runtime:
    """The validated environment flags of `submit` (`check` builds one)."""

    python: str = ""  # --python
    setup: bool = False  # --setup lines given
    container_image: str = ""  # pyxis
    container_mounts: str = ""
    apptainer: str = ""  # Apptainer/Singularity image
    srun_args: tuple[str, ...] = ()

    @property
    def container(self) -> bool:
        return bool(self.container_image or self.apptainer)


def check(
    python: str | None,
    setup: Sequence[str],
    container_image: str | None,
    container_mounts: str | None,
    apptainer: str | None,
    srun: Sequence[str],
) -> Runtime:
    """The flags as a Runtime; a bad combination is a UsageError (one line, exit 2)."""
    if container_image and apptainer:
        raise UsageError(
            f"--container-image {container_image!r} and --apptainer {apptainer!r}: choose one container "
            "runner (pyxis/enroot: --container-image; Apptainer/Singularity: --apptainer)"
        )
    if container_mounts and not container_image:
        raise UsageError(
            f"--container-mounts {container_mounts!r} without --container-image: mounts are for a pyxis "
            "container (with --apptainer, set APPTAINER_BIND instead)"
        )
    for name, value in (
        ("--python", python),
        ("--container-image", container_image),
        ("--apptainer", apptainer),
    ):
        if value is not None and not value.strip():
            raise UsageError(f"{name} is empty: give a path (or drop the flag)")
    for arg in srun:
        option = _option(arg)
        if not arg.startswith("-"):
            raise UsageError(
                f"--srun-arg {arg!r}: expected an srun option, e.g. --srun-arg=--mpi=pmix (with `=`, so that "
                "the value is not read as a flag)"
            )
        if option in _OWN_SRUN:
            raise UsageError(f"--srun-arg {arg!r}: {option} {_OWN_SRUN[option]}")
    return Runtime(
        python=python or "",
        setup=bool(setup),
        container_image=container_image or "",
        container_mounts=container_mounts or "",
        apptainer=apptainer or "",
        srun_args=tuple(srun),
    )


def _option(arg: str) -> str:
    """The option an srun argument sets: "--cpus-per-task=2" -> "--cpus-per-task"; a short one may carry its
    value glued on, as srun (getopt) reads it: "-c2" -> "-c" (pure)."""
    if arg.startswith("--"):
        return arg.split("=", 1)[0]
    return arg[:2]


def task_interpreter(rt: Runtime, executable: str) -> str:
    """The interpreter each task runs, unquoted (see the module docstring)."""
    if rt.python:
        return rt.python
    return "python" if rt.setup or rt.container else executable


def batch_interpreter(rt: Runtime, executable: str) -> str:
    """The interpreter of the batch shell's steps: the tasks' one, except inside a container (host side)."""
    if not rt.container:
        return task_interpreter(rt, executable)
    return "python" if rt.setup else executable


def task_command(rt: Runtime, executable: str, folder: str) -> str:
    """How each task starts python, as a shell fragment (submitit's `python` parameter): the interpreter, in
    the Apptainer image when there is one, through hpc_ddp.launch.slurm.start (which blocks the preemption
    signals from its first instruction)."""
    argv = [task_interpreter(rt, executable), "-u", "-m", "hpc_ddp.launch.slurm.start"]
    if rt.apptainer:
        argv = ["apptainer", "exec", "--nv", "--bind", folder, rt.apptainer, *argv]
    return shlex.join(argv)


def srun_options(rt: Runtime, folder: str) -> list[str]:
    """srun options beyond the kit's own: pyxis's (the run folder mounted at its own path), then the user's."""
    options: list[str] = []
    if rt.container_image:
        mounts = ",".join(m for m in (f"{folder}:{folder}", rt.container_mounts) if m)
        options += [f"--container-image={rt.container_image}", f"--container-mounts={mounts}"]
    return [*options, *rt.srun_args]


def explain(rt: Runtime, executable: str) -> str:
    """One comment line for the script: which python the tasks run, and why (and the batch steps', when a
    container makes them differ)."""
    task = task_interpreter(rt, executable)
    if rt.python:
        why = f"{task} (--python)"
    elif rt.container:
        why = "`python` from the image's PATH"
    elif rt.setup:
        why = "`python` as the setup lines leave PATH (--setup; pin one with --python)"
    else:
        why = f"{task}, the submitting interpreter (no --setup or --python given)"
    if rt.container_image:
        why += f", in the pyxis image {rt.container_image}"
    elif rt.apptainer:
        why += f", in the Apptainer image {rt.apptainer}"
    if rt.container:
        steps = batch_interpreter(rt, executable)
        why += f"; the batch steps run {'`python`' if steps == 'python' else steps} on the host"
    return f"# hpc_ddp: the tasks run {why}"
