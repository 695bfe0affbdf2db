"""A model given as a factory (`Task(model=build)`): built without memory where that matters, and given the same
initial weights for a --seed whatever the strategy, the number of ranks, or whether it was built on the meta
device.

Under --strategy fsdp the kit calls the factory under `torch.device("meta")` (shapes, no storage), shards it
(`fully_shard`), and allocates this rank's shards only (`to_empty`): no rank ever holds the whole model (the
strategy does that part, run/strategy/fsdp.py). Under ddp the factory is simply called (every rank holds the
whole model anyway). Either way the kit then sets the initial values, `fill`, one module at a time: each module
with parameters or buffers of its own gets a CPU copy of those tensors at full size, set by the module's
`reset_parameters()` and then by `Task.init_weights(module)` if the task gives one, on torch's generator
seeded from (--seed, the module's name); the rank keeps its slice of each (all of it under ddp, and of buffers,
which FSDP does not shard), and the copy is freed before the next module.

Why generators keyed by module name:
- random ops on sharded CPU DTensors draw each rank's shard from that rank's own generator, so the values
  depend on the number of ranks (DTensor's offset-based RNG that makes shards agree with the full tensor is for
  CUDA-like devices only, and differs from a CPU draw anyway);
- one generator for the whole model, drawn module after module, would make each module's values depend on
  everything drawn before it: every rank would have to replay the whole model in one fixed order;
- a seed checkpoint (torchtitan's: one process builds and initializes the whole model and saves it; every run
  loads it) needs one process that holds the whole model, or a checkpoint written and read once more.
With a key per module, a module's values depend on the seed, its name and its shapes only: any rank sets any
module alone, in any order. The cost: every rank draws every module's values (a CPU generator cannot skip
ahead to a slice), once, at start; the memory beyond the shards is one module's tensors. The draws are on CPU
whatever the run's device, so a GPU run starts from the same weights as a CPU run of the same seed.

What is checked at start, as one line each (UsageError): a module with tensors of its own and no
reset_parameters(), in a task without init_weights; an init that leaves one of them unset (each is NaN, or
an integer's minimum, before the init runs). Tied parameters (one Parameter in two modules) stay tied: the
first module that holds one sets it.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpc_ddp.errors import UsageError

Factory = Callable[[], nn.Module]
InitWeights = Callable[[nn.Module], None]


def is_factory(model: Any) -> bool:
    """`Task.model` is a function that builds the model (not the model itself)."""
    return callable(model) and not isinstance(model, nn.Module)


def call(factory: Factory) -> nn.Module:
    """The factory's model (UsageError if it returns anything else)."""
    model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"Task.model is a function that returned {type(model).__name__}: expected an nn.Module. Fix: "
            "return the model from it (model=lambda: MyModel(...))"
        )
    return model


def on_meta(factory: Factory) -> nn.Module:
    """The factory's model with every tensor on the meta device: shapes and dtypes, no storage."""
    with torch.device("meta"):
        return call(factory)


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers `module` holds itself (not its children's)."""
    tensors = {n: p for n, p in module._parameters.items() if p is not None}
    tensors.update((n, b) for n, b in module._buffers.items() if b is not None)
    return tensors


@dataclass
class _Owner:
    """A module with tensors of its own: those it sets (`names`), and those tied to an earlier module's."""

    name: str
    names: list[str] = field(default_factory=list)
    ties: list[tuple[str, str, str]] = field(default_factory=list)  # (own name, owner module, owner's name)


def owners(model: nn.Module) -> list[_Owner]:
    """Every module with tensors of its own, in module order; a tensor held by two modules is set by the first
    (read on a model whose ties are intact: the meta one, before `to_empty` makes fresh tensors)."""
    first: dict[int, tuple[str, str]] = {}
    found = []
    for name, module in model.named_modules(remove_duplicate=False):
        own = _own(module)
        if not own:
            continue
        owner = _Owner(name)
        for tensor_name, tensor in own.items():
            if id(tensor) in first:
                owner.ties.append((tensor_name, *first[id(tensor)]))
            else:
                first[id(tensor)] = (name, tensor_name)
                owner.names.append(tensor_name)
        if owner.names or owner.ties:
            found.append(owner)
    return found


def _describe(name: str, module: nn.Module) -> str:
    return (
        f"its module {name} ({type(module).__name__})"
        if name
        else f"the model itself ({type(module).__name__})"
    )


def check(model: nn.Module, init_weights: InitWeights | None) -> None:
    """UsageError naming the first module whose tensors nothing would set."""
    if init_weights is not None:
        return
    for owner in owners(model):
        module = model.get_submodule(owner.name)
        if owner.names and not callable(getattr(module, "reset_parameters", None)):
            raise UsageError(
                f"Task.model is a factory, and {_describe(owner.name, module)} holds "
                f"{', '.join(owner.names)} but has no reset_parameters(): nothing would set their initial "
                "values. Fix: give that module a reset_parameters(), or give the Task init_weights=fn "
                "(fn(module) sets each module's own tensors)"
            )


def seed_of(seed: int, name: str) -> int:
    """The generator seed of module `name` for --seed `seed`: its values depend on nothing else."""
    digest = hashlib.sha256(f"hpc_ddp/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextmanager
def _keyed(seed: int) -> Iterator[None]:
    """torch's CPU generator on `seed` for the block, then back where it was (the run's stream is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _unset(t: torch.Tensor) -> float | int | None:
    """What a tensor holds before its init: NaN, or an integer type's minimum (None: no such value)."""
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype != torch.bool:
        return int(torch.iinfo(t.dtype).min)
    return None


def initial(
    reference: nn.Module, name: str, seed: int, init_weights: InitWeights | None
) -> dict[str, torch.Tensor]:
    """The initial values of the tensors `reference` (a module on the meta device) holds itself, at full size on
    CPU: set by its reset_parameters(), then init_weights, on the generator of (seed, name). Its children stay
    on the meta device (what an init does to them is nothing), and its own tensors go back to it afterwards."""
    reference.to_empty(device="cpu", recurse=False)
    try:
        own = _own(reference)
        for t in own.values():
            mark = _unset(t)
            if mark is not None:
                t.detach().fill_(mark)
        with _keyed(seed_of(seed, name)), torch.no_grad():
            reset = getattr(reference, "reset_parameters", None)
            if callable(reset):
                reset()
            if init_weights is not None:
                init_weights(reference)
        own = _own(reference)  # an init may have replaced a tensor instead of setting it
        for tensor_name, t in own.items():
            mark = _unset(t)
            if t.is_meta or (mark is not None and bool(_is_unset(t, mark).any())):
                raise UsageError(
                    f"the initial values of {_qualified(name, tensor_name)} in {_describe(name, reference)} were "
                    "not set by its reset_parameters() or Task.init_weights. Fix: set every parameter and "
                    "buffer the module holds itself, in place (e.g. torch.nn.init.normal_(module.weight))"
                )
        return {n: t.detach() for n, t in own.items()}  # to_empty below gives the module new tensors
    finally:
        reference.to_empty(device="meta", recurse=False)


def _is_unset(t: torch.Tensor, mark: float | int) -> torch.Tensor:
    return torch.isnan(t) if isinstance(mark, float) else t == mark


def _qualified(module: str, tensor: str) -> str:
    return f"{module}.{tensor}" if module else tensor


def _put(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` (the full tensor) into `target`: this rank's slice of it when `target` is sharded."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            value.shape, target.device_mesh, target.placements
        )
        for dim, (length, start) in enumerate(zip(shape, offset, strict=True)):
            value = value.narrow(dim, start, length)
        target = target.to_local()
    target.detach().copy_(value)


def fill(model: nn.Module, reference: nn.Module, seed: int, init_weights: InitWeights | None) -> None:
    """Set every tensor of `model` (allocated, possibly sharded) to its initial value, module by module, from
    `reference` (the same model on the meta device, its ties intact); then tie again what `to_empty` untied."""
    plan = owners(reference)
    with torch.no_grad():
        for owner in plan:
            if not owner.names:
                continue
            values = initial(reference.get_submodule(owner.name), owner.name, seed, init_weights)
            target = model.get_submodule(owner.name)
            for tensor_name in owner.names:
                _put(_own(target)[tensor_name], values[tensor_name])
            del values
    for owner in plan:
        module = model.get_submodule(owner.name)
        for tensor_name, held_by, held_as in owner.ties:
            setattr(module, tensor_name, getattr(model.get_submodule(held_by), held_as))


def eager(factory: Factory, seed: int, init_weights: InitWeights | None) -> nn.Module:
    """The model built as the factory builds it (no meta device: ddp holds the whole model anyway), with the
    initial values `fill` gives on every path. The reference is a second build, on the meta device: free."""
    reference = on_meta(factory)
    check(reference, init_weights)
    with torch.random.fork_rng(devices=[]):  # the constructors' draws: the run's stream goes on as under fsdp
        model = call(factory)
    fill(model, reference, seed, init_weights)
    return model


def meta_reference(model: nn.Module) -> nn.Module:
    """A copy of a meta model to draw initial values from once the model itself is sharded (free: no storage)."""
    return copy.deepcopy(model)
