"""Which checkpoint a run starts from, decided by global rank 0 and followed by every rank.

Ranks reading a shared filesystem on their own can disagree (a file visible on one node and not yet on
another, KempnerForge #49), and then load different states or deadlock. So rank 0 alone looks, and the
others receive its answer: a path, None (start fresh), or an error message that every rank raises.

`--resume never` and `--resume PATH` apply to a run's first start only. A restarted run (DistEnv.restart > 0:
a requeue, the local launcher's restart, a torchrun round after the first) always continues from its own
latest checkpoint (or, before it wrote one, from where its first start began); anything else would start over, or go back to a stale file,
after every preemption.

Deciding and changing are two steps: `plan` only looks (rank 0, before anything else is checked), `apply`
changes the folder (rank 0, once the task, the checkpoint and every option have been checked). A start that
is refused for any reason has deleted, moved and rewritten nothing. A start from a checkpoint older than the
folder's newest begins a new line of training: the later checkpoints (and model.pth) are another line's, and
are moved to `checkpoints/abandoned-<time>/`, never deleted and never resumed by accident.

Every checkpoint name (and model.pth, written through it too) is listed, read, moved and written through the
run's storage (`CheckpointStore`, the one the session built for this process); the records are this machine's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_ddp.cluster.env import restart_count
from hpc_ddp.errors import CheckpointCorrupt, CheckpointError, UsageError
from hpc_ddp.ledger import files
from hpc_ddp.ledger.attempts import ATTEMPTS
from hpc_ddp.run.checkpoint import formats, store
from hpc_ddp.run.checkpoint.format import Format
from hpc_ddp.run.checkpoint.storage import Storage
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.config import TrainConfig, accum_for, differences
from hpc_ddp.run.folder import METRICS, MODEL, TENSORBOARD, fsync_dir


@dataclass(frozen=True)
class Plan:
    """Where a start begins and what it will change in the folder once everything is checked (`apply`)."""

    start: Path | None  # the checkpoint to load; None: from scratch
    overwrite: bool = False  # --resume never --overwrite: delete the folder's checkpoints and model.pth
    set_aside: tuple[Path, ...] = ()  # checkpoints of another line: moved to checkpoints/abandoned-<time>/
    repoint: bool = False  # `latest` must name `start` (it names another file, or is unreadable)


def choose(
    cfg: TrainConfig, checkpoints: CheckpointStore, environ: Mapping[str, str], warn: Callable[[str], None]
) -> Path | None:
    """Rank 0: `plan` and `apply` at once; the checkpoint to start from, or None."""
    chosen = plan(cfg, checkpoints, environ, warn)
    apply(chosen, checkpoints, warn)
    return chosen.start


def plan(
    cfg: TrainConfig, checkpoints: CheckpointStore, environ: Mapping[str, str], warn: Callable[[str], None]
) -> Plan:
    """Rank 0: where to start, changing nothing. Raises UsageError/CheckpointError for the user."""
    restart = restart_count(environ) > 0  # DistEnv.restart: the one reader of the restart variables
    mode = "auto" if restart else cfg.resume
    if mode == "auto":
        found = formats.find_resumable(checkpoints, warn)
        if found is None and checkpoints.listed():
            raise _nothing_loads(checkpoints)
        if found is None and restart and cfg.resume not in ("auto", "never"):
            return _from_path(cfg.resume, checkpoints)  # restarted before it wrote a checkpoint of its own
        return _continue(found, checkpoints) if found else Plan(None)
    if mode == "never":
        existing = checkpoints.listed()
        if existing and not cfg.overwrite:
            raise UsageError(
                f"--resume never, but {checkpoints.folder} already holds {len(existing)} checkpoint(s). Fix: add "
                "--overwrite to delete them, use another --folder, or drop --resume never to continue"
            )
        return Plan(None, overwrite=bool(existing))
    return _from_path(mode, checkpoints)


def _nothing_loads(checkpoints: CheckpointStore) -> CheckpointError:
    """Every checkpoint failed to load (each was reported): say whether they are corrupt or only refused."""
    corrupt, intact = [], []
    for path in checkpoints.listed():
        try:
            formats.verify(path, checkpoints.storage)
        except CheckpointCorrupt:
            corrupt.append(path.name)
        except CheckpointError:
            intact.append(path.name)
    where = checkpoints.directory
    if not intact:
        return CheckpointError(
            f"no checkpoint in {where} can be loaded: all {len(corrupt)} are corrupt (see above). "
            "Fix: --resume never --overwrite to start over, or --resume PATH"
        )
    return CheckpointError(
        f"no checkpoint in {where} can be loaded: {', '.join(intact)} are intact but refused by "
        f"a weights_only load{' and ' + ', '.join(corrupt) + ' are corrupt' if corrupt else ''} "
        "(see above). Fix: --resume PATH of a checkpoint that loads, or another --folder "
        "(--resume never --overwrite would delete the intact files)"
    )


def _continue(start: Path, checkpoints: CheckpointStore) -> Plan:
    """Start from `start`, a checkpoint of this folder: the folder's later checkpoints are another line's."""
    step = store.ckpt_step(start)
    later = tuple(p for p in checkpoints.listed() if store.ckpt_step(p) > step)
    return Plan(start, set_aside=later, repoint=checkpoints.latest() != start)


def _from_path(mode: str, checkpoints: CheckpointStore) -> Plan:
    path, storage = Path(mode), checkpoints.storage
    if not (storage.isfile(mode) or storage.isdir(mode)):
        raise UsageError(f"--resume {mode}: no such file. Use auto, never, or the path of a checkpoint")
    path = checkpoints.resolve(path)  # checkpoints/best, checkpoints/latest: the checkpoint each names
    # An unreadable or code-running file is refused now, with its name in the message.
    formats.verify(path, storage)
    directory = checkpoints.directory
    if path.parent.resolve() == directory.resolve() and store.ckpt_step(path) >= 0:
        return _continue(directory / path.name, checkpoints)
    # A checkpoint from elsewhere: every checkpoint of this folder belongs to another line.
    return Plan(path, set_aside=tuple(checkpoints.listed()))


def apply(chosen: Plan, checkpoints: CheckpointStore, say: Callable[[str], None]) -> None:
    """Rank 0, once the start is fully checked: make the folder match the plan, saying what changed."""
    folder, storage, directory = checkpoints.folder, checkpoints.storage, checkpoints.directory
    model = folder / MODEL
    if chosen.overwrite:
        count = len(checkpoints.listed())
        storage.remove(str(directory))
        storage.remove(str(model))  # and its checksum: written through the run's storage (session)
        say(f"--resume never --overwrite: deleted the {count} checkpoint(s) and model.pth of {folder}")
        _records_aside(folder, say)
    if chosen.set_aside:
        aside = _new_folder(directory, "abandoned")
        there = [p for p in chosen.set_aside if storage.isfile(str(p)) or storage.isdir(str(p))]
        moved = sorted(there, key=store.ckpt_step)
        for path in moved + ([model] if storage.isfile(str(model)) else []):
            store.move(path, aside, storage)
        has_model = storage.isfile(str(aside / MODEL))
        fsync_dir(aside)
        fsync_dir(directory)
        start = f"{chosen.start.name} (step {store.ckpt_step(chosen.start)})" if chosen.start else "nothing"
        if chosen.start is not None and chosen.start.parent.resolve() != directory.resolve():
            start = str(chosen.start)
        say(
            f"starting from {start}: {len(moved)} checkpoint(s) of this folder ({', '.join(p.name for p in moved)})"
            f"{' and model.pth' if has_model else ''} belong to another line of training; moved to {aside}, "
            "nothing was deleted"
        )
    board = folder / TENSORBOARD
    if (chosen.overwrite or chosen.set_aside) and board.is_dir():
        # --tensorboard never writes a step twice (run/records/tblog.py): the curves of the line left behind would
        # hide the new line's steps up to theirs. They go with its checkpoints.
        into = (
            aside / TENSORBOARD if chosen.set_aside else _new_folder(folder, "tb-overwritten", create=False)
        )
        os.replace(board, into)
        say(f"TensorBoard's curves of the earlier line moved to {into}")
    _repoint(chosen, checkpoints, say)


def _repoint(chosen: Plan, checkpoints: CheckpointStore, say: Callable[[str], None]) -> None:
    """`latest` names the start (a pointer that is no file is moved aside first), or, when it named a
    checkpoint set aside, goes: the first save writes it again."""
    storage = checkpoints.storage
    pointer = checkpoints.directory / store.LATEST
    if chosen.repoint and chosen.start is not None:
        if storage.isdir(str(pointer)):
            broken = _new_folder(checkpoints.directory, "latest.unreadable", create=False)
            storage.rename(str(pointer), str(broken))
            say(f"{pointer} was not a file; moved to {broken}")
        named = (chosen.start.name + "\n").encode()
        files.patiently(lambda: storage.write_bytes(str(pointer), named), str(pointer), say)
    elif chosen.set_aside and storage.isfile(str(pointer)) and checkpoints.latest() is None:
        storage.remove(str(pointer))  # it named a file that was set aside; the first save writes it again


def _records_aside(folder: Path, say: Callable[[str], None]) -> None:
    """--overwrite starts a new line of training: the records of the line it deleted (metrics.jsonl,
    attempts.jsonl) move to records-overwritten-<time>/, so that the report and the retry budgets see the new
    line only. Kept, not deleted: they are the only account of what ran before."""
    found = [folder / name for name in (METRICS, ATTEMPTS) if (folder / name).is_file()]
    if found:
        into = _new_folder(folder, "records-overwritten")
        for path in found:
            os.replace(path, into / path.name)
        fsync_dir(folder)
        say(f"the records of the earlier line ({', '.join(p.name for p in found)}) moved to {into}")


def _new_folder(directory: Path, prefix: str, create: bool = True) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = directory / (f"{prefix}-{stamp}" + (f"-{n}" if n else ""))
        if not path.exists():
            if create:
                path.mkdir()
            return path
    raise UsageError(f"{directory}: too many {prefix}-{stamp}* entries; remove some")


def check_compatible(
    meta: Mapping[str, Any], path: Path, cfg: TrainConfig, world_size: int, fmt: type[Format]
) -> None:
    """A checkpoint from another model or an incompatible config fails here with both values shown. `meta` is
    what the checkpoint was written with (its world_size and config); whether another world size can load it
    is its format's to say (`fmt`: the full format refuses, naming both sizes)."""
    _check_format(fmt, path, cfg)
    saved = meta.get("config", {})
    resized = fmt.world_size_change(meta.get("world_size"), world_size)
    reshards = fmt.reshards  # declared by the format (Format.reshards)
    allowed = bool(resized) and cfg.allow_resize and reshards
    # Resized, the global batch changes anyway: --grad-accum may change to keep it (see `resize`).
    diffs = differences(saved, cfg, skip=("grad_accum",) if allowed else ())
    if resized and not allowed:
        diffs.append(
            resized + (" (a sharded checkpoint reshards: --allow-resize loads it)" if reshards else "")
        )
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was written with {', '.join(diffs)}; an exact resume needs the "
            "same values. Fix: run with the same settings, or start over with --resume never "
            "--overwrite (or another --folder)"
        )


def _check_format(fmt: type[Format], path: Path, cfg: TrainConfig) -> None:
    """A run keeps one checkpoint format: a checkpoint of another (--checkpoint-format changed on resume) is
    refused naming the flag, before any part would fail to load it as "another model"."""
    now = cfg.format_name()
    if fmt.name == now or fmt is formats.named(now):  # a plugin's class may keep its base's `name`
        return
    how = f" (auto: {now} under --strategy {cfg.strategy})" if cfg.checkpoint_format == "auto" else ""
    raise CheckpointError(
        f"checkpoint {path} is a {fmt.name} checkpoint, but this run writes --checkpoint-format {now}{how}; a "
        f"run resumes in the format it was saved in. Fix: --checkpoint-format {fmt.name} to resume it, or "
        "another --folder (or --resume never --overwrite) to start over"
    )


def reapply_lr(
    optimizer: Any, fresh: list[Any], state: Mapping[str, Any], cfg: TrainConfig, path: Path
) -> str | None:
    """A resume restores the optimizer's state, learning rates included. When --lr differs from the value the
    checkpoint was trained with, the learning rates the current options build (`fresh`, read before the state
    was loaded) are put back and this says so; if the optimizer does not take its rates from --lr (a task's own
    optimizer may not), the new value could not apply, and the start is refused rather than recording it."""
    saved = state.get("config", {}).get("lr")
    if saved is None or saved == cfg.lr:
        return None
    restored = [group.get("lr") for group in optimizer.param_groups]
    if _rates(fresh) == _rates(restored):
        raise UsageError(
            f"--lr {cfg.lr}: checkpoint {path} was trained with --lr {saved}, but this task's optimizer "
            f"does not take its learning rate from --lr (it is {_rates(restored)} either way), so the "
            f"new value would not apply. Fix: --lr {saved}, or change the learning rate in the task"
        )
    for group, rate in zip(optimizer.param_groups, fresh, strict=True):
        group["lr"] = rate
    return (
        f"--lr changed from {saved} to {cfg.lr} on resume: applied, the optimizer's learning rate is now "
        f"{_rates(fresh)} (was {_rates(restored)})"
    )


def _rates(values: list[Any]) -> list[float | None]:
    return [None if v is None else float(v) for v in values]


@dataclass(frozen=True)
class Resize:
    """A sharded checkpoint of `saved` ranks resumed on `now` (--allow-resize), and its global batch."""

    saved: int
    now: int
    batch_before: int  # samples per optimizer step over all ranks, as the checkpoint trained
    batch_after: int
    grad_accum: int  # what this run uses

    def describe(self) -> str:
        if self.saved == self.now:  # no new size: a resize before chose this --grad-accum (see `resize`)
            return (
                f"--allow-resize: the run goes on with the checkpoint's --grad-accum {self.grad_accum}, which an "
                f"earlier resize chose to keep the global batch at {self.batch_after} (the command line still "
                "says the value it was first given)"
            )
        kept = (
            f"kept at {self.batch_after} by --grad-accum {self.grad_accum}"
            if self.batch_before == self.batch_after
            else f"{self.batch_before} -> {self.batch_after} (no --grad-accum keeps it: "
            f"{self.batch_before} is not a multiple of {self.now} x --batch-size)"
        )
        return (
            f"--allow-resize: the checkpoint of {self.saved} ranks is resharded onto {self.now}; the global "
            f"batch is {kept}; bitwise equality with an uninterrupted run does not hold across a resize"
        )

    def record(self) -> dict[str, int]:
        return {
            "from": self.saved,
            "to": self.now,
            "global_batch": self.batch_after,
            "was": self.batch_before,
        }


def resize(
    cfg: TrainConfig, start: Path | None, world_size: int, storage: Storage
) -> tuple[TrainConfig, Resize | None]:
    """Every rank, before the model is built: with --allow-resize and a sharded checkpoint of another world
    size, the --grad-accum that keeps the global batch (the checkpoint's --grad-accum x its ranks, divided by
    the ranks now, when that divides evenly and --grad-accum was left as it was asked).

    "Left as asked": the command line's --grad-accum is the one the checkpoint's run was given
    (`asked_grad_accum` in its meta; a checkpoint without it: its own --grad-accum). So a run that a resize
    moved to another --grad-accum (a job that went on with fewer nodes, --min-nodes) keeps the resize's choice
    when it is requeued at that size, or resized again, from the same command line; a --grad-accum the user
    changed is theirs (at the same size, refused as any must-match change)."""
    if start is None or not cfg.allow_resize:
        return cfg, None
    fmt = formats.format_of(start, storage)
    if not fmt.reshards:  # declared by the format (Format.reshards): this one loads on its own size only
        return cfg, None
    meta = fmt.open(start, storage, verify=False).meta
    saved, config = int(meta.get("world_size") or world_size), meta.get("config", {})
    accum = int(config.get("grad_accum", cfg.grad_accum))
    left = cfg.grad_accum == int(meta.get("asked_grad_accum") or accum)
    before = cfg.batch_size * accum * saved
    if saved == world_size:
        if not left or accum == cfg.grad_accum:
            return cfg, None
        return replace(cfg, grad_accum=accum), Resize(saved, world_size, before, before, accum)
    kept = accum_for(accum, saved, world_size)
    if left and kept is not None:
        cfg = replace(cfg, grad_accum=kept)
    return cfg, Resize(
        saved, world_size, before, cfg.batch_size * cfg.grad_accum * world_size, cfg.grad_accum
    )
