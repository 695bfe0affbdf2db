"""The resume check's defect zoo (issue 42, item 7), for `--task zoo_tasks:NAME` (tests/ on PYTHONPATH): small
tasks, each with ONE thing a resume cannot restore, as a user's task may have it, and exact tasks beside them
(the things a resume must restore, done right). tests/test_resume_zoo.py runs the check on each: "not exact"
with the defect's named cause, or exit 0.

Data: exact_tasks' pairs (8 features, the target their sum), `samples` of them; on 2 ranks in batches of 16,
96 samples make 3 steps an epoch. Models: a linear layer, or two small blocks where a test needs more."""

from __future__ import annotations

import random
import time

import numpy as np
import torch
from exact_tasks import DrawingStream, Normed, _pairs, augmented
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from hpc_ddp import Task
from hpc_ddp.run.data import streams


def _data(config, samples: int = 96) -> TensorDataset:  # type: ignore[no-untyped-def]
    x, y = _pairs(config.seed, samples)
    return TensorDataset(x, y)


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _bare(model: nn.Module) -> nn.Module:
    """The user's module inside DDP's wrapper (fsdp2 wraps in place)."""
    return getattr(model, "module", model)


# ----- defects: each one thing a resume cannot restore ---------------------------------------------------------


def private_generator(config):  # type: ignore[no-untyped-def]
    """Input noise from a torch.Generator made once by the task (not seeded per step, not saved): a resumed
    process draws its noise from the start again."""
    gen = torch.Generator().manual_seed(config.seed)

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x + 0.1 * torch.randn(x.shape, generator=gen)), y)

    return Task(model=nn.Linear(8, 1), dataset=_data(config), step=step)


class Counted(nn.Linear):
    """A Python counter of its forwards, kept on the model (an attribute, not a buffer): it scales the output."""

    def __init__(self, threshold: int = 0) -> None:
        super().__init__(8, 1)
        self.calls, self.threshold = 0, threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.threshold:  # a layer "unfrozen" late: from forward `threshold` on, the output is scaled
            return super().forward(x) * (1.5 if self.calls > self.threshold else 1.0)
        return super().forward(x) * (1.0 + 0.01 * self.calls)


def model_counter(config):  # type: ignore[no-untyped-def]
    return Task(model=Counted(), dataset=_data(config), loss_fn=nn.functional.mse_loss)


class Stateless(IterableDataset):
    """A stream without state_dict(): each reader its every count-th sample, from the start on every __iter__."""

    def __init__(self, seed: int, samples: int) -> None:
        self.x, self.y = _pairs(seed, samples)

    def __iter__(self):  # type: ignore[no-untyped-def]
        index, count = streams.reader()
        for i in range(index, len(self.x), count):
            yield self.x[i], self.y[i]


def stream_without_state(config):  # type: ignore[no-untyped-def]
    return Task(model=nn.Linear(8, 1), dataset=Stateless(config.seed, 96), step=_mse)


def lr_outside_the_kit(config):  # type: ignore[no-untyped-def]
    """A learning rate set by a closure inside `step`, from a Python counter of its calls."""
    calls = [0]
    holder: list[torch.optim.Optimizer] = []

    def optimizer(params):  # type: ignore[no-untyped-def]
        holder.append(torch.optim.SGD(params, lr=0.01))
        return holder[0]

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        for group in holder[0].param_groups:
            group["lr"] = 0.01 / calls[0]
        return _mse(model, batch)

    return Task(model=nn.Linear(8, 1), dataset=_data(config), step=step, optimizer=optimizer)


class DecayingSGD(torch.optim.Optimizer):
    """A hand-written optimizer: SGD whose rate decays with its step count, kept as a Python attribute (outside
    state_dict(): a resumed process counts from 0 again)."""

    def __init__(self, params, lr: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / self.steps**0.5)


def optimizer_attribute(config):  # type: ignore[no-untyped-def]
    return Task(
        model=nn.Linear(8, 1),
        dataset=_data(config),
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda params: DecayingSGD(params, lr=0.05),
    )


class NumpyNoise(Dataset):
    """Augmentation from a NumPy Generator the dataset made (not the global one the kit seeds per worker): each
    DataLoader worker draws from its own copy of it, from its start again whenever workers start."""

    def __init__(self, seed: int, samples: int) -> None:
        self.x, self.y = _pairs(seed, samples)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * float(self.rng.standard_normal()), self.y[i]


def workers_numpy_generator(config):  # type: ignore[no-untyped-def]
    return Task(model=nn.Linear(8, 1), dataset=NumpyNoise(config.seed, 192), step=_mse)


class Permuted(Dataset):
    """The samples in an order drawn once from `seed` (at build, in every process that builds the task)."""

    def __init__(self, config, seed: int) -> None:  # type: ignore[no-untyped-def]
        self.x, self.y = _pairs(config.seed, 96)
        self.order = list(range(len(self.x)))
        random.Random(seed).shuffle(self.order)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[self.order[i]], self.y[self.order[i]]


def clock_order(config):  # type: ignore[no-untyped-def]
    """Its order seeded by the clock."""
    return Task(model=nn.Linear(8, 1), dataset=Permuted(config, time.time_ns()), step=_mse)


def hash_order(config):  # type: ignore[no-untyped-def]
    """Its order seeded by the hash of a str: another in every process unless PYTHONHASHSEED is set (the kit sets
    none)."""
    return Task(model=nn.Linear(8, 1), dataset=Permuted(config, hash("zoo")), step=_mse)


def ema_outside_the_model(config):  # type: ignore[no-untyped-def]
    """An exponential moving average of the weights kept in a closure (not in the model nor the optimizer), the
    model the evaluation scores: a resumed process starts it again from the resumed weights."""
    ema: dict[str, torch.Tensor] = {}

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        for name, p in _bare(model).named_parameters():
            now = p.detach().clone()
            ema[name] = 0.5 * ema[name] + 0.5 * now if name in ema else now
        return _mse(model, batch)

    def eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
        x, y = batch
        bare = _bare(model)
        weight, bias = ema.get("weight", bare.weight), ema.get("bias", bare.bias)
        return {"ema_mse": nn.functional.mse_loss(nn.functional.linear(x, weight, bias), y)}

    return Task(
        model=nn.Linear(8, 1),
        dataset=_data(config),
        step=step,
        eval_dataset=_data(config, 32),
        eval_step=eval_step,
    )


def step_extra(config):  # type: ignore[no-untyped-def]
    """`step` returns a running mean of its losses, kept in a closure, beside the loss (an extra value): a
    resumed process starts the mean again; nothing else differs."""
    seen: list[float] = []

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = _mse(model, batch)
        seen.append(float(loss.detach()))
        return loss, {"running_loss": sum(seen) / len(seen)}

    return Task(model=nn.Linear(8, 1), dataset=_data(config), step=step)


class EpochShuffled(Dataset):
    """Its own order each epoch, drawn in set_epoch from a generator made once (not seeded by the epoch): the
    order of epoch e depends on how many set_epochs this process made. 1024 samples: 64 steps an epoch on 2
    ranks in batches of 8, past the 40 steps the check used to stop at."""

    def __init__(self, seed: int, samples: int = 1024) -> None:
        self.x, self.y = _pairs(seed, samples)
        self.gen = torch.Generator().manual_seed(seed)
        self.order = torch.arange(samples)

    def set_epoch(self, epoch: int) -> None:
        self.order = torch.randperm(len(self.x), generator=self.gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = int(self.order[i])
        return self.x[j], self.y[j]


def set_epoch_private_generator(config):  # type: ignore[no-untyped-def]
    return Task(model=nn.Linear(8, 1), dataset=EpochShuffled(config.seed), step=_mse)


def late_counter_threshold(config):  # type: ignore[no-untyped-def]
    """A layer unfrozen by a Python counter at forward 60: an 80-step run (640 samples, batches of 8, 2 ranks,
    2 epochs) crosses it after the 40 steps the check used to stop at."""
    return Task(model=Counted(threshold=60), dataset=_data(config, 640), loss_fn=nn.functional.mse_loss)


# ----- exact: what a resume must restore, done right -------------------------------------------------------------


def dropout(config):  # type: ignore[no-untyped-def]
    """Dropout draws from torch's global generator, which every checkpoint holds."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    return Task(model=model, dataset=_data(config), loss_fn=nn.functional.mse_loss)


def global_rngs_in_workers(config):  # type: ignore[no-untyped-def]
    """Augmentation from torch's, Python's and NumPy's global generators in DataLoader workers (--num-workers 2),
    which the kit seeds per worker and sample position; an evaluation that draws."""
    return augmented(config)


class ResumableStream(DrawingStream):
    """exact_tasks' stream that draws in __iter__, whose state_dict() gives the position it was loaded with
    until it reads again. (DrawingStream's gives 0 then: a run stopped in its last step resumes with nothing
    left to read, and its final checkpoint holds position 0, which the check rightly calls a difference.)"""

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.next = state["next"]


def stream_with_state(config):  # type: ignore[no-untyped-def]
    """A stream with state_dict()/load_state_dict() that draws in __iter__."""
    return Task(model=nn.Linear(8, 1), dataset=ResumableStream(config.seed, 96), step=_mse)


def batchnorm(config):  # type: ignore[no-untyped-def]
    """BatchNorm through `loss_fn` (its running statistics are buffers): under ddp and fsdp."""
    return Task(model=Normed(), dataset=_data(config), loss_fn=nn.functional.mse_loss)


def fsdp_factory(config):  # type: ignore[no-untyped-def]
    """The model as a factory (fsdp builds it on the meta device and the kit sets its weights), with an
    evaluation for --keep-best."""
    return Task(
        model=Normed, dataset=_data(config), loss_fn=nn.functional.mse_loss, eval_dataset=_data(config, 32)
    )
