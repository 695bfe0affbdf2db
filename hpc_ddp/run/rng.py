"""Every random number generator a training step may draw from: torch's CPU generator, the rank's CUDA one,
Python's `random` and NumPy's global one. `seed` starts them all from --seed; `state`/`load` are what every
checkpoint keeps of each rank's (the `rng` part), so a resumed run draws what the uninterrupted one drew.

Why all four: a dataset transform or a step that calls `random.random()` or `np.random.rand()` draws from a
generator torch does not own. Unseeded, Python's and NumPy's start from the OS's entropy, so two runs with the
same --seed differ (and a resume cannot be compared with anything); seeded but not saved, a resume replays the
seed's stream instead of going on with it. (DataLoader workers seed their own from torch's, per worker.)
"""

from __future__ import annotations

import random
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
