"""The schedulers `test-local` (the local launcher's emulation) and `test-slurm` (the Slurm client), each
logging what it is asked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.scheduler.local import LocalScheduler
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp_testplugin import log


class TestLocalScheduler(LocalScheduler):
    def identity(self, environ: Mapping[str, str]) -> Any:
        log("scheduler", "identity")
        return super().identity(environ)

    def usable(self, exclude: Sequence[str] = (), partition: str = "") -> list[str]:
        log("scheduler", "usable")
        return super().usable(exclude, partition)


class TestSlurmScheduler(SlurmClient):
    """The scheduler `test-slurm`: the built-in Slurm client, logging each call of the interface the batch shell's
    supervisor makes (tests/plugin_scheduler.py runs the supervisor's unit tables through it)."""

    def identity(self, environ: Mapping[str, str]) -> Any:
        log("scheduler", "identity")
        return super().identity(environ)

    def usable(self, exclude: Sequence[str] = (), partition: str = "") -> list[str]:
        log("scheduler", "usable")
        return super().usable(exclude, partition)

    def step_end(self, lines: Sequence[str]) -> Any:
        log("scheduler", "step_end")
        return super().step_end(lines)

    def lost(
        self, job: str, nodes: Sequence[str], said: Sequence[str], restart: int, view: Any = None
    ) -> tuple[str, ...]:
        log("scheduler", "lost")
        return super().lost(job, nodes, said, restart, view)

    def cancel(self, job: str, signal: str = "") -> Any:
        log("scheduler", "cancel")
        return super().cancel(job, signal)

    def requeue_excluding(
        self,
        job: str,
        exclude: Sequence[str],
        excluded: Sequence[str] = (),
        already: bool = False,
        size: Any = None,
    ) -> Any:
        log("scheduler", "requeue_excluding")
        return super().requeue_excluding(job, exclude, excluded, already, size)
