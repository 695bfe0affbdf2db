"""The resume check's probe: the user's task, wrapped, inside every rank of the check's runs.

`python -m hpc_ddp.doctor resume` runs `--task hpc_ddp.doctor.probe:build`; the probe builds the user's task (its
spec, the trace folder and the stop points come in $HPC_DDP_RESUME_PROBE, JSON) and wraps the functions the loop
calls, changing nothing they compute:

- before every micro-batch of training (Task.step, or the model's forward for a loss_fn task) it records the
  batch's fingerprint and the fingerprint of every random-number generator (torch's CPU and CUDA ones, Python's
  `random`, NumPy's global one); at a step's first micro-batch also those of every parameter, buffer and
  optimizer state (the state the previous step left, or the resume restored);
- before every evaluation batch (Task.eval_step, or the step/forward the evaluation calls), the batch's and the
  generators' fingerprints.

Each rank appends one JSON line per record to `<trace>/rank<N>.jsonl`, tagged with the attempt (the launcher's
restart count) and the position: ("train", step, micro-batch) or ("eval", step, batch). The loop says which step
it is at through its beacon (hpc_ddp.run.beacon.current).

A stop point is (attempt, kind, step, index): when the run reaches it in that attempt, every rank sends itself
SIGUSR2, the signal a Slurm preemption sends (`--signal=USR2@...`), before the user's code runs: the kit's own
handler notes it and the ranks stop at the next agreed point, save and exit 75, and the local launcher starts
them again (attempt + 1). A point in attempt k fires only in attempt k, so a point the resume passes again (an
evaluation that reruns) stops the run once. A "save" point also records whether a checkpoint write was in flight
when the signal went (the check delays writes for that: hpc_ddp.run.checkpoint.writer.DELAY_VAR).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpc_ddp.cluster.env import SLURM_RESTART_VAR
from hpc_ddp.errors import UsageError
from hpc_ddp.run import beacon as phase
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.tasks import Task
from hpc_ddp.variables import RESUME_PROBE

PROBE_TASK = "hpc_ddp.doctor.probe:build"  # the --task of the check's runs
WRITER_THREAD = "hpc_ddp-ckpt-writer"  # hpc_ddp.run.checkpoint.writer's thread: a write in flight
EVALUATING = (phase.EVALUATION, phase.EVAL_ALLREDUCE)


def fingerprint(tensor: torch.Tensor) -> str:
    """16 hex digits of the SHA-256 of a tensor's bytes, dtype and shape (a DTensor: this rank's shard)."""
    local = getattr(tensor, "to_local", None)
    # A copy: numpy() on the tensor itself would pin its storage, which fsdp frees (resizes) after backward.
    t = (local() if callable(local) else tensor).detach().to("cpu", copy=True).contiguous()
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint_of(value: Any) -> str:
    """The fingerprint of any batch: its structure and every leaf (tensors by their bytes)."""
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(value)
    digest = hashlib.sha256(str(spec).encode())
    for leaf in leaves:
        digest.update((fingerprint(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf)).encode())
    return digest.hexdigest()[:16]


def rng_fingerprints() -> dict[str, str]:
    """Every generator a step may draw from, by name: what a checkpoint must restore."""
    import numpy as np

    found = {
        "torch": fingerprint(torch.get_rng_state()),
        "python": hashlib.sha256(repr(random.getstate()).encode()).hexdigest()[:16],
    }
    state = np.random.get_state()
    found["numpy"] = hashlib.sha256(
        repr(state[0]).encode() + state[1].tobytes() + repr(state[2:]).encode()
    ).hexdigest()[:16]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            found[f"cuda:{i}"] = fingerprint(s)
    return found


def _named(items: Iterable[tuple[str, Any]]) -> dict[str, str]:
    return {name: fingerprint(t) for name, t in items if isinstance(t, torch.Tensor)}


def optimizer_fingerprints(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Each optimizer state tensor (`<param index>.<name>`) and the groups' settings (learning rates...)."""
    state = optimizer.state_dict()
    found: dict[str, str] = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            key = f"{index}.{name}"
            found[key] = (
                fingerprint(value)
                if isinstance(value, torch.Tensor)
                else hashlib.sha256(repr(value).encode()).hexdigest()[:16]
            )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    found["param_groups"] = hashlib.sha256(json.dumps(groups, default=repr).encode()).hexdigest()[:16]
    return found


@dataclasses.dataclass(frozen=True)
class Stop:
    """Where the probe stops the run: in `attempt`, at ("train", step, micro-batch) or ("eval", step, batch)."""

    attempt: int
    kind: str
    step: int
    index: int
    what: str = ""  # what the point is for (the check's words: "within gradient accumulation", ...)
    save: bool = False  # a save in flight is meant: record whether a write was in flight

    def key(self) -> tuple[str, int, int]:
        return self.kind, self.step, self.index


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the check tells its probe ($HPC_DDP_RESUME_PROBE)."""

    task: str  # the user's --task
    trace: str  # the folder of the per-rank traces
    stops: tuple[Stop, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        return cls(raw["task"], raw["trace"], tuple(Stop(**s) for s in raw.get("stops", ())))


class Probe:
    """One rank's recorder: `before(kind, batch, model_state)` at every batch, with the stop points."""

    def __init__(self, plan: Plan, rank: int, attempt: int) -> None:
        self.plan, self.attempt = plan, attempt
        self.optimizers: list[torch.optim.Optimizer] = []
        # The trained parameters as the optimizer got them (names and all): under fsdp their shards, whatever
        # the module holds at the moment (fsdp leaves the root's parameters gathered after a forward).
        self.params: list[tuple[str, Any]] = []
        self.stops = {s.key(): s for s in plan.stops if s.attempt == attempt}
        Path(plan.trace).mkdir(parents=True, exist_ok=True)
        self.out = open(Path(plan.trace) / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 (the process's)
        self.where: tuple[str, int] = ("", -1)
        self.index = 0
        self.awaiting: dict[str, Any] | None = None  # a record whose buffers its forward's hook reads
        self.watched: set[int] = set()

    def position(self) -> tuple[str, int, int]:
        """("train" or "eval", step, index of this batch within it), from the loop's beacon."""
        beacon = phase.current()
        current, step = (beacon.state[0], beacon.state[1]) if beacon is not None else ("", 0)
        kind = "eval" if current in EVALUATING else "train"
        if (kind, step) != self.where:
            self.where, self.index = (kind, step), 0
        else:
            self.index += 1
        return kind, step, self.index

    def before(self, batch: Any, model: nn.Module, forwarding: bool = True) -> dict[str, Any]:
        """A batch is about to be used by `model` (the user's module): its record (written by `write`), after
        stopping here if planned. The buffers a step starts from are read once its forward begins
        (`forwarding`, else by `buffers_at_forward`): DDP broadcasts rank 0's into every rank right before, so a
        rank's own copy before that is none of the step's inputs."""
        kind, step, index = self.position()
        stop = self.stops.get((kind, step, index))
        record: dict[str, Any] = {"a": self.attempt, "k": kind, "s": step, "i": index}
        if stop is not None:
            in_flight = any(t.name == WRITER_THREAD and t.is_alive() for t in threading.enumerate())
            self._write({**record, "stop": stop.what, **({"in_flight": in_flight} if stop.save else {})})
            os.kill(os.getpid(), signal.SIGUSR2)  # a real preemption signal, handled by the kit
        record["rng"] = rng_fingerprints()
        if kind == "train" and index == 0:
            record["params"] = _named(self.params or model.named_parameters())
            record["buffers"] = _named(model.named_buffers()) if forwarding else None
            record["optimizer"] = {
                k: v for o in self.optimizers for k, v in optimizer_fingerprints(o).items()
            }
        record["data"] = fingerprint_of(batch)
        return record

    def buffers_at_forward(self, model: nn.Module, record: dict[str, Any]) -> None:
        """Read `record`'s buffers at `model`'s next forward (a hook, once per module), or when it is written."""
        self.awaiting = record
        if id(model) not in self.watched:
            self.watched.add(id(model))

            def hook(module: nn.Module, _args: Any) -> None:
                awaiting, self.awaiting = self.awaiting, None
                if awaiting is not None and awaiting.get("buffers", 0) is None:
                    awaiting["buffers"] = _named(module.named_buffers())

            model.register_forward_pre_hook(hook)

    def write(self, record: dict[str, Any], model: nn.Module | None = None) -> None:
        self.awaiting = None
        if record.get("buffers", 0) is None and model is not None:  # no forward came
            record["buffers"] = _named(model.named_buffers())
        self._write(record)

    def _write(self, record: Mapping[str, Any]) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")


def plan_from_environ(environ: Mapping[str, str] = os.environ) -> Plan:
    text = environ.get(RESUME_PROBE)
    if not text:
        raise UsageError(
            "--task hpc_ddp.doctor.probe:build is the resume check's own task: run "
            "python -m hpc_ddp.doctor resume --task <your task> instead"
        )
    return Plan.from_json(text)


def build(config: TrainConfig) -> Task:
    """The user's task, wrapped (see the module docstring)."""
    plan = plan_from_environ()
    inner = tasks.build(dataclasses.replace(config, task=plan.task))
    probe = Probe(plan, int(os.environ.get("RANK", "0")), int(os.environ.get(SLURM_RESTART_VAR) or 0))
    made = inner.optimizer or (lambda params: torch.optim.SGD(params, lr=config.lr))

    def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        named = getattr(params, "named", None)  # hpc_ddp.run.params.Parameters
        if callable(named):
            probe.params = list(named())
        built = made(params)
        probe.optimizers.append(built)
        return built

    wrapped = dataclasses.replace(inner, optimizer=optimizer)
    if inner.step is not None:
        wrapped.step = _recorded(probe, inner.step)
    else:
        _record_forwards(probe, wrapped)
    if inner.eval_step is not None:
        wrapped.eval_step = _recorded(probe, inner.eval_step)
    return wrapped


def _recorded(probe: Probe, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`fn(model, batch)` (Task.step, Task.eval_step), recorded before it runs."""

    from torch.nn.parallel import DistributedDataParallel

    def recorded(model: Any, batch: Any) -> Any:
        # The wrapped model: DDP's module is the user's (fsdp shards the user's module in place).
        user = model.module if isinstance(model, DistributedDataParallel) else model
        record = probe.before(batch, user, forwarding=False)
        probe.buffers_at_forward(user, record)
        try:
            return fn(model, batch)
        finally:
            probe.write(record, user)

    return recorded


def _record_forwards(probe: Probe, task: Task) -> None:
    """A loss_fn task: the model's input is seen by a forward pre-hook (before the forward draws anything), its
    target by loss_fn; the record is written once both are known."""
    from hpc_ddp.run import materialize

    pending: list[dict[str, Any]] = []

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        pending[:] = [probe.before((args, kwargs), module)]

    model = task.model
    if materialize.is_factory(
        model
    ):  # the kit builds it later (on the meta device under fsdp): hook each build

        def factory() -> nn.Module:
            built = model()
            if isinstance(built, nn.Module):
                built.register_forward_pre_hook(hook, with_kwargs=True)
            return built

        task.model = factory  # type: ignore[assignment]
    else:
        model.register_forward_pre_hook(hook, with_kwargs=True)
    loss_fn = task.loss_fn
    assert loss_fn is not None

    def recorded_loss(output: Any, target: Any) -> Any:
        if pending:
            record = pending.pop()
            record["data"] = hashlib.sha256((record["data"] + fingerprint_of(target)).encode()).hexdigest()[
                :16
            ]
            probe.write(record)
        return loss_fn(output, target)

    task.loss_fn = recorded_loss
