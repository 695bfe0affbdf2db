"""Measure the kit on this machine, side by side with what users would run without it.

    python -m hpc_ddp.bench                        # every section, 5 interleaved trials (about 5 minutes)
    python -m hpc_ddp.bench overhead launch        # some sections only
    python -m hpc_ddp.bench --quick --json b.json  # one short trial each: tests the bench, measures nothing

Every contender runs the built-in `mlp` task (3.4 M parameters) on CPU with gloo, one node, --world-size
ranks (GPUs are hidden from every run). Runs are interleaved, A B C C B A A B C ..., so that a busy neighbour
on a shared machine slows every contender alike and a load that rises or falls during the bench favours
none; each figure is the median over the trials and each ratio the median of the per-trial ratios.

Sections:
  overhead    The kit (`submit --local --nodes 1 --tasks-per-node N`) against a hand-written DDP loop
              (hpc_ddp/bench_hand.py) on the same model, data, per-rank batch, world size and steps, started
              with `torch.multiprocessing.spawn`: once with torch's default threads (every rank one thread per
              CPU), once with the threads set right by hand (cpus // ranks each). All three measure global
              samples/s the same way: on rank 0, from the end of the first optimizer step (warm-up: DDP builds
              its buckets) to the end of the last; the kit's figure is its metrics.jsonl "end" record. Fair
              settings: the kit runs with --save-every-epochs 0 and --max-steps inside the first epoch, so no
              checkpoint or epoch end falls in the measured window (its final checkpoint comes after it) and
              the hand loops save nothing. The kit's own per-step work (the loss averaged over ranks and the
              signal votes in one all-reduce, the hang watch, metrics) is inside the window: that is the
              overhead measured.
  scaling     Kit samples/s with N ranks against 1 rank pinned to the CPU share one of those ranks gets
              (cpus // N), as an efficiency: samples/s(N) / (N x samples/s(1)). 1.0 would mean the gradient
              all-reduce and the extra processes cost nothing.
  checkpoint  The kit's save path, Trainer.save() on the mlp model in one process that plays rank 0 (RNG
              gather, snapshot to CPU on the training thread; then serialise, write, fsync, rename and fsync
              the folder in the background writer), timed from the call until the checkpoint file is durably
              renamed into place, against a raw sequential write + fsync of the same bytes to the same folder;
              as MB/s and their ratio. The training stall is how long save() holds the training thread. One
              warm-up save is not counted; then 10 x --trials saves (the disk is noisy). Each save and
              each raw write comes right after `os.sync()` and a training step, as a save does in training.
  launch      Command start to the first training step, `submit --local` against `torchrun --standalone
              --nproc-per-node N -m hpc_ddp.train`, same task and flags. "First training step": the
              wall-clock time rank 0 stamps on its metrics.jsonl record of step 1, written right after its
              first optimizer step (--log-every-s 0 makes both runs write it); the start is taken just before
              the command.

Targets (this 2-CPU machine): kit / default-threads loop >= 1.8x; kit / tuned loop >= 0.97x; checkpoint
>= 0.8x of the raw write; launch <= 1.0x of torchrun. The table and the JSON say which were met; the exit
code is 0 whenever the bench ran (1 if a measured run failed, 2 for a usage error).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from hpc_ddp.config import build_parser
from hpc_ddp.errors import UsageError, run_main

PROG = "python -m hpc_ddp.bench"
SECTIONS = ("overhead", "scaling", "checkpoint", "launch")
TASK = "mlp"
MLP_SAMPLES = 8192  # the mlp task's dataset (hpc_ddp/tasks.py)
MIN_TRIALS = 5
# A surrounding launcher's ranks or the user's thread settings would change how a contender runs; the
# comparison is about what each one does by itself.
_DROPPED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    op: str  # ">=" or "<="
    threshold: float

    @property
    def met(self) -> bool:
        return self.value >= self.threshold if self.op == ">=" else self.value <= self.threshold

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "op": self.op, "threshold": self.threshold,
                "met": self.met}


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


class RunFailed(Exception):
    """A measured command failed: the bench stops, since its figures would mean nothing."""


# ----- pure helpers -------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-trial ratios: trial i of one contender against trial i of the other."""
    return [a / b if b else float("nan") for a, b in zip(numerators, denominators, strict=True)]


def steps_per_epoch(world_size: int, batch_size: int) -> int:
    return MLP_SAMPLES // world_size // batch_size


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _DROPPED}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU comparison, also on a machine with GPUs
    return env


def read_records(path: Path) -> list[dict[str, Any]]:
    from hpc_ddp.metrics import read_records as read  # skips a line a crash cut

    return read(path)


def end_rate(folder: Path) -> float:
    """The samples/s of the "end" record in a kit run folder."""
    for record in read_records(folder / "metrics.jsonl"):
        if record.get("event") == "end":
            return float(record["samples_per_s"])
    raise RunFailed(f"no 'end' record in {folder / 'metrics.jsonl'}")


def first_step_time(folder: Path) -> float:
    """Wall-clock time of rank 0's first optimizer step: its `"step": 1` metrics record."""
    for record in read_records(folder / "metrics.jsonl"):
        if record.get("event") == "step" and record.get("step") == 1:
            return float(record["time"])
    raise RunFailed(f"no record of step 1 in {folder / 'metrics.jsonl'}")


def load_average() -> float:
    return os.getloadavg()[0]


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ----- running things -----------------------------------------------------------------------------------
def run_cmd(cmd: list[str], log: Path, preexec: Callable[[], None] | None = None,
            timeout: float = 600) -> float:
    """Run `cmd` with its output in `log`; returns the wall-clock time just before it started."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        start = time.time()
        try:
            code: int | str = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=child_env(), preexec_fn=preexec,
                                             timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = f"a timeout after {timeout:.0f} s"
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-8:]
        raise RunFailed(f"`{' '.join(cmd)}` ended with {code}; last lines of {log}:\n    "
                        + "\n    ".join(tail))
    return start


def kit_cmd(folder: Path, world_size: int, s: Settings) -> list[str]:
    return [sys.executable, "-m", "hpc_ddp.submit", "--local", "--nodes", "1", "--tasks-per-node",
            str(world_size), "--task", TASK, "--batch-size", str(s.batch_size), "--max-steps", str(s.steps),
            "--save-every-epochs", "0", "--folder", str(folder)]


def torchrun_cmd() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


class Runner:
    """Gives each run its own folder and log under the work folder, and prints a line per run."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.count = 0

    def folder(self, label: str) -> Path:
        self.count += 1
        return self.s.work / f"{self.count:03d}-{label}"

    def done(self, trial: int, label: str, figure: str) -> None:
        progress(f"trial {trial + 1}/{self.s.trials} {label}: {figure} (load {load_average():.1f})")

    def kit(self, label: str, world_size: int, trial: int, cpus: Sequence[int] | None = None) -> float:
        folder = self.folder(label)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        run_cmd(kit_cmd(folder, world_size, self.s), folder.with_suffix(".log"), preexec=pin)
        rate = end_rate(folder)
        self.done(trial, label, f"{rate:,.0f} samples/s")
        return rate

    def hand(self, label: str, threads: str, trial: int) -> float:
        folder = self.folder(label)
        folder.mkdir(parents=True)
        out = folder / "result.json"
        run_cmd([sys.executable, "-m", "hpc_ddp.bench_hand", "--threads", threads, "--world-size",
                 str(self.s.world_size), "--steps", str(self.s.steps), "--batch-size", str(self.s.batch_size),
                 "--out", str(out)], folder / "output.log")
        rate = float(json.loads(out.read_text())["samples_per_s"])
        self.done(trial, label, f"{rate:,.0f} samples/s")
        return rate

    def first_step(self, label: str, cmd: list[str], trial: int) -> float:
        folder = self.folder(label)
        start = run_cmd([*cmd, "--folder", str(folder)], folder.with_suffix(".log"))
        seconds = first_step_time(folder) - start
        self.done(trial, label, f"{seconds:.2f} s to the first step")
        return seconds


# ----- sections -----------------------------------------------------------------------------------------
def throughput(s: Settings, sections: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The overhead and scaling sections, in one interleaved rotation of runs (they share the kit's runs)."""
    runner = Runner(s)
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[:max(1, len(cpus) // s.world_size)]
    rates: dict[str, list[float]] = {"kit": [], "naive": [], "tuned": [], "one_rank": []}
    runs: dict[str, Callable[[int], float]] = {
        "kit": lambda trial: runner.kit(f"kit-{s.world_size}-ranks", s.world_size, trial),
        "tuned": lambda trial: runner.hand("hand-loop-tuned-threads", "tuned", trial),
        "naive": lambda trial: runner.hand("hand-loop-default-threads", "default", trial),
        "one_rank": lambda trial: runner.kit(f"kit-1-rank-{len(share)}-cpu", 1, trial, cpus=share)}
    wanted = ["kit"] + (["tuned", "naive"] if "overhead" in sections else []) + \
        (["one_rank"] if "scaling" in sections else [])
    for trial in range(s.trials):
        # A B C D, then D C B A: a load that rises or falls during the bench favours no contender. The kit
        # and the tuned loop, the closest pair, run back to back.
        for name in wanted if trial % 2 == 0 else wanted[::-1]:
            rates[name].append(runs[name](trial))
    result: dict[str, dict[str, Any]] = {}
    if "overhead" in sections:
        result["overhead"] = {
            "kit_samples_per_s": median(rates["kit"]), "naive_samples_per_s": median(rates["naive"]),
            "tuned_samples_per_s": median(rates["tuned"]),
            "kit_vs_naive": median(ratios(rates["kit"], rates["naive"])),
            "kit_vs_tuned": median(ratios(rates["kit"], rates["tuned"])),
            "trials": {k: rates[k] for k in ("kit", "naive", "tuned")},
            "measured": "global samples/s on rank 0 from the end of step 1 to the end of the last step",
            "fair_settings": "kit: --save-every-epochs 0 and --max-steps inside epoch 0 (no checkpoint or "
                             "epoch end in the window; its final save comes after it), default "
                             "--log-every-s; hand loops: no saves"}
    if "scaling" in sections:
        efficiency = [n / (s.world_size * one) if one else float("nan")
                      for n, one in zip(rates["kit"], rates["one_rank"], strict=True)]
        result["scaling"] = {
            "ranks": s.world_size, "samples_per_s": median(rates["kit"]),
            "one_rank_samples_per_s": median(rates["one_rank"]), "one_rank_cpus": len(share),
            "efficiency": median(efficiency),
            "trials": {"ranks": rates["kit"], "one_rank": rates["one_rank"]}}
    return result


def raw_write(path: Path, data: bytes) -> float:
    """Seconds to write `data` to a new file sequentially and fsync it: the disk's own speed."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def checkpoint_section(s: Settings) -> dict[str, Any]:
    """Trainer.save() against a raw write + fsync of the same bytes to the same folder, interleaved."""
    import torch

    from hpc_ddp import checkpoint, cluster
    from hpc_ddp.config import TrainConfig
    from hpc_ddp.log import RankLog
    from hpc_ddp.loop import Trainer
    from hpc_ddp.process_group import process_group
    from hpc_ddp.tasks import build

    folder = s.work / "checkpoint"
    folder.mkdir(parents=True)
    # Rank 0 of a --world-size job on this machine gets cpus // ranks threads from the kit.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // s.world_size))
    cfg = TrainConfig(task=TASK, batch_size=s.batch_size, folder=str(folder), keep=2)
    env = cluster.detect({})
    device = torch.device("cpu")
    durable_at: list[float] = []
    original = checkpoint.atomic_save

    def probed(obj: Any, path: Path) -> int:  # returns once the file is renamed and its folder fsynced
        nbytes = original(obj, path)
        durable_at.append(time.perf_counter())
        return nbytes

    t: dict[str, list[float]] = {"kit_s": [], "raw_s": [], "stall_s": [], "latest_s": []}
    nbytes = 0
    checkpoint.atomic_save = probed  # type: ignore[assignment]
    try:
        with process_group(env, device, "gloo", 60.0):
            torch.manual_seed(cfg.seed)
            with Trainer(cfg, env, device, build(cfg), folder, RankLog(0, io.StringIO())) as trainer:
                inputs, target = next(iter(trainer.loader))

                def train_step() -> None:
                    """What precedes a save in training: a step, ending with the loop's per-step all-reduce.
                    Before it, `os.sync()`: nothing left pending from the previous trial (saves are minutes apart
                    in training)."""
                    os.sync()
                    loss = trainer._micro_step(inputs, target, 1.0, sync=True)
                    trainer._optimizer_step()
                    trainer._agree(loss, 1)

                for trial in range(-1, s.ckpt_trials):  # trial -1: warm-up, not counted
                    trainer.pos.step = trial + 2  # a new file each time, as in training
                    train_step()
                    start = time.perf_counter()
                    trainer.save()
                    stall = time.perf_counter() - start
                    path, nbytes = trainer.writer.wait()  # type: ignore[misc]
                    latest = time.perf_counter() - start
                    data = path.read_bytes()
                    train_step()
                    raw = raw_write(folder / "checkpoints" / f"raw-{trial + 1}.bin", data)
                    if trial < 0:
                        continue
                    for key, value in (("kit_s", durable_at[-1] - start), ("raw_s", raw), ("stall_s", stall),
                                       ("latest_s", latest)):
                        t[key].append(value)
                    kit_rate, raw_rate = nbytes / t["kit_s"][-1] / 1e6, nbytes / raw / 1e6
                    progress(f"checkpoint {trial + 1}/{s.ckpt_trials}: kit {kit_rate:,.0f} MB/s (stall "
                             f"{stall * 1000:.1f} ms), raw write {raw_rate:,.0f} MB/s "
                             f"(load {load_average():.1f})")
    finally:
        checkpoint.atomic_save = original  # type: ignore[assignment]
    return {"bytes": nbytes, "kit_mb_per_s": nbytes / median(t["kit_s"]) / 1e6,
            "raw_mb_per_s": nbytes / median(t["raw_s"]) / 1e6,
            "kit_vs_raw": median(ratios(t["raw_s"], t["kit_s"])),
            "stall_ms": median(t["stall_s"]) * 1000, "latest_ms": median(t["latest_s"]) * 1000, "trials": t,
            "measured": "kit: Trainer.save() call until the file is renamed into place and its folder "
                        "fsynced; raw: create, write, fsync the same bytes; stall: time save() holds the "
                        "training thread"}


def launch_section(s: Settings) -> dict[str, Any]:
    """Command start to rank 0's first optimizer step: submit --local against torchrun, interleaved."""
    runner = Runner(s)
    train = ["--task", TASK, "--batch-size", str(s.batch_size), "--max-steps", str(s.launch_steps),
             "--save-every-epochs", "0", "--log-every-s", "0"]
    local = [sys.executable, "-m", "hpc_ddp.submit", "--local", "--nodes", "1", "--tasks-per-node",
             str(s.world_size), *train]
    torchrun = [*torchrun_cmd(), "--standalone", "--nproc-per-node", str(s.world_size), "-m", "hpc_ddp.train",
                *train]
    times: dict[str, list[float]] = {"local": [], "torchrun": []}
    order = [("local", "launch-submit-local", local), ("torchrun", "launch-torchrun", torchrun)]
    for trial in range(s.trials):
        for name, label, cmd in order if trial % 2 == 0 else order[::-1]:
            times[name].append(runner.first_step(label, cmd, trial))
    return {"local_s": median(times["local"]), "torchrun_s": median(times["torchrun"]),
            "local_vs_torchrun": median(ratios(times["local"], times["torchrun"])), "trials": times,
            "first_step": "wall-clock time on rank 0's metrics.jsonl record of step 1 (--log-every-s 0), "
                          "minus the time just before the command started"}


# ----- report -------------------------------------------------------------------------------------------
def targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    found = []
    if "overhead" in results:
        o = results["overhead"]
        found.append(Target("kit / hand loop, default threads", o["kit_vs_naive"], ">=", 1.8))
        found.append(Target("kit / hand loop, tuned threads", o["kit_vs_tuned"], ">=", 0.97))
    if "checkpoint" in results:
        found.append(Target("checkpoint / raw write", results["checkpoint"]["kit_vs_raw"], ">=", 0.8))
    if "launch" in results:
        found.append(Target("launch / torchrun", results["launch"]["local_vs_torchrun"], "<=", 1.0))
    return found


def rows(results: dict[str, dict[str, Any]], s: Settings) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    if "overhead" in results:
        o = results["overhead"]
        out += [("overhead", f"kit, submit --local, {s.world_size} ranks",
                 f"{o['kit_samples_per_s']:,.0f} samples/s"),
                ("", "hand loop, mp.spawn, default threads", f"{o['naive_samples_per_s']:,.0f} samples/s"),
                ("", "hand loop, mp.spawn, tuned threads", f"{o['tuned_samples_per_s']:,.0f} samples/s"),
                ("", "kit / default-threads loop", f"{o['kit_vs_naive']:.2f}x"),
                ("", "kit / tuned loop", f"{o['kit_vs_tuned']:.2f}x")]
    if "scaling" in results:
        c = results["scaling"]
        out += [("scaling", f"kit, 1 rank on {c['one_rank_cpus']} CPU(s)",
                 f"{c['one_rank_samples_per_s']:,.0f} samples/s"),
                ("", f"kit, {c['ranks']} ranks", f"{c['samples_per_s']:,.0f} samples/s"),
                ("", f"efficiency, {c['ranks']} ranks / ({c['ranks']} x 1 rank)", f"{c['efficiency']:.2f}")]
    if "checkpoint" in results:
        k = results["checkpoint"]
        out += [("checkpoint", f"kit save ({k['bytes'] / 1e6:.1f} MB), call to durable rename",
                 f"{k['kit_mb_per_s']:,.0f} MB/s"),
                ("", "raw write + fsync, same bytes and folder", f"{k['raw_mb_per_s']:,.0f} MB/s"),
                ("", "kit / raw", f"{k['kit_vs_raw']:.2f}x"),
                ("", "training stall per save", f"{k['stall_ms']:.1f} ms"),
                ("", "save call to `latest` updated", f"{k['latest_ms']:.1f} ms")]
    if "launch" in results:
        la = results["launch"]
        out += [("launch", "submit --local: start to first step", f"{la['local_s']:.2f} s"),
                ("", "torchrun --standalone: start to first step", f"{la['torchrun_s']:.2f} s"),
                ("", "submit --local / torchrun", f"{la['local_vs_torchrun']:.2f}x")]
    return out


def table(results: dict[str, dict[str, Any]], s: Settings) -> str:
    lines = [f"{a:<11} {b:<46} {c:>18}" for a, b, c in rows(results, s)]
    lines.append("")
    for t in targets(results):
        verdict = "met" if t.met else "MISSED"
        lines.append(f"target  {t.name:<34} {t.value:6.3f}  {t.op} {t.threshold:<5} {verdict}")
    if s.quick:
        lines.append("(--quick: one short trial per figure; this checks the bench, it measures nothing)")
    elif s.trials < MIN_TRIALS:
        lines.append(f"(fewer than {MIN_TRIALS} trials: indicative only on a shared machine)")
    return "\n".join(lines)


def header(s: Settings) -> str:
    return (f"hpc_ddp.bench: task {TASK}, {s.world_size} ranks x batch {s.batch_size}, {s.steps} steps, "
            f"{s.trials} interleaved trial(s), {len(os.sched_getaffinity(0))} CPUs")


# ----- command line -------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser(PROG, __doc__ or "")
    parser.add_argument("sections", nargs="*", metavar="SECTION",
                        help=f"sections to run: {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--trials", type=int, default=MIN_TRIALS,
                        help=f"interleaved trials per figure (default: {MIN_TRIALS}; checkpoint: 10x)")
    parser.add_argument("--steps", type=int, default=60,
                        help="optimizer steps per throughput run; the first is warm-up (default: 60)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks on this machine (default: 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default: 32)")
    parser.add_argument("--quick", action="store_true",
                        help="one trial of 4 steps per figure: checks that the bench works (for tests)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure and trial as JSON here")
    parser.add_argument("--folder", metavar="DIR",
                        help="keep every run's folder and log in a new folder under DIR (default: a "
                             "temporary folder, removed at the end)")
    ns = parser.parse_args(argv)
    sections = list(dict.fromkeys(ns.sections)) or list(SECTIONS)
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        raise UsageError(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS)}")
    if ns.quick:
        ns.trials, ns.steps = 1, 4
    if ns.trials < 1 or ns.world_size < 1 or ns.batch_size < 1 or ns.steps < 2:
        raise UsageError("--trials, --world-size and --batch-size must be at least 1, and --steps at least 2")
    if ns.json and not Path(ns.json).resolve().parent.is_dir():
        raise UsageError(f"--json {ns.json}: folder {Path(ns.json).resolve().parent} does not exist. Fix: "
                         "create it or write the JSON elsewhere")
    per_epoch = steps_per_epoch(ns.world_size, ns.batch_size)
    if ns.steps > per_epoch:
        raise UsageError(f"--steps {ns.steps}: the mlp task has {per_epoch} steps per epoch at "
                         f"{ns.world_size} ranks x batch {ns.batch_size}; the measured window must stay "
                         f"inside the first epoch. Fix: --steps {per_epoch} or fewer")
    return ns, sections


def run_sections(s: Settings, sections: Sequence[str]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if "overhead" in sections or "scaling" in sections:
        results.update(throughput(s, sections))
    if "checkpoint" in sections:
        results["checkpoint"] = checkpoint_section(s)
    if "launch" in sections:
        results["launch"] = launch_section(s)
    return {name: results[name] for name in SECTIONS if name in results}


def main(argv: list[str] | None = None) -> int:
    ns, sections = parse(argv)
    if ns.folder:
        # A fresh folder inside it every time: a kit run that found an earlier run's checkpoints would resume.
        Path(ns.folder).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hpc_ddp-bench-", dir=ns.folder or None))
    s = Settings(trials=ns.trials, steps=ns.steps, world_size=ns.world_size, batch_size=ns.batch_size,
                 work=work, quick=ns.quick)
    load_before = load_average()
    progress(f"{header(s)}; load {load_before:.1f}; runs in {work}")
    started = time.monotonic()
    try:
        results = run_sections(s, sections)
    except RunFailed as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if not ns.folder:
            shutil.rmtree(work, ignore_errors=True)
    print(header(s), flush=True)
    print(table(results, s), flush=True)
    if ns.json:
        report = {"settings": {"task": TASK, "trials": s.trials, "steps": s.steps, "world_size": s.world_size,
                               "batch_size": s.batch_size, "quick": s.quick,
                               "cpus": len(os.sched_getaffinity(0)),
                               "torch": version("torch"), "load_before": load_before,
                               "load_after": load_average(), "seconds": round(time.monotonic() - started, 1)},
                  "sections": results, "targets": [t.as_dict() for t in targets(results)]}
        Path(ns.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(PROG, main)
