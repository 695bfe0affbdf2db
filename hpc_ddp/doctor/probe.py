"""The resume check's probe: the user's task, wrapped, inside every rank of the check's runs.

`python -m hpc_ddp.doctor resume` runs `--task hpc_ddp.doctor.probe:build`; the probe builds the user's task (its
spec, the trace folder and the stop points come in $HPC_DDP_RESUME_PROBE, JSON) and wraps the functions the loop
calls, changing nothing they compute:

- before every micro-batch of training (Task.step, or the model's forward for a loss_fn task) it records the
  batch's fingerprint and the fingerprint of every random-number generator (torch's CPU and CUDA ones, Python's
  `random`, NumPy's global one); at a step's first micro-batch also those of the optimizer (its param_groups'
  settings, its plain Python attributes, its state: `optimizer_fingerprints`), every parameter and every buffer
  (the state the previous step left, or the resume restored; the buffers as the model's forward begins, after
  the kit's own hooks broadcast them: `Probe.watch`);
- before every evaluation batch (Task.eval_step, or the step/forward the evaluation calls), the batch's and the
  generators' fingerprints.

Each rank appends one JSON line per record to `<trace>/rank<N>.jsonl`, tagged with the attempt (the launcher's
restart count) and the position: ("train", step, micro-batch) or ("eval", step, batch). The loop says which step
it is at through its beacon (hpc_ddp.run.watch.beacon.current).

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
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.tasks import Task
from hpc_ddp.run.watch import beacon as phase
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


# What torch itself keeps on an optimizer (its hooks, flags it sets at the first step or an LR scheduler's patch):
# never the user's state, and some change at the first step of every process (a resume's too).
TORCH_ATTRIBUTES = frozenset(
    {
        "state",
        "param_groups",
        "defaults",
        "_zero_grad_profile_name",
        "_warned_capturable_if_run_uncaptured",
        "_opt_called",
        "_need_device_dtype_check_for_fused",
        "_step_supports_amp_scaling",
    }
)


def _plain(value: Any) -> str:
    """A setting or attribute as the check shows it: its repr (exact for floats), a tensor by its bytes."""
    if isinstance(value, torch.Tensor):
        return fingerprint(value)
    text = repr(value)
    return text if len(text) <= 64 else hashlib.sha256(text.encode()).hexdigest()[:16]


def optimizer_fingerprints(optimizer: torch.optim.Optimizer, prefix: str = "") -> dict[str, dict[str, str]]:
    """The optimizer, in the order the check compares it (a difference in the first explains the others):
    "groups", each param_group's settings but its parameters (`group 0's lr`: learning rate, momentum, betas,
    a step count kept there...); "attributes", the plain values (int, float, bool, str) of its `__dict__` outside
    state_dict and torch's own (`attribute steps`: a hand-written optimizer's counter, which a checkpoint
    loses); "state", each state tensor (`<param index>.<name>`)."""
    state = optimizer.state_dict()
    groups = {
        f"{prefix}group {g}'s {name}": _plain(value)
        for g, group in enumerate(state["param_groups"])
        for name, value in group.items()
        if name != "params"
    }
    attributes = {
        f"{prefix}attribute {name}": _plain(value)
        for name, value in vars(optimizer).items()
        if name not in TORCH_ATTRIBUTES
        and not name.startswith("_optimizer_")
        and type(value) in (int, float, bool, str)
    }
    found: dict[str, str] = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            found[f"{prefix}{index}.{name}"] = (
                fingerprint(value)
                if isinstance(value, torch.Tensor)
                else hashlib.sha256(repr(value).encode()).hexdigest()[:16]
            )
    return {"groups": groups, "attributes": attributes, "state": found}


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
            # The optimizer first: a difference there (an lr set in step) explains one in the parameters.
            parts: dict[str, dict[str, str]] = {"groups": {}, "attributes": {}, "state": {}}
            for j, o in enumerate(self.optimizers):
                for part, found in optimizer_fingerprints(o, f"optimizer {j}'s " if j else "").items():
                    parts[part].update(found)
            record["opt_groups"], record["opt_attributes"] = parts["groups"], parts["attributes"]
            record["optimizer"] = parts["state"]
            record["params"] = _named(self.params or model.named_parameters())
            record["buffers"] = _named(model.named_buffers()) if forwarding else None
        record["data"] = fingerprint_of(batch)
        return record

    def buffers_at_forward(self, model: nn.Module, record: dict[str, Any]) -> None:
        """Read `record`'s buffers when `model`'s own forward begins (`watch`), or when it is written."""
        self.awaiting = record
        self.watch(model)

    def watch(self, model: nn.Module) -> None:
        """Wrap `model.forward` (once): the buffers a step starts from are read there, after every forward
        pre-hook, the kit's included (DDP and fsdp broadcast rank 0's buffers into every rank right before, by
        a hook fsdp's strategy registers after the probe's), so that what is read is what the step uses.
        `_call_impl` looks `forward` up before running the hooks: a task's model is watched before its first
        forward."""
        if id(model) in self.watched:
            return
        self.watched.add(id(model))
        inner = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            awaiting, self.awaiting = self.awaiting, None
            if awaiting is not None and awaiting.get("buffers", 0) is None:
                awaiting["buffers"] = _named(model.named_buffers())
            return inner(*args, **kwargs)

        model.forward = forward  # type: ignore[method-assign]

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
        named = getattr(params, "named", None)  # hpc_ddp.run.loop.params.Parameters
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
    from hpc_ddp.run.loop import materialize

    pending: list[tuple[dict[str, Any], nn.Module]] = []

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        # Data, generators and the stop here (before the forward draws anything); the buffers at the forward
        # itself, after the kit's hooks (`Probe.watch`).
        record = probe.before((args, kwargs), module, forwarding=False)
        probe.buffers_at_forward(module, record)
        pending[:] = [(record, module)]

    model = task.model
    if materialize.is_factory(
        model
    ):  # the kit builds it later (on the meta device under fsdp): hook each build

        def factory() -> nn.Module:
            built = model()
            if isinstance(built, nn.Module):
                built.register_forward_pre_hook(hook, with_kwargs=True)
                probe.watch(built)
            return built

        task.model = factory  # type: ignore[assignment]
    else:
        model.register_forward_pre_hook(hook, with_kwargs=True)
        probe.watch(model)
    loss_fn = task.loss_fn
    assert loss_fn is not None

    def recorded_loss(output: Any, target: Any) -> Any:
        if pending:
            record, module = pending.pop()
            record["data"] = hashlib.sha256((record["data"] + fingerprint_of(target)).encode()).hexdigest()[
                :16
            ]
            probe.write(record, module)
        return loss_fn(output, target)

    task.loss_fn = recorded_loss
