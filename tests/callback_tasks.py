"""User tasks with callbacks (hpc_ddp.Callback), loaded the way a user's are: `--task callback_tasks:NAME`.

Each is slow_tasks' `slow` (dropout, momentum, a sleep a step: SLOW_TASK_SLEEP_S) with callbacks added, and
a small evaluation set where one is needed. Every callback writes what it saw into the run folder, for the tests
(tests/test_run_callbacks.py) to read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import slow_tasks
import torch

from hpc_ddp import Callback, Task


class EMA(Callback):
    """An exponential moving average of the weights, kept in float32 and checkpointed (per rank, like every
    callback's state). Rank 0 writes it to `ema.pt` at the run's end."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] | None = None

    def on_train_start(self, state: Any) -> None:
        if self.shadow is None:  # a resume loaded it already (load_state_dict comes first)
            self.shadow = {k: v.detach().float().clone() for k, v in state.model.state_dict().items()}
        else:  # a checkpoint is read to the CPU: back where the model is
            device = next(state.model.parameters()).device
            self.shadow = {k: v.to(device) for k, v in self.shadow.items()}

    def on_step_end(self, state: Any) -> None:
        assert self.shadow is not None
        with torch.no_grad():
            for k, v in state.model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v.detach().float(), alpha=1 - self.decay)

    def on_train_end(self, state: Any) -> None:
        if state.rank == 0:
            torch.save(self.shadow, state.folder / "ema.pt")

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay, self.shadow = state["decay"], state["shadow"]


class Hooks(Callback):
    """Every hook call of this rank, one JSON line each in hooks-rank<r>.jsonl: its hook, step, epoch and
    metrics, and what the state says the model is."""

    def _log(self, hook: str, state: Any) -> None:
        line = {
            "hook": hook,
            "step": state.step,
            "epoch": state.epoch,
            "metrics": dict(state.metrics),
            "world_size": state.world_size,
            "model": type(state.model).__name__,
            "optimizer": type(state.optimizer).__name__,
        }
        with open(state.folder / f"hooks-rank{state.rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_start(self, state: Any) -> None:
        self._log("on_train_start", state)

    def on_step_end(self, state: Any) -> None:
        self._log("on_step_end", state)

    def on_eval_end(self, state: Any) -> None:
        self._log("on_eval_end", state)

    def on_save(self, state: Any) -> None:
        self._log("on_save", state)

    def on_train_end(self, state: Any) -> None:
        self._log("on_train_end", state)


class StopAt(Callback):
    """Asks the run to stop after step STOP_AT_STEP, on the last rank only: every rank must stop with it."""

    def on_step_end(self, state: Any) -> None:
        if state.step == int(os.environ.get("STOP_AT_STEP", "5")) and state.rank == state.world_size - 1:
            state.request_stop()


class Boom(Callback):
    """Raises on rank 1 at step 3: the user's error, with its traceback."""

    def on_step_end(self, state: Any) -> None:
        if state.rank == 1 and state.step == 3:
            raise ValueError("boom in a callback (tests/callback_tasks.py:Boom)")


def _with(config: Any, *callbacks: Callback, evaluate: bool = False) -> Task:
    task = slow_tasks.slow(config)
    more: dict[str, Any] = {"callbacks": list(callbacks)}
    if evaluate:
        more["eval_dataset"] = slow_tasks._data(config.seed + 1, samples=64)
    return dataclasses.replace(task, **more)


def ema(config: Any) -> Task:
    return _with(config, EMA())


def early_stop(config: Any) -> Task:
    return _with(config, Hooks(), StopAt(), evaluate=True)


def boom(config: Any) -> Task:
    return _with(config, Boom())
