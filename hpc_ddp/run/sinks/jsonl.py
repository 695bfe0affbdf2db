"""`<folder>/metrics.jsonl`: every record as one JSON line (the format: hpc_ddp.run.metrics).

The file only grows, and a crash can cut its last line. The writer therefore starts on a fresh line (a cut line
stays cut, and is never glued to the next record), and hpc_ddp.run.metrics_read skips lines that are not whole
records. Each record is one write(2) of a whole line on an unbuffered file: in the file at once for readers
(`submit --wait` follows it, the supervisors read it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from hpc_ddp.run.sinks.base import Sink


class JsonLines(Sink):
    name = "metrics.jsonl"
    essential = True  # the supervisors, `submit --wait` and the report read it

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO | None = None  # opened at the first record

    def record(self, record: Mapping[str, Any]) -> None:
        try:  # a record a step in a short run: the plain dump first, cheaper than cleaning every value
            text = json.dumps(record, allow_nan=False)
        except ValueError:  # a loss that is not finite: null (JSON has no NaN)
            text = json.dumps({k: finite_or_none(v) for k, v in record.items()}, allow_nan=False)
        line = (text + "\n").encode()
        if self.file is None:
            self.file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
            if self.file.tell() > 0 and not _ends_with_newline(self.path):
                line = b"\n" + line  # a line cut by a crash stays as it is, on its own
        view = memoryview(line)
        while view:  # write(2) may write part of it (a signal); the rest follows at once
            written = self.file.write(view)
            if not written:
                raise OSError(f"{self.path}: nothing written of a record")
            view = view[written:]

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            file.close()


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
