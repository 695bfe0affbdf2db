"""Rank 0's view of progress: a live line on a terminal, periodic lines in a log, and `metrics.jsonl`.

Each line of `<folder>/metrics.jsonl` is one JSON object with an `event` and a `time` (wall clock, seconds since
the epoch). Steps count optimizer steps from 1 over the whole run; `epoch` counts from 0.

- "step" (every step of a short run: see POINTS; and every --log-every-s, and the run's last step): `epoch`,
  `step`, `loss` (averaged over all ranks), `samples_per_s` (all ranks, since this process's first step),
  `step_time_s` (this step), `lr` (the first parameter group's), `data_s` (mean seconds per step that rank 0
  waited for its data since the last "step" record), `total_steps` (of the whole run: epochs x steps per
  epoch, or --max-steps), `eta_s` (at the mean time of the recent steps, this process's first step left out;
  null until there is one), `grad_norm` (the gradients' total norm before clipping, after the all-reduce:
  rank 0's, the same on every rank; null for a step whose update was not applied). A run of up to POINTS
  steps has one for every step; a longer one has one every ceil(total_steps / POINTS) steps, so that a million
  steps write a few MB at most (about 270 bytes a record); a process that stops between two of them (an error,
  a stop) writes its last step's on its way out.
  With a Task.step that returns extra values: `metrics`, {name: value averaged over all ranks}.
- "eval" (each evaluation): `epoch`, `step`, `samples` (evaluated, all ranks), `metrics` ({name: mean over
  every evaluated sample}).
- "start" (each start of a process that trains, right before its first step): `job`, `restart` (Slurm's
  restart count, 0 at first), `epoch`, `step` (where it starts), `resumed`, `world_size`, `startup_s`
  (seconds from rank 0's process creation to now: interpreter, imports, rendezvous, resume).
- "ranks" (every 5 steps, with 2 ranks or more; in a run of more than 5 x RANKS_RECORDS steps, one every
  ceil(total_steps / RANKS_RECORDS) steps, with each rank's slowest window since the last): `epoch`, `step`,
  and per rank, by rank, `step_time_s` (its own work per step over the window: data + compute; the wait for
  the others in the all-reduce is left out, so that a slow rank stands out) and `data_s` (its data wait per
  step).
- "save" (each checkpoint rank 0 saves): `epoch`, `step`, `stall_s` (seconds the training loop was blocked by
  it: the ranks' RNG gather, the copy to CPU, any wait for the previous write; for the `final` save also the
  wait until it is durable), `write_s` (seconds the background write took until durable; null if it never
  was), `final`. Written once its write has ended, a few steps later at most.
- "best" (--keep-best, each new best evaluation): `epoch`, `step`, `metric` (its name), `value`, `mode` (min
  or max); the checkpoint of that step is saved at once and named by `checkpoints/best`.
- "epoch" (each epoch's end: its mean loss), "straggler" (a rank named slower than the others: rank, host,
  phase, how many times slower), "nonfinite" (a run stopped or a step skipped by a loss that is not finite),
  "end" (this process's last step; its `samples_per_s` is measured from the end of the first optimizer step,
  which pays for DDP's bucket setup and allocator warm-up, to the last one, over all ranks' samples).

A loss that is not finite is written as null (JSON has no NaN).

Every record goes to every sink (hpc_ddp.run.sinks): metrics.jsonl (sinks/jsonl.py: a crash's cut last line
stays alone on its line, and `read_records` skips it), and the destinations the options add (--tensorboard),
which also get each step's scalars by tag.

Beside it, `<folder>/step.json` says the last step rank 0 finished, rewritten after every step, for the
supervisors: an attempt may die between two records (hpc_ddp.run.records.reached).

Where the progress line goes: on a terminal it is rewritten in place (at most every LIVE_EVERY_S) and a plain
line is added every --log-every-s; in a file, only the plain lines. Under the local launcher rank 0's stdout
is a pipe: the launcher says (`progress.LIVE_VAR`) when its own console is a terminal, and rank 0 then sends
its live lines marked (`progress.LIVE`) for the launcher to show in place, and its plain lines for the log.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.run import sinks
from hpc_ddp.run.folder import METRICS
from hpc_ddp.run.records import progress
from hpc_ddp.run.records.metrics_read import iter_records, read_records  # noqa: F401 (read here before)
from hpc_ddp.run.records.reached import StepFile
from hpc_ddp.run.sinks.jsonl import JsonLines, finite_or_none

if TYPE_CHECKING:
    from hpc_ddp.cluster.env import DistEnv
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.loop.position import Position

LIVE_EVERY_S = 0.2  # a live line more often than this costs the terminal more than it tells anyone
POINTS = 5000  # "step" records a run writes by the step cadence, at most (see the module docstring)
RANKS_RECORDS = 1000  # "ranks" records a run writes, about: the report's heat map has 1000 columns


def live_mode(environ: Mapping[str, str] = os.environ) -> str:
    """'tty' (stdout is a terminal), 'marked' (the local launcher shows it on one) or '' (a log file)."""
    if sys.stdout.isatty():
        return "tty"
    return "marked" if environ.get(progress.LIVE_VAR) == "1" else ""


def point_every(total_steps: int, step: int) -> int:
    """Every how many steps a "step" record is due around `step` (pure): 1 in a run of up to POINTS steps,
    else ceil(total_steps / POINTS). With the total unknown (0): 1 for the first POINTS steps, then 2, 4, 8...
    as the run doubles (about POINTS / 2 records more per doubling)."""
    if total_steps > 0:
        return max(1, -(-total_steps // POINTS))
    return 1 << (max(step, 0) // POINTS).bit_length()


def ranks_every(total_steps: int) -> int:
    """Steps between two "ranks" records (pure): each one's windows since the previous are folded into it."""
    return max(1, -(-total_steps // RANKS_RECORDS)) if total_steps > 0 else 1


STEP_TIMES_KEPT = 4096  # the step times a Recorder keeps (the end record's median is of these)


class Recorder:
    """Collects step timings on every rank; writes and prints on rank 0 only (folder is None elsewhere).

    `total_steps` is the run's (see progress.total_steps). Every record goes to every sink (hpc_ddp.run.sinks):
    metrics.jsonl from the first record on, the optional ones (--tensorboard) from `start`, once the folder is
    settled; those also get every step's scalars by tag, and those of the "ranks", "save" and "eval" records.
    `close` flushes them all. `warn` says that an optional sink failed and was dropped."""

    def __init__(
        self,
        folder: Path | None,
        cfg: TrainConfig,
        env: DistEnv,
        total_steps: int = 0,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.folder = folder
        self.cfg = cfg
        self.path = folder / METRICS if folder else None
        self.interval = cfg.log_every_s
        self.total_steps = total_steps
        self.sinks = sinks.Sinks([JsonLines(self.path, warn or _warn)] if self.path else [], warn or _warn)
        self.opened = False  # the optional sinks (opened by the first `start`)
        self.params: Mapping[str, Any] | None = (
            None  # the trackers' run parameters (the trainer's: run_params)
        )
        self.live = live_mode() if folder else ""
        self.tty = self.live == "tty"
        self.started = time.monotonic()
        self.last_step_end = self.started
        self.last_print = self.started
        self.last_live = self.started - LIVE_EVERY_S
        self.warm_start: float | None = None  # end of this process's first step
        self.warm_samples = 0
        self.steps = 0
        # The last steps' times (the watchdog's limit, the ETA, the end record's median), bounded: a run of a
        # million steps keeps at most 2 x STEP_TIMES_KEPT of them, not one float per step.
        self.step_times: list[float] = []
        self.kit_s = self.norm_s = 0.0  # the kit's own time in the warm steps (`step`), of which the norm's
        self.data_sum, self.data_steps = 0.0, 0  # rank 0's data wait since the last "step" record
        self.reached = StepFile(folder) if folder else None
        # epoch, step, loss, step time, lr, Task.step's extras, the gradient norm (a tensor until recorded)
        self.last: tuple[int, int, float, float, float, Mapping[str, float] | None, Any] | None = None
        self.written = -1  # the step of the last "step" record written
        self.ranks_pending: list[list[float]] | None = None  # the slowest of the windows not written yet
        self.ranks_written = 0  # the step of the last "ranks" record

    def event(self, name: str, fields: Mapping[str, Any]) -> None:  # a record of its own: run/snapshot's
        self._write({"event": name, **fields})

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        record["time"] = round(time.time(), 3)
        self.sinks.record(record)

    def _show(self, text: str, live: bool) -> None:
        """A progress line: live (rewritten in place) or plain (kept: the log's periodic line)."""
        if live:
            out = progress.LIVE + text + ("" if self.tty else "\n")  # a whole line for the launcher's reader
        else:
            out = (progress.LIVE if self.tty else "") + text + "\n"
        sys.stdout.write(out)
        sys.stdout.flush()

    def step(
        self,
        pos: Position,
        loss: float,
        samples: int,
        lr: float = 0.0,
        data_s: float = 0.0,
        extras: Mapping[str, float] | None = None,
        task_s: float = 0.0,
        grad_norm: Any = None,
        norm_s: float = 0.0,
    ) -> None:
        """A step ended. `data_s`: its wait for data; `task_s`: its time in the task's own work (forward,
        backward with DDP's gradient all-reduce, the update: hpc_ddp.run.loop.clock). What is left of the step's
        time is the kit's own work (`kit_us_per_step` in the end record). `grad_norm`: the gradients' norm
        before clipping, a tensor on the device (None: no update), read only when a record or a curve needs
        it: on a GPU, reading it waits for the step. `norm_s`: the kit's own time computing it (no --clip-grad)."""
        now = time.monotonic()
        step_time = now - self.last_step_end
        self.last_step_end = now
        self.steps += 1
        if self.warm_start is None:
            self.warm_start = now
        else:
            self.warm_samples += samples
            self.kit_s += step_time - data_s - task_s
            self.norm_s += norm_s
            self.step_times.append(step_time)
            if len(self.step_times) >= 2 * STEP_TIMES_KEPT:
                del self.step_times[:STEP_TIMES_KEPT]  # one list op: a reader's slice stays atomic
        if self.reached is None:  # not rank 0
            return
        self.reached.reach(pos.step)
        self.last = (pos.epoch, pos.step, loss, step_time, lr, extras, grad_norm)  # pos changes: its values
        self.data_sum += data_s
        self.data_steps += 1
        if self.sinks.curves:  # a sink that draws curves gets every step
            self.sinks.scalars(
                pos.step,
                {
                    "train/loss": loss,
                    "train/lr": lr,
                    "time/step_s": step_time,
                    "time/data_s": data_s,
                    "train/samples_per_s": samples / step_time if step_time > 0 else None,
                    "train/grad_norm": _number(grad_norm),
                    **{f"train/{name}": value for name, value in (extras or {}).items()},
                },
            )
        due = now - self.last_print >= self.interval
        point = pos.step % point_every(self.total_steps, pos.step) == 0 or pos.step == self.total_steps
        live = bool(self.live) and (now - self.last_live >= LIVE_EVERY_S or pos.step == self.total_steps)
        if not (due or point or live):
            return
        record = self._step_record(*self.last)
        if live:
            self.last_live = now
            self._show(progress.line(record, self.cfg.log_grad_norm), live=True)
        if due:
            self.last_print = now
            self._show(progress.line(record, self.cfg.log_grad_norm), live=False)
        if due or point:
            self._write_step(record)

    def _step_record(
        self,
        epoch: int,
        step: int,
        loss: float,
        step_time: float,
        lr: float,
        extras: Mapping[str, float] | None = None,
        grad_norm: Any = None,
    ) -> dict[str, Any]:
        recent = self.step_times[-progress.RECENT_STEPS :]
        record = {
            "event": "step",
            "epoch": epoch,
            "step": step,
            "loss": loss,
            "samples_per_s": self.samples_per_s(),
            "step_time_s": step_time,
            "lr": lr,
            "data_s": self.data_sum / max(self.data_steps, 1),
            "total_steps": self.total_steps,
            "eta_s": progress.eta_s(step, self.total_steps, recent),
            "grad_norm": _number(grad_norm),
        }
        if extras:  # Task.step's own values, averaged over ranks (and the step's micro-batches)
            record["metrics"] = {name: finite_or_none(value) for name, value in extras.items()}
        return record

    def _write_step(self, record: dict[str, Any]) -> None:
        self.data_sum, self.data_steps = 0.0, 0
        self.written = record["step"]
        self._write(record)

    def _write_last_step(self) -> None:
        """The last step this process finished, unless its "step" record is written: the curves and the
        final loss end where training ended, also when it stopped between two records."""
        if self.last is not None and self.last[1] != self.written:
            self._write_step(self._step_record(*self.last))

    def samples_per_s(self) -> float:
        if self.warm_start is None or self.last_step_end <= self.warm_start:
            return 0.0
        return self.warm_samples / (self.last_step_end - self.warm_start)

    def epoch(self, pos: Position, loss: float) -> None:
        if self.path is None:
            return
        self.clear_live()  # the "Epoch N" line takes its place
        self._write(
            {
                "event": "epoch",
                "epoch": pos.epoch,
                "step": pos.step,
                "loss": loss,
                "samples_per_s": self.samples_per_s(),
            }
        )

    def start(
        self,
        pos: Position,
        job: str,
        restart: int,
        resumed: bool,
        world_size: int,
        startup_s: float,
        resized: dict[str, Any] | None = None,
    ) -> None:
        """This process starts training (rank 0, right before its first step). `resized`: a checkpoint of
        another world size was resharded (--allow-resize): from, to, the global batch before and after."""
        self.last_step_end = (
            time.monotonic()
        )  # the first step's time is that step's, not the resume before it
        self.ranks_written = pos.step
        if self.folder is not None and not self.opened:
            self.opened = True
            self.sinks.add(sinks.optional(self.folder, self.cfg, self.params))
        self._write(
            {
                "event": "start",
                "job": job,
                "restart": restart,
                "epoch": pos.epoch,
                "step": pos.step,
                "resumed": resumed,
                "world_size": world_size,
                "startup_s": round(startup_s, 3),
                **({"resized": resized} if resized else {}),
            }
        )

    def ranks(self, pos: Position, rows: Sequence[Sequence[float]]) -> None:
        """Every rank's time split of a straggler window (run/watch/stragglers.py rows: data, compute, comm, steps).
        In a long run, the windows between two records are folded into the next: each rank's slowest."""
        if self.path is None:
            return
        window = [
            [(d + c) / s if s else 0.0 for d, c, _, s in rows],
            [d / s if s else 0.0 for d, _, _, s in rows],
        ]
        self.sinks.scalars(pos.step, {f"rank_step_time/{r}": v for r, v in enumerate(window[0])})
        pending = self.ranks_pending
        if pending is not None and len(pending[0]) == len(window[0]):
            window = [
                [max(a, b) for a, b in zip(old, new, strict=True)]
                for old, new in zip(pending, window, strict=True)
            ]
        self.ranks_pending = window
        if pos.step - self.ranks_written >= ranks_every(self.total_steps) or pos.step == self.total_steps:
            self._write_ranks(pos.epoch, pos.step)

    def _write_ranks(self, epoch: int, step: int) -> None:
        if self.ranks_pending is None:
            return
        times, data = self.ranks_pending
        self.ranks_pending, self.ranks_written = None, step
        self._write({"event": "ranks", "epoch": epoch, "step": step, "step_time_s": times, "data_s": data})

    def eval(self, pos: Position, samples: int, means: Mapping[str, float]) -> None:
        """An evaluation's means over all evaluated samples (every rank's), rank 0 records them."""
        if self.path is None:
            return
        self.clear_live()  # the console's "Eval" line takes its place
        self._write(
            {
                "event": "eval",
                "epoch": pos.epoch,
                "step": pos.step,
                "samples": samples,
                "metrics": {n: finite_or_none(v) for n, v in means.items()},
            }
        )
        self.sinks.scalars(pos.step, {f"eval/{name}": value for name, value in means.items()})

    def best(self, pos: Position, name: str, value: float, mode: str) -> None:
        """--keep-best: a new best evaluation; its checkpoint is saved at this step and named by
        `checkpoints/best`."""
        if self.path is None:
            return
        self._write(
            {
                "event": "best",
                "epoch": pos.epoch,
                "step": pos.step,
                "metric": name,
                "value": value,
                "mode": mode,
            }
        )

    def save(self, epoch: int, step: int, stall_s: float, write_s: float | None, final: bool) -> None:
        """A checkpoint rank 0 saved (see the module docstring)."""
        self._write(
            {
                "event": "save",
                "epoch": epoch,
                "step": step,
                "stall_s": round(stall_s, 6),
                "write_s": None if write_s is None else round(write_s, 6),
                "final": final,
            }
        )
        if self.path is not None:
            self.sinks.scalars(step, {"time/checkpoint_stall_s": stall_s, "time/checkpoint_write_s": write_s})

    def straggler(self, pos: Position, rank: int, host: str, phase: str, slower: float) -> None:
        """A rank named slower than the others (run/watch/stragglers.py): rank 0 records it."""
        self._write(
            {
                "event": "straggler",
                "epoch": pos.epoch,
                "step": pos.step,
                "rank": rank,
                "host": host,
                "phase": phase,
                "slower": round(slower, 2),
            }
        )

    def nonfinite(self, pos: Position, step: int, action: str) -> None:
        self._write({"event": "nonfinite", "epoch": pos.epoch, "step": step, "loss": None, "action": action})

    def clear_live(self) -> None:
        """Erase the live line (the next step draws it again)."""
        if self.live:
            self._show("", live=True)

    def end(self, pos: Position) -> None:
        self.clear_live()
        self._write_last_step()
        if self.last is not None:
            self._write_ranks(*self.last[:2])  # the windows folded since the last "ranks" record
        times = sorted(self.step_times)
        median, warm = times[len(times) // 2] if times else 0.0, self.steps - 1
        self._write(
            {
                **{"event": "end", "epoch": pos.epoch, "step": pos.step, "steps_this_process": self.steps},
                "samples_per_s": self.samples_per_s(),
                "median_step_time_s": median,
                # What the kit adds to a step beyond the task's own work and the data wait (the bench's budget),
                # and of it, the gradient norm the step records need without --clip-grad (issue 46).
                "kit_us_per_step": _us_per_step(self.kit_s, warm),
                "grad_norm_us_per_step": _us_per_step(self.norm_s, warm),
                "seconds": round(time.monotonic() - self.started, 3),
            }
        )

    def close(self) -> None:
        """On every path out of the Trainer: the last step's record if it is not written (a process stopped
        by an error between two records), then every sink flushed and closed (an optional one that fails is
        said and dropped; metrics.jsonl's error is raised). Idempotent."""
        try:
            if self.path is not None:
                with contextlib.suppress(OSError):  # a full disk on the way out must not hide why it ended
                    self._write_last_step()
        finally:
            try:
                self.sinks.close()
            finally:
                if self.reached is not None:
                    self.reached.close()


def _number(value: Any) -> float | None:
    """A tensor's or a number's value as a finite float, or None (none given, NaN, infinite)."""
    return None if value is None else finite_or_none(float(value))


def _warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def _us_per_step(seconds: float, steps: int) -> float | None:
    """Microseconds a step, to 0.1 us; None without a warm step."""
    return round(1e6 * seconds / steps, 1) if steps > 0 else None
