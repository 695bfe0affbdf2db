"""Reading metrics.jsonl, which rank 0's Recorder (hpc_ddp.run.records.metrics) writes.

No torch and nothing else heavy: the report and the supervisors (the local launcher, the Slurm batch shell)
import this. Every reader is tolerant: a cut or foreign line is skipped, a missing file is no records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_records(path: Path, chunk_bytes: int = 1 << 18) -> Iterator[dict[str, Any]]:
    """The records of a metrics.jsonl, in order, read in chunks (a million records take seconds and little
    memory); a line that is not a whole JSON object (cut by a crash, or bytes that are no text) is skipped."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError:
        return
    with f:
        while lines := f.readlines(chunk_bytes):
            try:  # one parse for the whole chunk: most of the cost of a record is the call, not the bytes
                parsed = json.loads(b"[" + b",".join(lines) + b"]")
                if len(parsed) != len(lines):
                    raise ValueError("a line held more than one value")
            except ValueError:  # a cut or foreign line in this chunk: line by line
                parsed = [_record_or_none(line) for line in lines]
            yield from (r for r in parsed if isinstance(r, dict))


def _record_or_none(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:  # a cut line, or bytes that are no text
        return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a line that is not a whole JSON object (cut by a crash) is skipped."""
    return list(iter_records(path)) if path.is_file() else []
