"""--checkpoint-format test-full: the kit's full format, logging its saves and loads."""

from __future__ import annotations

from typing import Any

from hpc_ddp.plugins import FullFormat
from hpc_ddp_testplugin import log


class TestFull(FullFormat):
    def stage(self, parts: Any, meta: Any, step: int) -> Any:
        log("format", "stage")
        return super().stage(parts, meta, step)

    @classmethod
    def open(cls, path: Any, storage: Any, verify: bool = True) -> Any:
        log("format", "open")
        return super().open(path, storage, verify=verify)

    @classmethod
    def export(cls, path: Any, out: Any, storage: Any, verify: bool = True) -> int:
        log("format", "export")
        return super().export(path, out, storage, verify)

    @classmethod
    def load_model(cls, path: Any, model: Any, storage: Any, verify: bool = True) -> None:
        log("format", "load_model")
        super().load_model(path, model, storage, verify)
