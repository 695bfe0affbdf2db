"""Every random number generator a training step may draw from: torch's CPU generator, the rank's CUDA one,
Python's `random` and NumPy's global one. `seed` starts them all from --seed; `state`/`load` are what every
checkpoint keeps of each rank's (the `rng` part), so a resumed run draws what the uninterrupted one drew.

Why all four: a dataset transform or a step that calls `random.random()` or `np.random.rand()` draws from a
generator torch does not own. Unseeded, Python's and NumPy's start from the OS's entropy, so two runs with the
same --seed differ (and a resume cannot be compared with anything); seeded but not saved, a resume replays the
seed's stream instead of going on with it. (DataLoader workers seed their own: hpc_ddp.run.data.seeding.)

`isolated` runs a block on generators of its own and gives the training's back untouched after it: the
evaluation (seeded from --seed and its step, so it draws the same whenever and however often it runs) and a
stream's fetch ahead in the rank's own process (its batches seed themselves), whose draws must never move the
streams a checkpoint saves at the step boundary.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch


def _numpy() -> Any:
    """NumPy if installed (torch imports it when it is: this costs nothing), else None."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def seed(value: int) -> None:
    """The same --seed on every rank, for every generator (the same initial weights on every rank)."""
    torch.manual_seed(value)
    random.seed(value)
    np = _numpy()
    if np is not None:
        np.random.seed(value % 2**32)


def seed_cpu(value: int) -> None:
    """Seed the generators a CPU computation draws from (data, evaluation): torch's CPU one, Python's `random`,
    NumPy's when NumPy is loaded (never imported for this). Never a CUDA generator: `torch.manual_seed` would
    seed every device's, the training's included."""
    torch.default_generator.manual_seed(value)
    random.seed(value)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(value % 2**32)


def state(device: torch.device) -> dict[str, Any]:
    """This rank's generators, as plain data that loads under torch.load(weights_only=True)."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return out


def load(saved: dict[str, Any], device: torch.device) -> None:
    """Put this rank's generators back where `state` found them. A checkpoint without one of them (NumPy's is
    kept only where NumPy is installed, and only since this module) leaves that one on the seed's stream."""
    torch.set_rng_state(saved["cpu"])
    random.setstate(_to_tuples(saved["python"]))
    if device.type == "cuda" and saved.get("cuda") is not None:
        torch.cuda.set_rng_state(saved["cuda"], device)
    np = _numpy() if saved.get("numpy") is not None else None
    if np is not None:
        kind, keys, pos, has_gauss, gauss = saved["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _to_lists(obj: Any) -> Any:
    """random.getstate() as nested lists: plain data that loads under weights_only=True."""
    return [_to_lists(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _to_tuples(obj: Any) -> Any:
    return tuple(_to_tuples(x) for x in obj) if isinstance(obj, list) else obj


@contextlib.contextmanager
def isolated(device: torch.device, seed: int | None = None) -> Iterator[None]:
    """Run the block on its own generators (all four; seeded from `seed` when given), then put the training's
    back as they were: nothing the block draws moves them."""
    np = _numpy()
    saved = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state() if np is not None else None,
        torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )
    try:
        if seed is not None:
            seed_cpu(seed)
            if device.type == "cuda":
                torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if np is not None:
            np.random.set_state(saved[2])
        if saved[3] is not None:
            torch.cuda.set_rng_state(saved[3], device)
