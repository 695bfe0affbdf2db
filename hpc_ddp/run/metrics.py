"""Rank 0's view of progress: periodic lines (or a live bar on a terminal) and `metrics.jsonl`.

Each line of `<folder>/metrics.jsonl` is one JSON object with an `event` of "step" (every progress interval),
"epoch", "straggler" (a rank named slower than the others: rank, host, phase, how many times slower),
"nonfinite" (a run stopped or a step skipped by a loss that is not finite) or "end". The "end" record's
`samples_per_s` is measured from the end of the first optimizer step (which pays for DDP's bucket setup and
allocator warm-up) to the last one, over all ranks' samples. A loss that is not finite is written as null (JSON
has no NaN).

The file only grows, and a crash can cut its last line. A writer therefore starts on a fresh line (a cut line
stays cut, and is never glued to the next record), and `read_records` skips lines that are not whole records.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.run.folder import METRICS

if TYPE_CHECKING:
    from hpc_ddp.dist.env import DistEnv
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.position import Position


class Recorder:
    """Collects step timings on every rank; writes and prints on rank 0 only (folder is None elsewhere)."""

    def __init__(self, folder: Path | None, cfg: "TrainConfig", env: "DistEnv") -> None:
        self.path = folder / METRICS if folder else None
        self.interval = cfg.log_every_s
        self.tty = sys.stdout.isatty()
        self.started = time.monotonic()
        self.last_step_end = self.started
        self.last_print = self.started
        self.warm_start: float | None = None  # end of this process's first step
        self.warm_samples = 0
        self.steps = 0
        self.step_times: list[float] = []
        self._fresh_line = False  # checked once, at the first record: a crash may have cut the last line

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            record["time"] = round(time.time(), 3)
            line = json.dumps({k: _finite_or_none(v) for k, v in record.items()}, allow_nan=False) + "\n"
            with open(self.path, "ab") as f:
                if not self._fresh_line:
                    self._fresh_line = True
                    if f.tell() > 0 and not _ends_with_newline(self.path):
                        line = "\n" + line  # the cut line stays as it is, on its own
                f.write(line.encode())

    def step(self, pos: "Position", loss: float, samples: int) -> None:
        now = time.monotonic()
        step_time = now - self.last_step_end
        self.last_step_end = now
        self.steps += 1
        if self.warm_start is None:
            self.warm_start = now
        else:
            self.warm_samples += samples
            self.step_times.append(step_time)
        if self.path is None:
            return
        rate = self.samples_per_s()
        if self.tty:
            sys.stdout.write(f"\repoch {pos.epoch} step {pos.step} loss {loss:.4f} {rate:,.0f} samples/s ")
            sys.stdout.flush()
        if now - self.last_print >= self.interval:
            self.last_print = now
            if not self.tty:
                print(f"epoch {pos.epoch} step {pos.step} loss {loss:.4f} {rate:,.0f} samples/s "
                      f"{step_time * 1000:.1f} ms/step", flush=True)
            self._write({"event": "step", "epoch": pos.epoch, "step": pos.step, "loss": loss,
                         "samples_per_s": rate, "step_time_s": step_time})

    def samples_per_s(self) -> float:
        if self.warm_start is None or self.last_step_end <= self.warm_start:
            return 0.0
        return self.warm_samples / (self.last_step_end - self.warm_start)

    def epoch(self, pos: "Position", loss: float) -> None:
        if self.path is None:
            return
        if self.tty:
            sys.stdout.write("\r\033[K")
        self._write({"event": "epoch", "epoch": pos.epoch, "step": pos.step, "loss": loss,
                     "samples_per_s": self.samples_per_s()})

    def straggler(self, pos: "Position", rank: int, host: str, phase: str, slower: float) -> None:
        """A rank named slower than the others (run/stragglers.py): rank 0 records it."""
        self._write({"event": "straggler", "epoch": pos.epoch, "step": pos.step, "rank": rank, "host": host,
                     "phase": phase, "slower": round(slower, 2)})

    def nonfinite(self, pos: "Position", step: int, action: str) -> None:
        self._write({"event": "nonfinite", "epoch": pos.epoch, "step": step, "loss": None, "action": action})

    def end(self, pos: "Position") -> None:
        times = sorted(self.step_times)
        median = times[len(times) // 2] if times else 0.0
        self._write({"event": "end", "epoch": pos.epoch, "step": pos.step, "steps_this_process": self.steps,
                     "samples_per_s": self.samples_per_s(), "median_step_time_s": median,
                     "seconds": round(time.monotonic() - self.started, 3)})


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a line that is not a whole JSON object (cut by a crash) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a cut line, or bytes that are no text
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
