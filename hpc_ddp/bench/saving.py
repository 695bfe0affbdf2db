"""The checkpoint section: the kit's save path against a raw write + fsync of the same bytes."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from hpc_ddp.bench.runs import TASK, Settings, drop_weights, load_average, median, progress, ratios
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore


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


class _Timed(Local):
    """The local filesystem, noting when each file it writes is durable (renamed into place, its folder
    fsynced): what `Trainer.save()` costs until the checkpoint is safe, without its promotion."""

    def __init__(self) -> None:
        self.durable_at: list[float] = []

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> int:
        nbytes = super().write(path, fill)
        self.durable_at.append(time.perf_counter())
        return nbytes


def checkpoint_section(s: Settings) -> dict[str, Any]:
    """Trainer.save() against a raw write + fsync of the same bytes to the same folder, interleaved."""
    import torch

    from hpc_ddp.cluster import placement
    from hpc_ddp.cluster.env import detect
    from hpc_ddp.cluster.group import process_group
    from hpc_ddp.log import RankLog
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.loop.trainer import Trainer
    from hpc_ddp.run.tasks import build

    folder = s.work / "checkpoint"
    folder.mkdir(parents=True)
    # Placed as rank 0 of a --world-size job on this machine: cpus // ranks threads, on CPU. Not pinned: the
    # launch section runs after this one, and its processes would inherit the mask.
    placement.place(0, s.world_size, {}, cuda_count=0, pin=False)
    cfg = TrainConfig(task=TASK, batch_size=s.batch_size, folder=str(folder), keep=2)
    env = detect({})
    device = torch.device("cpu")
    storage = _Timed()  # the kit's own storage, its checkpoint writes timed: the Trainer's seam, no patching
    t: dict[str, list[float]] = {"kit_s": [], "raw_s": [], "stall_s": [], "latest_s": []}
    nbytes = 0
    with process_group(env, device, "gloo", 60.0):
        torch.manual_seed(cfg.seed)
        checkpoints = CheckpointStore(folder, storage)
        with Trainer(cfg, env, device, build(cfg), RankLog(0, io.StringIO()), checkpoints) as trainer:
            batch = next(iter(trainer.feed.loader))

            def train_step() -> None:
                """What precedes a save in training: a step, ending with the loop's per-step all-reduce.
                Before it, `os.sync()`: nothing left pending from the previous trial (saves are minutes apart
                in training)."""
                os.sync()
                trainer.step([batch], 1)

            for trial in range(-1, s.ckpt_trials):  # trial -1: warm-up, not counted
                trainer.pos.step = (
                    trial + 2
                )  # a new file each time, as in training (the step counts one more)
                train_step()
                start = time.perf_counter()
                trainer.save()
                stall = time.perf_counter() - start
                path, nbytes = trainer.checkpointer.writer.wait()  # type: ignore[misc]
                latest = time.perf_counter() - start
                data = path.read_bytes()
                train_step()
                raw = raw_write(folder / "checkpoints" / f"raw-{trial + 1}.bin", data)
                if trial < 0:
                    continue
                timings = (storage.durable_at[-1] - start, raw, stall, latest)
                for key, value in zip(("kit_s", "raw_s", "stall_s", "latest_s"), timings, strict=True):
                    t[key].append(value)
                progress(
                    f"checkpoint {trial + 1}/{s.ckpt_trials}: kit {nbytes / t['kit_s'][-1] / 1e6:,.0f} MB/s "
                    f"(stall {stall * 1000:.1f} ms), raw write {nbytes / raw / 1e6:,.0f} MB/s "
                    f"(load {load_average():.1f})"
                )
    drop_weights(folder)
    return {
        "bytes": nbytes,
        "kit_mb_per_s": nbytes / median(t["kit_s"]) / 1e6,
        "raw_mb_per_s": nbytes / median(t["raw_s"]) / 1e6,
        "kit_vs_raw": median(ratios(t["raw_s"], t["kit_s"])),
        "stall_ms": median(t["stall_s"]) * 1000,
        "latest_ms": median(t["latest_s"]) * 1000,
        "trials": t,
        "measured": "kit: Trainer.save() call until the file is renamed into place and its folder "
        "fsynced; raw: create, write, fsync the same bytes; stall: time save() holds the "
        "training thread",
    }
