"""The checkpoint section: the kit's save path against a raw write + fsync of the same bytes."""

from __future__ import annotations

import functools
import io
import os
import time
from pathlib import Path
from typing import Any

from hpc_ddp.bench.runs import TASK, Settings, load_average, median, progress, ratios


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

    from hpc_ddp.cluster import placement
    from hpc_ddp.cluster.env import detect
    from hpc_ddp.cluster.group import process_group
    from hpc_ddp.log import RankLog
    from hpc_ddp.run.checkpoint import full, torchfile
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.tasks import build
    from hpc_ddp.run.trainer import Trainer

    folder = s.work / "checkpoint"
    folder.mkdir(parents=True)
    # Placed as rank 0 of a --world-size job on this machine: cpus // ranks threads, on CPU. Not pinned: the
    # launch section runs after this one, and its processes would inherit the mask.
    placement.place(0, s.world_size, {}, cuda_count=0, pin=False)
    cfg = TrainConfig(task=TASK, batch_size=s.batch_size, folder=str(folder), keep=2)
    env = detect({})
    device = torch.device("cpu")
    durable_at: list[float] = []

    def timed_save(obj: Any, path: Path) -> int:  # returns once the file is renamed and its folder fsynced
        nbytes = torchfile.atomic_save(obj, path)
        durable_at.append(time.perf_counter())
        return nbytes

    # The kit's own commit, with its save step timed: the Trainer's checkpoint seam, no patching.
    timed_commit = functools.partial(full.commit, save=timed_save)
    t: dict[str, list[float]] = {"kit_s": [], "raw_s": [], "stall_s": [], "latest_s": []}
    nbytes = 0
    with process_group(env, device, "gloo", 60.0):
        torch.manual_seed(cfg.seed)
        with Trainer(
            cfg, env, device, build(cfg), folder, RankLog(0, io.StringIO()), commit=timed_commit
        ) as trainer:
            inputs, target = next(iter(trainer.loader))

            def train_step() -> None:
                """What precedes a save in training: a step, ending with the loop's per-step all-reduce.
                Before it, `os.sync()`: nothing left pending from the previous trial (saves are minutes apart
                in training)."""
                os.sync()
                trainer.train_step(inputs, target)

            for trial in range(-1, s.ckpt_trials):  # trial -1: warm-up, not counted
                trainer.pos.step = trial + 2  # a new file each time, as in training
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
                for key, value in (
                    ("kit_s", durable_at[-1] - start),
                    ("raw_s", raw),
                    ("stall_s", stall),
                    ("latest_s", latest),
                ):
                    t[key].append(value)
                kit_rate, raw_rate = nbytes / t["kit_s"][-1] / 1e6, nbytes / raw / 1e6
                progress(
                    f"checkpoint {trial + 1}/{s.ckpt_trials}: kit {kit_rate:,.0f} MB/s (stall "
                    f"{stall * 1000:.1f} ms), raw write {raw_rate:,.0f} MB/s "
                    f"(load {load_average():.1f})"
                )
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
