"""The progress line: one text for a step of a run, wherever a person looks at it.

Rank 0's terminal (a live line, `metrics.Recorder`), its log file (plain periodic lines), the local launcher's
console (rank 0's live line passed through in place) and `submit --wait` (which follows `metrics.jsonl` on the
shared folder) all show `line(record)` of a "step" record:

    epoch 1 step 120/400 loss 0.1234 | 1,530 samples/s | ETA 3m05s

No torch here: `submit --wait` runs on a login node.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.cluster.env import in_place, requeues
from hpc_ddp.log import count
from hpc_ddp.variables import LIVE_PROGRESS

# A live line travels from rank 0 to the local launcher as one whole line that starts with this, the
# terminal's "carriage return, erase to end of line": the launcher shows it in place (and keeps it out of the
# per-rank log, which gets rank 0's plain periodic lines instead). No program prints it at the start of a line
# otherwise (tqdm writes a bare "\r", rich "\r\x1b[2K").
LIVE = "\r\x1b[K"
# Set by the local launcher in its ranks' environment when its console is a terminal: rank 0's stdout is a
# pipe to the launcher, so rank 0 cannot see the terminal itself.
LIVE_VAR = LIVE_PROGRESS
RECENT_STEPS = 20  # the ETA comes from the mean step time of this many recent steps


def duration(seconds: float | None) -> str:
    """59 -> '59s', 185 -> '3m05s', 7384 -> '2h03m', 2 days -> '2d01h'; None or not finite -> '?'."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def eta_s(step: int, total_steps: int, recent_step_times: Sequence[float]) -> float | None:
    """Seconds until `total_steps` at the mean of the recent step times (the first step of a process, which
    pays for warm-up, is never among them); None while there is none, or when the total is unknown."""
    if total_steps <= 0 or not recent_step_times:
        return None
    return max(0, total_steps - step) * sum(recent_step_times) / len(recent_step_times)


def total_steps(epochs: int, steps_per_epoch: int, max_steps: int) -> int:
    """Optimizer steps of the whole run: epochs x steps per epoch, or --max-steps if that comes first."""
    total = epochs * steps_per_epoch
    return min(total, max_steps) if max_steps else total


def value_text(value: float | None) -> str:
    """A loss's or a metric's value on the progress line, every one the same way (pure): 4 decimals (`1.0000`,
    `0.3750`, `0.9688`), scientific where 4 decimals would hide it (`2.500e-05`) or be too wide (`1.235e+07`);
    None (a non-finite value, as records write it) is `nan`."""
    if value is None:
        return "nan"
    if value != 0 and not 1e-3 <= abs(value) < 1e6:
        return f"{value:.3e}"
    return f"{value:.4f}"


def line(record: Mapping[str, Any], grad_norm: bool = False) -> str:
    """The progress text of a "step" record (pure). Fields it lacks are left out; its `grad_norm` with
    `grad_norm` (--log-grad-norm)."""
    step, total = record.get("step", 0), record.get("total_steps") or 0
    parts = [f"epoch {record.get('epoch', 0)} step {step}" + (f"/{total}" if total else "")]
    loss = record.get("loss")
    parts[0] += " loss " + value_text(loss)
    for name, value in (record.get("metrics") or {}).items():
        parts[0] += f" {name} " + value_text(value)
    if grad_norm and "grad_norm" in record:
        parts[0] += " grad_norm " + value_text(record["grad_norm"])
    rate = record.get("samples_per_s")
    if rate:  # 0 until a process's second step: its first, the warm-up, is not measured
        parts.append(f"{rate:,.0f} samples/s")
    if total:
        parts.append("done" if step >= total else f"ETA {duration(record.get('eta_s'))}")
    return " | ".join(parts)


def event_line(record: Mapping[str, Any]) -> str | None:
    """A line for `submit --wait` about a record other than a step: each start of the run (first, requeued or
    restarted) and its end. None for the records it does not show."""
    event = record.get("event")
    if event == "start":
        how = (
            f"resumed at epoch {record.get('epoch')}, step {record.get('step')}"
            if record.get("resumed")
            else "from the beginning"
        )
        restart = record.get("restart") if isinstance(record.get("restart"), int) else 0
        # A step restarted inside the allocation (--spare-nodes) keeps Slurm's count: said apart.
        which = (
            f"{requeues(restart)} (restart in place {in_place(restart)})" if in_place(restart) else restart
        )
        return (
            f"[run] start {which} of job {record.get('job') or '?'}: {how}; "
            f"{count(int(record.get('world_size') or 0), 'rank')}, {record.get('startup_s', 0):.1f} s from process start to "
            "the first step"
        )
    if event == "end":
        return f"[run] ranks ended at epoch {record.get('epoch')}, step {record.get('step')}"
    return None


class Follower:
    """Reads the records a growing metrics.jsonl gains: whole lines only (a line still being written waits for
    the next poll), a line that is no JSON object (cut by a crash) skipped."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:  # not there yet
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        records = []
        for raw in lines:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


class LiveStream(io.TextIOBase):
    """A text stream with one live line at its bottom: on a terminal the live line is rewritten in place and
    anything else written clears it first (it is drawn again at the next `live`); elsewhere (a file, a pipe)
    each live line is a plain line."""

    def __init__(self, out: TextIO) -> None:
        super().__init__()
        self.out = out
        try:
            self.tty = out.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.shown = False  # a live line is on the terminal, the cursor at its end

    def write(self, text: str) -> int:
        if self.shown and text:
            self.out.write(LIVE)  # back to the line's start, erased
            self.shown = False
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def live(self, text: str) -> None:
        if self.tty:
            self.out.write(LIVE + text)
            self.shown = True
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def keep(self) -> None:
        """The live line becomes an ordinary line (the last state stays on the screen)."""
        if self.shown:
            self.out.write("\n")
            self.out.flush()
            self.shown = False


class MetricsView:
    """`submit --wait`: the progress line of the job's metrics.jsonl, live on a terminal, and a line for each
    start of the run. Not a terminal: no progress lines from here, since rank 0's log, which `--wait` prints
    too, has the same plain lines (a batch job's stdout is a file).

    With `job`, only that job's records: the folder may hold an earlier job's (a finished run submitted
    again), or another job may write there now (one this job's folder lock refused). Another job's records
    are those after its "start", up to this job's own."""

    def __init__(self, path: Path, out: TextIO, job: str | None = None) -> None:
        self.follower = Follower(path)
        self.stream = LiveStream(out)
        self.job = job
        self.ours = True

    def poll(self) -> list[dict[str, Any]]:
        """Show what the file gained; returns the records shown (the job's own)."""
        shown = []
        for record in self.follower.poll():
            if self.job is not None and record.get("event") == "start":
                self.ours = str(record.get("job")) == self.job
            if not self.ours:
                continue
            shown.append(record)
            if record.get("event") == "step":
                if self.stream.tty:
                    self.stream.live(line(record))
            else:
                text = event_line(record)
                if text is not None:
                    self.stream.write(text + "\n")
                    self.stream.flush()
        return shown
