"""--tracker test-sink: a sink that logs the events it gets (rank 0's records)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.plugins import Sink
from hpc_ddp_testplugin import log


class TestSink(Sink):
    name = "test-sink"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        log("sink", "open")

    def record(self, record: Mapping[str, Any]) -> None:
        log("sink", f"record:{record.get('event')}")

    def close(self) -> None:
        log("sink", "close")
