"""`<folder>/metrics.jsonl`: every record as one JSON line (the format: hpc_ddp.run.records.metrics).

The file only grows, and a crash can cut its last line. The writer therefore starts on a fresh line (a cut line
stays cut, and is never glued to the next record), and hpc_ddp.run.records.metrics_read skips lines that are not whole
records. Records are written with write(2) on an unbuffered file, whole lines: every record but a "step" one at
once, and "step" records together, at most STEP_EVERY_S after the first of them was held (with the next record
of another kind, or at close, if sooner). A short run records every step, and a write per step was a tenth of
a millisecond of the kit's own work in each (issue 41); a process killed loses at most that second of step
records, which step.json (hpc_ddp.run.records.reached) and the steps retrained after its checkpoint make up for.
Readers (`submit --wait`, the supervisors) see every record within a second.

A full disk (or quota) loses nothing: the records that cannot be written are held in memory, in order, and go
out with the next record that finds space (said once when it starts and once when it ends); closing waits the
retry window out for them (hpc_ddp.ledger.files). Training goes on meanwhile: a disk that stays full stops the
run through the checkpoint writer, at the same step on every rank, not here on rank 0 alone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from hpc_ddp.ledger import files
from hpc_ddp.run.sinks.base import Sink

STEP_EVERY_S = 1.0  # "step" records held, at most this long, to go out together (see above)
HELD_MAX = 64 << 20  # bytes of records held on a full disk, at most (~250,000 records); past it, the error


class JsonLines(Sink):
    name = "metrics.jsonl"
    essential = True  # the supervisors, `submit --wait` and the report read it

    def __init__(self, path: Path, warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.warn = warn
        self.file: BinaryIO | None = None  # opened at the first record
        self.held = bytearray()  # what is not in the file yet, in order: step records, or a full disk's
        self.full_since: float | None = None
        self.holding_since: float | None = None  # when the oldest step record held began to wait

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
        self.held += line
        if record.get("event") == "step" and self.full_since is None:
            now = time.monotonic()
            if self.holding_since is None:
                self.holding_since = now
            if now - self.holding_since < STEP_EVERY_S:
                return
        self.holding_since = None
        self._write_held()

    def _write_held(self) -> None:
        """Write what is held; on a full disk keep the rest (OSError for any other error, or past HELD_MAX)."""
        assert self.file is not None
        view = memoryview(self.held)
        done = 0
        try:
            while done < len(view):  # write(2) may write part of it (a signal); the rest follows at once
                written = self.file.write(view[done:])
                if not written:
                    raise OSError(f"{self.path}: nothing written of a record")
                done += written
        except OSError as e:
            if not files.is_full(e) or len(self.held) - done > HELD_MAX:
                raise
            self._full(e)
        finally:
            view.release()
            del self.held[:done]
        if not self.held and self.full_since is not None:
            if self.warn is not None:
                self.warn(
                    f"{self.path}: written again after {time.monotonic() - self.full_since:.0f} s of a full disk; "
                    "no record was lost"
                )
            self.full_since = None

    def _full(self, error: OSError) -> None:
        if self.full_since is None:
            self.full_since = time.monotonic()
            if self.warn is not None:
                self.warn(
                    f"{self.path}: cannot write ({error.strerror or error}); its records are held in memory and "
                    "written once there is space. Training goes on"
                )

    def close(self) -> None:
        file, self.file = self.file, None
        if file is None:
            return
        self.file = file
        try:
            if self.held:  # a full disk: its records are waited out for the retry window
                files.patiently(self._flush_held, str(self.path))
        finally:
            self.file = None
            file.close()

    def _flush_held(self) -> None:
        self._write_held()
        if self.held:  # still full: the error again, for `patiently` to wait on
            raise OSError(28, "No space left on device", str(self.path))


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
