"""How the bench runs things: its settings, one measured command at a time, and the figures it reads back.

Every measured run is a real command (`python -m hpc_ddp.submit --local`, torchrun, the hand loop) in its
own folder with its own log; a run that fails stops the bench (`RunFailed`), since its figures would mean
nothing. The environment each one gets is this one's, minus any launcher's variables and thread counts.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.cluster.env import without_launcher
from hpc_ddp.cluster.placement import THREAD_VARS
from hpc_ddp.run import folder as run_folder

TASK = "mlp"
MLP_SAMPLES = 8192  # the mlp task's dataset (hpc_ddp/run/tasks.py)
MIN_TRIALS = 5


@dataclass(frozen=True)
class Settings:
    trials: int
    steps: int
    world_size: int
    batch_size: int
    work: Path
    quick: bool = False

    @property
    def ckpt_trials(self) -> int:
        return self.trials if self.quick else 10 * self.trials  # ~0.2 s each, and the disk is noisy

    @property
    def launch_steps(self) -> int:
        return 1

    @property
    def watch_trials(self) -> int:
        return self.trials if self.quick else 2 * self.trials  # ~5 s each, and a 1 % target


class RunFailed(Exception):
    """A measured command failed: the bench stops, since its figures would mean nothing."""


# ----- pure helpers -------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_of_measured(values: Sequence[float]) -> float | None:
    """The median of the trials that measured the figure (NaN: a trial had nothing to measure, e.g. no step ran
    while a write was in the background); None when none did, which the report prints as "n/a"."""
    measured = [v for v in values if math.isfinite(v)]
    return statistics.median(measured) if measured else None


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-trial ratios: trial i of one contender against trial i of the other."""
    return [a / b if b else float("nan") for a, b in zip(numerators, denominators, strict=True)]


def steps_per_epoch(world_size: int, batch_size: int) -> int:
    return MLP_SAMPLES // world_size // batch_size


def child_env() -> dict[str, str]:
    """A surrounding launcher's ranks or the user's thread settings would change how a contender runs; the
    comparison is about what each one does by itself."""
    env = {k: v for k, v in without_launcher(os.environ).items() if k not in THREAD_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU comparison, also on a machine with GPUs
    return env


def read_records(path: Path) -> list[dict[str, Any]]:
    from hpc_ddp.run.records.metrics import read_records as read  # skips a line a crash cut

    return read(path)


def end_record(folder: Path) -> dict[str, Any]:
    """The "end" record of a kit run folder (its samples/s, its kit's own time per step)."""
    for record in read_records(folder / "metrics.jsonl"):
        if record.get("event") == "end":
            return record
    raise RunFailed(f"no 'end' record in {folder / 'metrics.jsonl'}")


def first_step_time(folder: Path) -> float:
    """Wall-clock time of rank 0's first optimizer step: its `"step": 1` metrics record."""
    for record in read_records(folder / "metrics.jsonl"):
        if record.get("event") == "step" and record.get("step") == 1:
            return float(record["time"])
    raise RunFailed(f"no record of step 1 in {folder / 'metrics.jsonl'}")


def drop_weights(folder: Path) -> None:
    """A kit run's checkpoints and model.pth, removed once its figures are read: the bench reads its records,
    never its weights, and they add up (an fsdp section run of the 100 M model with AdamW leaves 3.8 GB; its
    15 runs at 3 trials would hold 57 GB to the end). Its records and logs stay (--folder keeps them)."""
    shutil.rmtree(folder / run_folder.CHECKPOINTS, ignore_errors=True)
    for name in (run_folder.MODEL, f"{run_folder.MODEL}.sha256"):
        (folder / name).unlink(missing_ok=True)


def load_average() -> float:
    return os.getloadavg()[0]


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ----- running things -----------------------------------------------------------------------------------
def run_cmd(
    cmd: list[str],
    log: Path,
    preexec: Callable[[], None] | None = None,
    timeout: float = 600,
    extra_env: dict[str, str] | None = None,
) -> float:
    """Run `cmd` with its output in `log` (`extra_env` on top of `child_env()`); returns the wall-clock time
    just before it started."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        start = time.time()
        try:
            code: int | str = subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**child_env(), **(extra_env or {})},
                preexec_fn=preexec,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"a timeout after {timeout:.0f} s"
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-8:]
        raise RunFailed(
            f"`{' '.join(cmd)}` ended with {code}; last lines of {log}:\n    " + "\n    ".join(tail)
        )
    return start


def kit_cmd(folder: Path, world_size: int, s: Settings) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hpc_ddp.submit",
        "--local",
        "--nodes",
        "1",
        "--tasks-per-node",
        str(world_size),
        "--task",
        TASK,
        "--batch-size",
        str(s.batch_size),
        "--max-steps",
        str(s.steps),
        "--save-every-epochs",
        "0",
        "--folder",
        str(folder),
    ]


def torchrun_cmd() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


class Runner:
    """Gives each run its own folder and log under the work folder, and prints a line per run."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.count = 0
        self.kit_us: dict[str, list[float]] = {}  # per label: each kit run's own time per step, rank 0's
        # per label: of which the gradient norm for the step records
        self.norm_us: dict[str, list[float]] = {}

    def folder(self, label: str) -> Path:
        self.count += 1
        return self.s.work / f"{self.count:03d}-{label}"

    def done(self, trial: int, label: str, figure: str) -> None:
        progress(f"trial {trial + 1}/{self.s.trials} {label}: {figure} (load {load_average():.1f})")

    def kit(self, label: str, world_size: int, trial: int, cpus: Sequence[int] | None = None) -> float:
        """A kit run's samples/s; its kit's own time per step (rank 0's) is kept in `kit_us`."""
        folder = self.folder(label)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        run_cmd(kit_cmd(folder, world_size, self.s), folder.with_suffix(".log"), preexec=pin)
        end = end_record(folder)
        rate, own, norm = (
            float(end["samples_per_s"]),
            end.get("kit_us_per_step"),
            end.get("grad_norm_us_per_step"),
        )
        self.kit_us.setdefault(label, []).append(float(own) if own is not None else float("nan"))
        self.norm_us.setdefault(label, []).append(float(norm) if norm is not None else float("nan"))
        drop_weights(folder)
        self.done(
            trial, label, f"{rate:,.0f} samples/s, the kit's own work {own} us a step (gradient norm {norm})"
        )
        return rate

    def hand(self, label: str, threads: str, trial: int) -> float:
        folder = self.folder(label)
        folder.mkdir(parents=True)
        out = folder / "result.json"
        run_cmd(
            [
                sys.executable,
                "-m",
                "hpc_ddp.bench.hand",
                "--threads",
                threads,
                "--world-size",
                str(self.s.world_size),
                "--steps",
                str(self.s.steps),
                "--batch-size",
                str(self.s.batch_size),
                "--out",
                str(out),
            ],
            folder / "output.log",
        )
        rate = float(json.loads(out.read_text())["samples_per_s"])
        self.done(trial, label, f"{rate:,.0f} samples/s")
        return rate

    def first_step(self, label: str, cmd: list[str], trial: int) -> float:
        folder = self.folder(label)
        start = run_cmd([*cmd, "--folder", str(folder)], folder.with_suffix(".log"))
        seconds = first_step_time(folder) - start
        drop_weights(folder)
        self.done(trial, label, f"{seconds:.2f} s to the first step")
        return seconds
