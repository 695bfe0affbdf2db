"""--checkpoint-format test-full: the kit's full format, logging its saves and loads."""

from __future__ import annotations

from typing import Any

from hpc_ddp.plugins import FullFormat
from hpc_ddp.run.checkpoint.storage import LOCAL
from hpc_ddp_testplugin import log


class TestFull(FullFormat):
    def stage(self, parts: Any, meta: Any, step: int) -> Any:
        log("format", "stage")
        return super().stage(parts, meta, step)

    @classmethod
    def open(cls, path: Any, verify: bool = True, storage: Any = LOCAL) -> Any:
        log("format", "open")
        return super().open(path, verify=verify, storage=storage)
