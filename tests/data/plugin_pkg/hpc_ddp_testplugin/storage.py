"""--checkpoint-storage test-local: this machine's filesystem, as the kit's local storage, logging its writes."""

from __future__ import annotations

from typing import Any

from hpc_ddp.plugins import LocalStorage
from hpc_ddp_testplugin import log


class TestLocal(LocalStorage):
    def write(self, path: str, fill: Any) -> int:
        log("storage", "write")
        return super().write(path, fill)

    def write_bytes(self, path: str, data: bytes) -> None:
        log("storage", "write_bytes")
        super().write_bytes(path, data)

    def listdir(self, path: str) -> list[str]:
        log("storage", "listdir")
        return super().listdir(path)
