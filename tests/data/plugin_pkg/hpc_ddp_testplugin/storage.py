"""--checkpoint-storage test-local: this machine's filesystem, as the kit's local storage, logging its writes, its
reads and its listings (each with the name it was asked about: "storage open 1 ckpt-00000016.pt")."""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from hpc_ddp.plugins import LocalStorage
from hpc_ddp_testplugin import log


class TestLocal(LocalStorage):
    def write(self, path: str, fill: Any) -> int:
        log("storage", "write", os.path.basename(path))
        return super().write(path, fill)

    def write_bytes(self, path: str, data: bytes) -> None:
        log("storage", "write_bytes", os.path.basename(path))
        super().write_bytes(path, data)

    def listdir(self, path: str) -> list[str]:
        log("storage", "listdir", os.path.basename(path))
        return super().listdir(path)

    def read_bytes(self, path: str) -> bytes:
        log("storage", "read_bytes", os.path.basename(path))
        return super().read_bytes(path)

    def open(self, path: str) -> BinaryIO:
        log("storage", "open", os.path.basename(path))
        return super().open(path)

    def sha256(self, path: str) -> str:
        log("storage", "sha256", os.path.basename(path))
        return super().sha256(path)
