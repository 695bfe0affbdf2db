"""The scheduler `test-local`: the local launcher's emulation, logging what it is asked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.scheduler.local import LocalScheduler
from hpc_ddp_testplugin import log


class TestLocalScheduler(LocalScheduler):
    def identity(self, environ: Mapping[str, str]) -> Any:
        log("scheduler", "identity")
        return super().identity(environ)

    def usable(self, exclude: Sequence[str] = (), partition: str = "") -> list[str]:
        log("scheduler", "usable")
        return super().usable(exclude, partition)
