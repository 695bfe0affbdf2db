"""What a checkpoint may hold: a CPU copy safe to write while training goes on, made only of what a
`weights_only` load accepts, and weights that are finite.

"Refused" is never "corrupt" (hpc_ddp.errors): `to_cpu` makes sure the kit never writes a checkpoint that a
`weights_only` load would refuse (numpy scalars become Python numbers, anything else such a load would refuse
fails the save at once, naming where it is), and `check_savable` finds the same at start, on every rank,
without copying a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hpc_ddp.errors import CheckpointError, NonFinite


def to_cpu(obj: Any, what: str = "the state") -> Any:
    """A deep copy of a (nested) state with every tensor on CPU, safe to write while training goes on, made
    only of what a `weights_only` load accepts: numpy scalars become Python numbers (an optimizer built with
    `lr=np.float64(...)` used to save checkpoints that never loaded); anything else such a load would refuse
    raises CheckpointError naming where it is, before a byte is written."""
    try:
        return _copy(obj)
    except _Unsavable as e:
        raise CheckpointError(e.message(what)) from None


def check_savable(obj: Any, what: str) -> None:
    """What `to_cpu` would refuse, found without copying a tensor: every rank calls it before training, so
    that a state that could never be loaded back is a usage error at start, not a failed save later."""
    try:
        _walk(obj)
    except _Unsavable as e:
        raise CheckpointError(e.message(what)) from None


class _Unsavable(Exception):
    def __init__(self, value: Any) -> None:
        self.value, self.where = value, []  # keys from the inside out

    def message(self, what: str) -> str:
        where = what + "".join(f"[{k!r}]" for k in reversed(self.where))
        kind = type(self.value)
        return (
            f"{where} is a {kind.__module__}.{kind.__qualname__} ({repr(self.value)[:60]}), which a "
            "checkpoint cannot hold: torch.load(weights_only=True) refuses it, so the checkpoint could never "
            "be resumed. Fix: keep plain Python numbers, strings, lists, dicts and torch tensors in the "
            "model's, the optimizer's and the callbacks' state (or register the type with torch.serialization.add_safe_globals "
            "in your task module)"
        )


def _copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if type(obj) in _SCALARS:
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            try:
                out[k if type(k) in _SCALARS else _leaf(k)] = _copy(v)
            except _Unsavable as e:
                e.where.append(k)
                raise
        return out
    if type(obj) in (list, tuple, torch.Size):
        if set(map(type, obj)) <= _SCALARS:
            # Copied whole, at C speed: walking each rank's 625-int Python RNG state item by item cost
            # ~0.25 ms per rank on every save, on the training thread (hpc_ddp.bench).
            return type(obj)(obj)
        return type(obj)(_copy_items(obj))
    if type(obj) is set:
        return set(_copy_items(obj))
    return _leaf(obj)


def _copy_items(items: Iterable[Any]) -> Iterable[Any]:
    for i, v in enumerate(items):
        try:
            yield _copy(v)
        except _Unsavable as e:
            e.where.append(i)
            raise


def _walk(obj: Any) -> None:
    if isinstance(obj, torch.Tensor) or type(obj) in _SCALARS:
        return
    if isinstance(obj, dict):
        pairs: Iterable[tuple[Any, Any]] = obj.items()
    elif type(obj) in (list, tuple, torch.Size, set):
        pairs = enumerate(obj)
    else:
        _leaf(obj)
        return
    for k, v in pairs:
        try:
            if isinstance(obj, dict) and type(k) not in _SCALARS:
                _leaf(k)
            _walk(v)
        except _Unsavable as e:
            e.where.append(k)
            raise


def _leaf(obj: Any) -> Any:
    """A value that is no container and no tensor, as it can be saved: numpy scalars (and 0-d arrays) as the
    Python number they hold; other types only if a weights_only load accepts them."""
    kind = type(obj)
    if kind.__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        return obj.item()
    if (
        kind is complex
        or isinstance(obj, (torch.dtype, torch.device))
        or _qualname(kind) in _loadable_globals()
    ):
        return obj
    raise _Unsavable(obj)


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _loadable_globals() -> set[str]:
    """Types a weights_only load rebuilds: torch's own list and whatever the user registered as safe."""
    names: set[str] = set()
    try:
        from torch import _weights_only_unpickler

        names.update(_weights_only_unpickler._get_allowed_globals())
    except (ImportError, AttributeError):
        pass
    for entry in getattr(torch.serialization, "get_safe_globals", list)():
        target = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(target, type):
            names.add(_qualname(target))
    return names


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def require_finite(model_state: dict[str, Any], names: Iterable[str], step: int) -> None:
    """Refuse to write weights that are NaN or infinite (an update that overflowed): the checkpoint would
    replace a good one. Only `names` (the parameters) are checked: buffers may hold -inf on purpose (masks)."""
    bad = [
        n
        for n in names
        if isinstance(model_state.get(n), torch.Tensor)
        and model_state[n].is_floating_point()
        and not bool(torch.isfinite(model_state[n]).all())
    ]
    if bad:
        raise NonFinite(
            f"the weights at step {step} are not finite ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): the update before it overflowed. That checkpoint was "
            "not written, and the earlier ones are kept. Fix: a smaller --lr (or --clip-grad), then "
            "run the same command to resume from the last good checkpoint"
        )
