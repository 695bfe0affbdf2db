"""`python -m hpc_ddp.doctor resume --task mod:build [training options]`: does a stop resume your task exactly?

It runs the task locally twice with the same options (`python -m hpc_ddp.submit --local`, 1 node x 2 CPU
processes unless told otherwise, `--deterministic`): once uninterrupted, then again stopped by real
preemption signals (SIGUSR2) at points chosen from the first run's shape with a seeded
generator (hpc_ddp.doctor.stops): in the run's last step, within gradient accumulation, during an evaluation, at
an epoch's last step, while a save is in flight, the first step after a resume. Each stop saves, the launcher
starts the run again, and it resumes. A probe inside every rank (hpc_ddp.doctor.probe) fingerprints every batch, every generator and
the state every step starts from. The two runs are then compared bit for bit (hpc_ddp.doctor.divergence), and
the first divergence is named: which part, at which step, after which stop, the likely cause and the fix. Last,
when everything matched, the same command is run once more on the finished run, which must say it is finished
and write nothing (after a divergence the verdict is already "not exact": that start is saved).

The run is checked as its options describe it, never shortened: one longer than --steps (the check's cap, 200
optimizer steps unless raised) is refused (`stops.too_long`), at once when --max-steps says so, else as soon as
the uninterrupted run's first step record tells its length (or its steps pass the cap: a stream's run has no
known length), and the processes it started are ended.

Exit 0 only when every stop happened and everything matched; 1 otherwise; 2 for bad options, a run too short
for the kinds of stop it would try (`stops.too_short`) or too long for the cap, a folder another check holds,
or when the task is refused at start (its line is shown). The check holds its folder (`run.lock`, hpc_ddp.run.folder.hold_folder)
while it runs; SIGTERM, SIGHUP or Ctrl-C end every process it started (the launcher, its fork server, the ranks,
their workers) at once, and it exits 128 + the signal. A run that fails shows its last lines and the command
that reproduces it with the user's own task.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp import exitcodes
from hpc_ddp.cli import build_parser
from hpc_ddp.doctor import divergence, stops
from hpc_ddp.doctor.divergence import Evidence
from hpc_ddp.doctor.probe import PROBE_TASK, Plan, Stop
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.shape import job_shape
from hpc_ddp.run import configfile
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.storage import Storage
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.config import TrainConfig, add_train_arguments, from_namespace
from hpc_ddp.run.records.metrics_read import iter_records
from hpc_ddp.variables import RESUME_PROBE, SAVE_DELAY_S

PROG = "python -m hpc_ddp.doctor resume"
MARKER = "resume-check.json"  # a folder the check made (and may empty again)
SAVE_DELAY = (
    0.5  # seconds each write of the stopped run waits: a stop after a save lands while it is in flight
)
RUNS = ("uninterrupted", "stopped", "repro")  # "repro": where the command shown for a failed run writes
ENDS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)  # signals that end the check and all it started
CHECK_ROLE = "resume check"  # the role in its folder's run.lock
END_WAIT_S = 5.0  # how long the processes the check SIGKILLed may take to be gone
CAP = 200  # --steps by default: the longest run the check takes (each stop runs the rest of it again)
WATCH_EVERY_S = 0.2  # how often the uninterrupted run's records are read for its length


class Ended(Exception):
    """The check was sent one of ENDS: raised by its handler, wherever the check is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def build_argparser() -> argparse.ArgumentParser:
    parser = build_parser(PROG, __doc__ or "")
    group = parser.add_argument_group("resume check")
    group.add_argument(
        "--steps",
        type=int,
        default=CAP,
        help=f"the longest run checked, in optimizer steps (default: {CAP}): a longer one is refused, never "
        "shortened",
    )
    group.add_argument(
        "--stop-seed", type=int, default=0, help="chooses the stop points among the candidates (default: 0)"
    )
    group.add_argument(
        "--stops",
        type=int,
        default=0,
        metavar="N",
        help="stop at N kinds of points at most, chosen by --stop-seed: a quicker check (default: 0, every kind "
        "the run has)",
    )
    group.add_argument("--nodes", type=int, default=1, help="emulated nodes (default: 1)")
    group.add_argument("--gpus-per-node", type=int, default=0, help="one task per GPU (default: 0, CPU)")
    group.add_argument(
        "--tasks-per-node", type=int, default=None, help="CPU tasks per node (default: 2 without GPUs)"
    )
    configfile.add_argument(parser)
    add_train_arguments(parser, "runs/resume-check-<task>, the check's own (its two runs go inside)")
    return parser


@dataclasses.dataclass(frozen=True)
class Check:
    """One resume check: the options of both runs and where they go."""

    cfg: TrainConfig  # the user's options, as given
    folder: Path  # the check's own folder: uninterrupted/, stopped/, their traces and logs
    shape_args: tuple[str, ...]
    steps: int  # the cap: the longest run checked (--steps)
    seed: int
    stops: int = 0  # kinds of stop points at most (0: every kind the run has)

    def run_folder(self, name: str) -> Path:
        return self.folder / name

    def options(self, name: str) -> TrainConfig:
        """The options of the local run `name`, with the user's task."""
        return dataclasses.replace(
            self.cfg,
            folder=str(self.run_folder(name)),
            # The run as the user's options describe it: never shortened (a longer one than --steps is refused)
            deterministic=True,
            resume="auto",
            overwrite=False,
            max_requeue=99,  # one requeue per stop (a stop is a preemption)
            max_restarts=0,  # a failure is a finding, not something to retry
        )

    def argv(self, name: str) -> list[str]:
        """The local run's command line: the user's options with the probe as the task."""
        cfg = dataclasses.replace(self.options(name), task=PROBE_TASK)
        return [sys.executable, "-m", "hpc_ddp.submit", "--local", *self.shape_args, *cfg.to_argv()]

    def repro(self) -> str:
        """The command that runs the user's task as the check ran it, without the probe: to reproduce a
        failure (in `<folder>/repro`, which the next check empties)."""
        from hpc_ddp.launch.rerun import resume_command

        cfg = self.options("repro")
        return resume_command(
            ["--local", *self.shape_args, *dataclasses.replace(cfg, max_requeue=0).to_argv()]
        )

    def bound(self) -> str:
        """The options that end the run: its step limit, and its epochs."""
        if self.cfg.max_steps:
            return f"--max-steps (now {self.cfg.max_steps}) or --epochs (now {self.cfg.epochs})"
        return f"--epochs (now {self.cfg.epochs})"


def main(argv: Sequence[str]) -> int:
    ns = configfile.parse(build_argparser(), list(argv))
    shape = job_shape(ns.nodes, ns.gpus_per_node, ns.tasks_per_node)
    if ns.steps < 2:
        raise UsageError(f"--steps {ns.steps}: the check needs at least 2 steps, e.g. --steps {CAP}")
    if ns.stops < 0:
        raise UsageError(f"--stops {ns.stops}: 0 (every kind of point) or more, e.g. --stops 2")
    cfg = from_namespace(ns)
    if cfg.task == PROBE_TASK:
        raise UsageError(f"--task {PROBE_TASK} is the check's own probe: give your task")
    shape_args = ("--nodes", str(shape.nodes), "--gpus-per-node", str(shape.gpus_per_node))
    if shape.gpus_per_node == 0:
        shape_args += ("--tasks-per-node", str(shape.tasks_per_node))
    folder = Path(cfg.folder) if cfg.folder else Path("runs", "resume-check-" + _slug(cfg.task))
    check = Check(cfg, folder, shape_args, ns.steps, ns.stop_seed, ns.stops)
    if cfg.max_steps > check.steps:  # known before anything runs
        raise UsageError(stops.too_long(cfg.max_steps, check.steps, check.bound()))
    return run(check, say)


def say(line: str) -> None:
    print(f"[resume check] {line}", flush=True)


def _slug(task: str) -> str:
    return run_folder.default_for_local_run(task).name


def run(check: Check, tell: Any = say) -> int:
    """The check, holding its folder; ended at once by ENDS (every process it started with it)."""
    lock = _prepare(check.folder, check.cfg)
    previous = {signum: signal.signal(signum, _end) for signum in ENDS}
    try:
        return _check(check, tell)
    except Ended as e:
        name = signal.Signals(e.signum).name
        tell(
            f"stopped by {name}: every process the check started has ended; nothing was proved "
            f"(exit {128 + e.signum}); the runs so far are in {check.folder}"
        )
        return 128 + e.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        lock.release()


def _end(signum: int, _frame: object) -> None:
    raise Ended(signum)


def _check(check: Check, tell: Any) -> int:
    began = time.monotonic()
    tell(f"{check.cfg.task}: checking that a stopped run resumes bit for bit, in {check.folder}")
    straight = check.run_folder("uninterrupted")
    watch = Watch(straight / run_folder.METRICS, check.steps, check.bound())
    code = _launch(check, "uninterrupted", Plan(check.cfg.task, str(straight / "trace")), {}, watch=watch)
    if watch.refusal:
        tell(watch.refusal)
        return exitcodes.USAGE
    if code != exitcodes.OK:
        return _failed_run(check, "uninterrupted", code, tell)
    shape = _shape(straight)
    refusal = stops.too_short(shape, check.stops, check.bound())
    if refusal:
        tell(refusal)
        return exitcodes.USAGE
    chosen, skipped = stops.choose(shape, check.seed, check.stops)
    if not chosen:
        tell(f"the run is too short to stop anywhere: make it longer with {check.bound()}")
        return exitcodes.FAILED
    words = [stops.describe(s, shape.micro, shape.evals) for s in chosen]
    tell(f"uninterrupted: {shape.last} steps; now stopped {len(chosen)} times:")
    for k, line in enumerate(words, 1):
        tell(f"  stop {k}, {line}")
    for line in skipped:
        tell(f"  not tried: {line}")
    stopped = check.run_folder("stopped")
    plan = Plan(check.cfg.task, str(stopped / "trace"), tuple(chosen))
    code = _launch(check, "stopped", plan, {SAVE_DELAY_S: str(SAVE_DELAY)})
    if code != exitcodes.OK:
        return _failed_run(check, "stopped", code, tell)
    problems = _missed_stops(stopped / "trace", chosen, words)
    storage = store.storage_named(check.cfg.checkpoint_storage)  # the runs' own: built once, read by both
    found = divergence.first_divergence(
        evidence(store.CheckpointStore(straight, storage)), evidence(store.CheckpointStore(stopped, storage))
    )
    if found is not None:
        for line in divergence.explain(found, [(s.key(), w) for s, w in zip(chosen, words, strict=True)]):
            tell(line)
    for line in problems:
        tell(line)
    # The rerun on the finished run is one more start of the ranks (a torch import, a rendezvous): worth it
    # only while the verdict may still be "exact". Once a stop diverged or was missed, the check is not exact
    # whatever the rerun shows, and the user fixes that first.
    rerun = "" if found is not None or problems else _finished_writes_nothing(check, plan)
    if rerun:
        tell(rerun)
    seconds = time.monotonic() - began
    if found is None and not problems and not rerun:
        untried = "; kinds not tried: " + ", ".join(line.split(":")[0] for line in skipped) if skipped else ""
        tell(
            f"every stop matched: optimizer settings and state, parameters, buffers, RNG streams, data order, "
            f"the step records (loss, grad_norm, lr, the step's own values), evaluation and epoch records, "
            f"model.pth, the final and best checkpoints and the pointers are bitwise equal to the uninterrupted "
            f"run of {shape.last} steps ({seconds:.0f} s){untried}"
        )
        return exitcodes.OK
    tell(f"the resume is not exact; the runs are in {check.folder} ({seconds:.0f} s)")
    return exitcodes.FAILED


def _prepare(folder: Path, cfg: TrainConfig) -> run_folder.FolderLock:
    """The check's folder, held (a second check there is refused before it changes anything) and emptied of an
    earlier check's runs; one that holds anything else, or a file, is refused."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(
            f"--folder {folder} is a file: the check needs a folder of its own (its two runs go inside). Fix: "
            "--folder a new or empty folder"
        )
    if folder.exists() and any(folder.iterdir()) and not (folder / MARKER).is_file():
        raise UsageError(
            f"{folder} exists and is not a resume check's folder: the check empties its folder. Fix: "
            "--folder a new or empty folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"--folder {folder} cannot be made ({e.strerror or e}). Fix: --folder a new folder you can write"
        ) from None
    try:
        lock = run_folder.hold_folder(folder, CHECK_ROLE, None, 0)
    except UsageError as e:
        holder = _holder(folder / run_folder.LOCK_NAME)
        if holder is None or holder.get("role") != CHECK_ROLE:
            raise
        raise UsageError(
            f"{folder} is held by another resume check (pid {holder.get('pid')} on {holder.get('host')}): one "
            "check per folder. Fix: wait for it to end, or --folder another folder"
        ) from e
    try:
        for name in RUNS:
            shutil.rmtree(folder / name, ignore_errors=True)
        (folder / MARKER).write_text(json.dumps({"task": cfg.task, "time": time.time()}) + "\n")
    except BaseException:
        lock.release()
        raise
    return lock


def _holder(lock: Path) -> dict[str, Any] | None:
    try:
        return _json(lock.read_text(errors="replace"))
    except OSError:  # released meanwhile
        return None


def _launch(
    check: Check, name: str, plan: Plan, extra: Mapping[str, str], log: str = "", watch: Watch | None = None
) -> int:
    """One local run in `<check folder>/<name>`, its console in `<check folder>/<log or name>.log`; its exit
    code. `watch`: read while it runs; once it refuses the run, the run is ended at once."""
    env = {**os.environ, RESUME_PROBE: plan.to_json(), **extra}
    with open(check.folder / f"{log or name}.log", "w") as out:
        # Its own session: a terminal's Ctrl-C reaches the check alone, which ends the whole tree itself.
        proc = subprocess.Popen(
            check.argv(name),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while watch is not None:
                try:
                    return proc.wait(WATCH_EVERY_S)
                except subprocess.TimeoutExpired:
                    if watch.read():
                        end_tree(proc)
                        return proc.returncode
            return proc.wait()
        except BaseException:  # Ended, mostly: nothing the check started outlives it
            end_tree(proc)
            raise


class Watch:
    """The uninterrupted run's length, read from its step records as they are written (`total_steps`, known
    from the first; a stream's run without --max-steps has none: its steps are counted): `refusal` is the line
    that refuses a run longer than the cap, once one is seen."""

    def __init__(self, path: Path, cap: int, bound: str) -> None:
        self.path, self.cap, self.bound = path, cap, bound
        self.offset = 0
        self.refusal = ""

    def read(self) -> bool:
        """Reads the records written since the last call; True once the run is known to pass the cap."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:  # not yet written
            return False
        lines = chunk.split(b"\n")
        self.offset += len(chunk) - len(lines[-1])  # a line not yet whole is read next time
        for line in lines[:-1]:
            record = _json(line.decode(errors="replace"))
            if record is None or record.get("event") != "step":
                continue
            total, step = record.get("total_steps") or 0, record.get("step") or 0
            if total > self.cap or step > self.cap:
                self.refusal = stops.too_long(total if total > self.cap else 0, self.cap, self.bound)
                return True
        return False


def end_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL `proc` and every process under it (the launcher: its fork server, its ranks, their DataLoader
    workers), and wait until they are gone, END_WAIT_S at most. SIGKILL, not the launcher's own graceful stop:
    the user asked the check to end, and a save of a run the check empties is no use to anyone."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
    proc.wait()
    deadline = time.monotonic() + END_WAIT_S
    while time.monotonic() < deadline and any(_running(pid) for pid in pids[1:]):
        time.sleep(0.05)


def _descendants(root: int) -> list[int]:
    """Every process under `root`, from /proc (Linux): the ranks are the launcher's children (it is their
    subreaper), each in a session of its own, so no process group holds them all."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    """`pid` exists and is no zombie (one whose parent, gone, left it to an init that does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _failed_run(check: Check, name: str, code: int, tell: Any) -> int:
    log = check.folder / f"{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [line for line in lines if ": error: " in line]
    if code == exitcodes.USAGE and errors:  # refused at start: the task's own line
        tell(f"the {name} run was refused at start: {errors[-1].split(': error: ', 1)[1]}")
        return exitcodes.USAGE
    tell(f"the {name} run failed (exit {code}); its last lines ({log}):")
    for line in lines[-15:]:
        tell(f"  {line}")
    tell(f"to reproduce it with your task alone: {check.repro()}")
    return exitcodes.FAILED


# ----- what a run left ---------------------------------------------------------------------------------------


def read_trace(folder: Path) -> dict[divergence.Key, dict[str, Any]]:
    """Every rank's probe records, merged: for a position recorded by several attempts, the latest's."""
    merged: dict[divergence.Key, dict[str, Any]] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        rank = int(path.stem[len("rank") :])
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "stop" in record or "data" not in record:
                continue
            key = (record["k"], record["s"], record["i"], rank)
            if key not in merged or merged[key]["a"] <= record["a"]:
                merged[key] = record
    return merged


def stop_records(folder: Path) -> list[dict[str, Any]]:
    path = folder / "rank0.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(_json, lines) if r is not None and "stop" in r]


def _json(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def evidence(checkpoints: CheckpointStore) -> Evidence:
    """What a run left (its records, trace, model.pth and checkpoints: those through the run's storage)."""
    folder, storage = checkpoints.folder, checkpoints.storage
    records = list(iter_records(folder / run_folder.METRICS))
    steps = [r for r in records if r.get("event") == "step"]
    losses = {r["step"]: r.get("loss") for r in steps}
    values = {r["step"]: {name: r.get(name) for name in divergence.RECORD_FIELDS} for r in steps}
    extras = {r["step"]: dict(r.get("metrics") or {}) for r in steps}
    evals = {r["step"]: (r.get("samples"), r.get("metrics")) for r in records if r.get("event") == "eval"}
    epochs: dict[int, list[tuple[Any, Any]]] = {}
    for r in records:
        if r.get("event") == "epoch":
            epochs.setdefault(r["step"], []).append((r.get("epoch"), r.get("loss")))
    best, latest = checkpoints.best(), checkpoints.latest()
    return Evidence(
        trace=read_trace(folder / "trace"),
        losses=losses,
        records=values,
        extras=extras,
        evals=evals,
        epochs=epochs,
        model=_model_fingerprints(folder / run_folder.MODEL, storage),
        checkpoint=checkpoint_fingerprints(latest, storage) if latest is not None else {},
        best_checkpoint=checkpoint_fingerprints(best, storage) if best is not None and best != latest else {},
        best=store.ckpt_step(best) if best is not None else None,
        latest=store.ckpt_step(latest) if latest is not None else None,
    )


def _shape(folder: Path) -> stops.Shape:
    """The uninterrupted run's steps, evaluations, epoch ends and saves (rank 0's trace and records)."""
    micro: dict[int, int] = {}
    evals: dict[int, int] = {}
    for kind, step, index, rank in read_trace(folder / "trace"):
        if rank != 0:
            continue
        table = micro if kind == "train" else evals
        table[step] = max(table.get(step, 0), index + 1)
    records = list(iter_records(folder / run_folder.METRICS))
    ends = [r["step"] for r in records if r.get("event") == "epoch"]
    saves = [r["step"] for r in records if r.get("event") == "save" and not r.get("final")]
    return stops.Shape(micro, evals, ends, saves)


def _missed_stops(trace: Path, planned: Sequence[Stop], words: Sequence[str]) -> list[str]:
    """A planned stop that never happened (its point was not reached in its attempt), or a save-in-flight
    stop that found no write in flight."""
    seen = {(r["a"], r["k"], r["s"], r["i"]): r for r in stop_records(trace)}
    lines = []
    for k, (stop, what) in enumerate(zip(planned, words, strict=True), 1):
        record = seen.get((stop.attempt, stop.kind, stop.step, stop.index))
        if record is None:
            lines.append(
                f"stop {k} ({what}) never happened: attempt {stop.attempt + 1} did not reach that point "
                "(work before it was lost or skipped)"
            )
        elif stop.save and not record.get("in_flight"):
            lines.append(f"stop {k} ({what}) found no checkpoint write in flight: that case was not tried")
    return lines


def _finished_writes_nothing(check: Check, plan: Plan) -> str:
    """The same command once more on the finished stopped run: it must say so, exit 0 and change nothing."""
    folder = check.run_folder("stopped")
    before = _folder_state(folder)
    code = _launch(check, "stopped", Plan(plan.task, plan.trace), {}, log="finished")
    after = _folder_state(folder)
    if code != exitcodes.OK:
        return f"the same command on the finished run exited {code} (see {check.folder / 'finished.log'})"
    changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
    if changed:
        return (
            "the same command on the finished run wrote again: "
            f"{', '.join(changed[:6])} (a finished run must be recognised and left as it is)"
        )
    return ""


def _folder_state(folder: Path) -> dict[str, str]:
    """What a rerun must not change: every file of the run folder but its logs, the lock and the trace."""
    state = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or rel.parts[0] in ("logs", "trace") or rel.name == run_folder.LOCK_NAME:
            continue
        state[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


# ----- fingerprints of saved states --------------------------------------------------------------------------


def _model_fingerprints(path: Path, storage: Storage) -> dict[str, str]:
    if not storage.isfile(str(path)):
        return {}
    from hpc_ddp.run.checkpoint import torchfile

    return flat_fingerprints(torchfile.load_file(path, storage, verify=False))  # written through the storage


def checkpoint_fingerprints(path: Path, storage: Storage) -> dict[str, str]:
    """Every value of a checkpoint (full: its one file; sharded: every rank file and every DCP tensor), by path
    ("optimizer.state.0.momentum_buffer", "rank1.rng.torch", ...), as fingerprints, read by its own format
    through the run's storage (Format.contents). The run's config and version are left out: they say how it was
    run, not what it trained."""
    from hpc_ddp.run.checkpoint import formats

    found: dict[str, str] = {}
    for prefix, state in formats.format_of(path, storage).contents(path, storage).items():
        found.update(flat_fingerprints(_trained(state), prefix))
    return found


def _trained(state: Any) -> Any:
    if not isinstance(state, dict):
        return state
    return {k: v for k, v in state.items() if k not in ("config", "version", "asked_grad_accum")}


def flat_fingerprints(value: Any, prefix: str = "") -> dict[str, str]:
    """`value` flattened to {dotted path: fingerprint} (tensors by their bytes, anything else by its repr)."""
    import torch

    from hpc_ddp.doctor.probe import fingerprint

    if isinstance(value, dict):
        found: dict[str, str] = {}
        for key, item in value.items():
            found.update(flat_fingerprints(item, f"{prefix}{key}."))
        return found
    if isinstance(value, (list, tuple)) and any(
        isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value
    ):
        found = {}
        for i, item in enumerate(value):
            found.update(flat_fingerprints(item, f"{prefix}{i}."))
        return found
    name = prefix.rstrip(".")
    if isinstance(value, torch.Tensor):
        return {name: fingerprint(value)}
    return {name: hashlib.sha256(repr(value).encode()).hexdigest()[:16]}
