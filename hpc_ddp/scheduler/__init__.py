"""The scheduler seam: what the kit asks of a scheduler, behind one interface, and the code that asks it.

    base     the interface (`Scheduler`: who am I, requeue me, what happened to job J, which nodes are usable,
             submit, cancel, exclude, its version) and the words every scheduler answers in (Identity, Done,
             Size, Window, Kind, End; job ids such as an array task's "123_4")
    slurm/   Slurm: `client` asks and acts (scontrol, sacct, squeue, sinfo, scancel), `submit` submits (sbatch,
             through submitit), `steps` starts a step on given nodes of the allocation (srun, --spare-nodes),
             `parse` reads each command's output, `states` is the one table of job and node states, `env`
             reads the job's variables, `request` and `runtime` build the sbatch options and srun's
    local    the local launcher's emulation: the srun step it gives each rank, and the interface as it
             answers on one machine (`LocalScheduler`)

`detect` chooses a process's scheduler by the registry (each class's `detect`), `of(name)` gives one by name,
`default()` the registry's first: run/ and report/ name no scheduler (tests/test_architecture.py).

Below the run, ledger and launch layers, above the cluster layer (whose `env` holds the one table of launcher
variables this package reads). No code outside this package runs a Slurm command or builds srun's options
(tests/test_architecture.py checks it). A new scheduler is a folder beside `slurm/`, or a plugin's class (hpc_ddp.registry, docs/plugins.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc_ddp.scheduler.base import Scheduler


def of(name: str, **options: Any) -> Scheduler:
    """The scheduler named `name` in the schedulers' registry (hpc_ddp.registry, entry point group
    `hpc_ddp.schedulers`): "slurm" (the Slurm client; `options` are its own), "local" (the local launcher's
    emulation; `nodes`), or an installed package's. Imported when asked for: a task that never asks pays nothing."""
    from hpc_ddp import registry
    from hpc_ddp.errors import UsageError

    try:
        kind = registry.schedulers.load(name)
    except registry.PluginError:
        raise
    except UsageError as e:
        raise ValueError(
            f"no scheduler named {name!r}: expected one of {', '.join(registry.schedulers.names())}"
        ) from e
    found: Scheduler = kind(**options)
    return found


def detect(launcher: str = "", requeue_by: str = "", **options: Any) -> Scheduler:
    """The scheduler of this process, chosen by the registry: the first registered class (the built-ins first,
    in the registry's order) whose `detect(launcher, requeue_by)` says it runs a process that
    hpc_ddp.cluster.env.detect found under `launcher` and that was told --requeue-by `requeue_by`; the
    registry's first (its default) when none does. `options` are the chosen one's own. Lightning picks its
    cluster environment the same way (each class's `detect`, in a priority order written down)."""
    from hpc_ddp import registry

    for name in registry.schedulers.names():
        entry = registry.schedulers.entry(name)
        if not entry.builtin:
            break  # the built-ins answer for every process: a plugin is asked by name (`of`)
        kind = registry.schedulers.load(name)
        if kind.detect(launcher, requeue_by):
            found: Scheduler = kind(**options)
            return found
    return default(**options)


def default(**options: Any) -> Scheduler:
    """The registry's first scheduler (its default, the cluster's: Slurm), for what asks the cluster whoever
    started the run (its version for run.json, its accounting for a report)."""
    from hpc_ddp import registry

    return of(registry.schedulers.names()[0], **options)


def for_task(requeue_by: str, launcher: str = "") -> Scheduler:
    """The scheduler of a training task (`detect`): the local launcher's (its ranks are told `--requeue-by
    launcher`: their job id is fake), else Slurm's (a task outside Slurm asks it nothing, or gets no answer)."""
    return detect(launcher, requeue_by)
