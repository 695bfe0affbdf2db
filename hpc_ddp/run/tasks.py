"""What to train: the `Task` a user provides, the built-in tasks, and `--task module.path:function` loading.

A task is a function `build(config) -> Task`. It runs on every rank with the same config and seed, so every
rank builds the same model and the same dataset; DDP then broadcasts rank 0's weights anyway, and the
DistributedSampler gives each rank its own slice of the data.

    # mytasks.py -- run with: python -m hpc_ddp.submit --local --task mytasks:build
    import torch
    from hpc_ddp import Task

    def build(config):
        x = torch.randn(4096, 32)
        y = x.sum(dim=1, keepdim=True)
        return Task(model=torch.nn.Linear(32, 1),
                    dataset=torch.utils.data.TensorDataset(x, y),
                    loss_fn=torch.nn.functional.mse_loss)

The task's own settings (a width, a depth) come in `config.task_args`, a read-only mapping: `--task-arg
width=64` and a --config file's `[task-args]` table (hpc_ddp.run.taskargs), recorded and checked on resume.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from hpc_ddp import cli
from hpc_ddp.errors import UsageError
from hpc_ddp.run.callbacks import Callback
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.params import Parameters


@dataclass
class Task:
    """What to train. `model` and `dataset` always; then exactly one of `loss_fn` and `step`.

    model         an nn.Module, built the same on every rank (same seed); or a function of no arguments that
                  builds it (a factory, e.g. `model=lambda: GPT(cfg)`): then --strategy fsdp builds it on the
                  meta device and allocates only each rank's shards (no rank holds the whole model), and the
                  kit sets the initial weights itself, the same for a --seed under ddp and fsdp at any number
                  of ranks: each module's reset_parameters(), then init_weights, on a generator keyed by the
                  module's name (hpc_ddp.run.loop.materialize). Inside `step` and `eval_step` you get the *wrapped*
                  model (DDP or FSDP): call it, its forward is the synchronised one.
    init_weights  with a factory: init_weights(module), called for every module that holds parameters or
                  buffers itself, after its reset_parameters() (if any), on a CPU copy of that module's own
                  tensors (its children are on the meta device then): it sets them in place. Needed when a
                  module has tensors of its own and no reset_parameters() (refused at start otherwise).
    dataset       a map-style Dataset (split across ranks by a DistributedSampler, reshuffled each epoch), or an
                  IterableDataset (each rank and worker reads its own part: hpc_ddp.run.data.streams.reader; the epoch
                  ends on every rank after the same step, when some rank's stream ends; one with
                  state_dict()/load_state_dict() resumes mid-epoch exactly, with DataLoader workers through
                  torchdata's StatefulDataLoader; any other restarts its epoch on resume, and says so). Its
                  set_epoch(epoch), if any, is called each epoch.
    loss_fn       loss_fn(output, target) for `(input, target)` batches: output = model(input).
    step          step(model, batch) -> loss, or (loss, {"name": value, ...}): one micro-batch, your own forward.
                  The loss must be a scalar tensor; the extra values are averaged over ranks at each record and
                  shown in the progress line, metrics.jsonl, TensorBoard (train/<name>) and the report.
    optimizer     optimizer(params) -> Optimizer; default SGD(lr=--lr). `params` are the parameters of the model as
                  the kit trains it (after DDP or FSDP wraps it), a list; `params.named()` gives (name,
                  parameter) pairs with the bare model's names, for groups by name (hpc_ddp.run.loop.params says
                  what is safe under fsdp). Your own sets its own rate: --lr
                  reaches it only if your factory reads config.lr (the built-in tasks do). A schedule
                  (--lr-schedule or Task.scheduler) scales the rate the optimizer starts with, whatever set it.
                  A --lr changed on resume is applied (and scales the schedule by new/old) when the optimizer
                  takes it, and refused (exit 2) when it does not: it would not apply.
    scheduler     scheduler(optimizer, total_steps) -> LRScheduler, stepped once per optimizer step that was
                  applied; default --lr-schedule. Its state is in every checkpoint. total_steps is None for a
                  stream without --max-steps (no known end). A ReduceLROnPlateau is stepped after each
                  evaluation with its --plateau-metric value instead.
    collate_fn    for the training and the evaluation loaders (e.g. padding, dict batches).
    eval_dataset  map-style (rank r evaluates samples r, r + world, ...) or an IterableDataset (each rank reads
                  its own part: hpc_ddp.run.data.streams.reader, as for training); evaluated every
                  --eval-every-epochs/--eval-every-steps and at the end, in batches of --eval-batch-size, each
                  sample exactly once over all ranks, in model.eval() under torch.no_grad().
    eval_step     eval_step(model, batch) -> {"name": value}: means over the batch, weighted by its samples (the
                  items the loader collated into it) across ranks; or {"name": (total, weight)}: the mean is
                  sum(total) / sum(weight) over every batch of every rank (e.g. (loss_sum, tokens)). A name no
                  batch reported is missing from that evaluation, never 0.0 (hpc_ddp.run.loop.evaluation). Without
                  it the evaluation reports the loss (`loss_fn` or `step`'s).
    shard         --strategy fsdp: shard(model) -> the modules to shard one by one (default: the modules of
                  the model's nn.ModuleLists).
    callbacks     instances of classes deriving from hpc_ddp.Callback: on_train_start, on_step_end,
                  on_eval_end, on_save, on_train_end, each given a read-only state; one with state_dict() and
                  load_state_dict() is checkpointed per rank; state.request_stop() ends the run as finished
                  (hpc_ddp.run.callbacks, docs/callbacks.md).

    A batch may be any structure of tensors (tuples, lists, dicts, namedtuples, dataclasses, objects with
    .to() such as a BatchEncoding): it goes to the rank's device as a whole. Saved in every checkpoint: the
    model, the optimizer, the scheduler, the data position (and whether an evaluation was cut short by a signal),
    every rank's RNG.
    """

    model: nn.Module | Callable[[], nn.Module]
    dataset: Dataset[Any] | IterableDataset[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Callable[[Parameters], torch.optim.Optimizer] | None = None
    step: Callable[[nn.Module, Any], Any] | None = field(default=None, kw_only=True)
    scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = field(default=None, kw_only=True)
    collate_fn: Callable[[list[Any]], Any] | None = field(default=None, kw_only=True)
    eval_dataset: Dataset[Any] | IterableDataset[Any] | None = field(default=None, kw_only=True)
    eval_step: Callable[[nn.Module, Any], Any] | None = field(default=None, kw_only=True)
    shard: Callable[[nn.Module], Iterable[nn.Module]] | None = field(default=None, kw_only=True)
    init_weights: Callable[[nn.Module], None] | None = field(default=None, kw_only=True)
    callbacks: Sequence[Callback] = field(default=(), kw_only=True)


def _synthetic_regression(samples: int, features: int, outputs: int, seed: int) -> TensorDataset:
    """Inputs and noisy linear targets, the same on every rank (seeded), so the loss can really go down."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    weight = torch.randn(features, outputs, generator=gen)
    y = x @ weight + 0.1 * torch.randn(samples, outputs, generator=gen)
    return TensorDataset(x, y)


def linear(config: TrainConfig) -> Task:
    """The article's example: nn.Linear(10, 1) on 1000 synthetic samples, MSE, SGD."""
    return Task(
        model=nn.Linear(10, 1),
        dataset=_synthetic_regression(1000, 10, 1, config.seed),
        loss_fn=nn.functional.mse_loss,
    )


def mlp(config: TrainConfig) -> Task:
    """About 3.4 M parameters (3,428,368): big enough that the gradient all-reduce is a real part of each
    step."""
    width = 1024
    model = nn.Sequential(
        nn.Linear(256, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 16),
    )
    return Task(
        model=model, dataset=_synthetic_regression(8192, 256, 16, config.seed), loss_fn=nn.functional.mse_loss
    )


def _example(path: str) -> Callable[[TrainConfig], Task]:
    """A built-in task that lives in hpc_ddp.examples (a layer above this one): imported when it is used."""

    def build(config: TrainConfig) -> Task:
        return importlib.import_module(path).build(config)  # type: ignore[no-any-return]

    build.__doc__ = f"the task of {path} (see that module)"
    return build


BUILTINS: dict[str, Callable[[TrainConfig], Task]] = {
    "linear": linear,
    "mlp": mlp,
    "gpt": _example("hpc_ddp.examples.gpt"),
    "cnn": _example("hpc_ddp.examples.cnn"),
}


def resolve(spec: str) -> Callable[[TrainConfig], Task]:
    """The builder named by `--task`: a built-in name or `module.path:function` (raises UsageError)."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise UsageError(
            f"--task {spec!r}: expected a built-in ({', '.join(BUILTINS)}) or module.path:function"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m` puts the cwd first; console scripts don't
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Not found only if what is missing is the task module itself or one of its packages; a module that
        # exists but imports something missing is another mistake (its name merely starting alike is not it).
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UsageError(
                f"--task {spec!r}: module {module_name!r} not found in {os.getcwd()} or PYTHONPATH. "
                "Fix: run from the folder that holds it, or add that folder to PYTHONPATH"
            ) from e
        where = next(
            (
                f"{os.path.basename(frame.filename)} line {frame.lineno}"
                for frame in reversed(traceback.extract_tb(e.__traceback__))
                if not frame.filename.startswith("<")
            ),
            "",
        )
        raise UsageError(
            f"--task {spec!r}: {module_name} was found, but importing it failed: {e}"
            f"{f' ({where})' if where else ''}. Fix: install that module in this environment, or "
            "fix the import"
        ) from e
    builder = getattr(module, func_name, None)
    if not callable(builder):
        meant = cli.nearest(func_name, [n for n in vars(module) if not n.startswith("_")])
        hint = f"; did you mean {meant}?" if meant else ""
        raise UsageError(f"--task {spec!r}: {module_name} has no function {func_name!r}{hint}")
    return builder


def build(config: TrainConfig) -> Task:
    """Resolve and call the task builder, checking that it returned a usable Task."""
    task = resolve(config.task)(config)
    if not isinstance(task, Task):
        raise UsageError(
            f"--task {config.task}: the function returned {type(task).__name__}, expected hpc_ddp.Task"
        )
    if not callable(task.model):  # an nn.Module is callable too
        raise UsageError(
            f"--task {config.task}: Task.model is {type(task.model).__name__}, expected an nn.Module or a "
            "function that builds one"
        )
    check(task, f"--task {config.task}")
    return task


FUNCTIONS = ("loss_fn", "step", "optimizer", "scheduler", "collate_fn", "eval_step", "shard", "init_weights")


def check(task: Task, where: str) -> None:
    """The Task's fields are of the kinds its docstring says (UsageError naming the field, before training)."""
    for name, dataset in (("dataset", task.dataset), ("eval_dataset", task.eval_dataset)):
        if dataset is None and name == "eval_dataset":
            continue
        iterable = isinstance(dataset, IterableDataset)
        if not iterable and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UsageError(
                f"{where}: Task.{name} is {type(dataset).__name__}, expected a map-style Dataset (with __len__ "
                "and __getitem__) or a torch.utils.data.IterableDataset"
            )
    if (task.loss_fn is None) == (task.step is None):
        given = "both" if task.step is not None else "neither"
        raise UsageError(
            f"{where}: Task has {given} of loss_fn and step; give exactly one: loss_fn(output, target) for "
            "(input, target) batches, or step(model, batch) -> loss for anything else"
        )
    if task.eval_step is not None and task.eval_dataset is None:
        raise UsageError(
            f"{where}: Task.eval_step is given but Task.eval_dataset is not: give both, or neither"
        )
    if task.init_weights is not None and isinstance(task.model, nn.Module):
        raise UsageError(
            f"{where}: Task.init_weights is given with a model instance, whose weights are already set: it "
            "would never be called. Fix: give the model as a factory (model=lambda: MyModel(...)), or drop "
            "init_weights"
        )
    for name in FUNCTIONS:
        value = getattr(task, name)
        if value is not None and not callable(value):
            raise UsageError(f"{where}: Task.{name} is {type(value).__name__}, expected a function")
    check_callbacks(task.callbacks, where)


def check_callbacks(callbacks: Any, where: str) -> None:
    """Task.callbacks is a list of Callback instances (UsageError naming the first that is not)."""
    if not isinstance(callbacks, (list, tuple)):
        raise UsageError(
            f"{where}: Task.callbacks is {type(callbacks).__name__}, expected a list of hpc_ddp.Callback "
            "instances, e.g. callbacks=[MyCallback()]"
        )
    for i, callback in enumerate(callbacks):
        if isinstance(callback, Callback):
            continue
        if isinstance(callback, type) and issubclass(callback, Callback):
            found, fix = f"the class {callback.__name__}", f"an instance: {callback.__name__}()"
        else:
            found, fix = type(callback).__name__, "an instance of a class deriving from hpc_ddp.Callback"
        raise UsageError(f"{where}: Task.callbacks[{i}] is {found}, expected {fix}")
