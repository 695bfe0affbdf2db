"""The user's hooks into the loop: `Callback` (what a user derives from), `State` (what a hook is given) and
`Callbacks` (the loop's side: which hooks there are, their calls, their checkpointed state). No torch here.

    class EMA(hpc_ddp.Callback):
        def on_step_end(self, state): ...
    Task(..., callbacks=[EMA()])

Hooks, each called on every rank with one read-only `State` (the user's guide: docs/callbacks.md):

    on_train_start  every start of training, a resume's too, after the checkpoint is loaded (state.step is where
                    training starts) and before the first step; never on a rerun of a finished run
    on_step_end     after each optimizer step is counted: state.metrics is the step's loss and Task.step's
                    extras, averaged over ranks (what the "step" record holds)
    on_eval_end     after each evaluation: state.metrics is its means over every rank's samples
    on_save         after each checkpoint is taken (its snapshot; the write may still be in flight)
    on_train_end    once the run has finished (its final save done, before model.pth): never at a preemption's
                    stop (the run goes on in the next attempt), nor after an error

Cost: the loop asks each hook only of the callbacks whose class defines it, and builds a State only then; a task
without callbacks does no work for them at all (tests/test_run_hot_path.py).

Checkpointed state: a callback with `state_dict()` and `load_state_dict(state)` is saved in every checkpoint
and restored on resume (before on_train_start), PER RANK: every rank's own state is saved and each rank loads
its own, like the RNG (hpc_ddp.run.checkpoint.parts.CallbacksPart). What it returns must load under weights_only: tensors,
numbers, strings, lists, dicts (checked at start and after on_train_start: a usage error, not a lost save).

Stopping: `state.request_stop()` from any hook; the request rides in the next step's all-reduce (one more
number in the packet, hpc_ddp.run.loop.agreed), so every rank learns it at the same step. That step's update is not
applied and it is not counted: the run ends as finished at the step the request was made after (its final
evaluation if one is due, the final save, model.pth, exit 0), never as a preemption; a rerun finds it finished.

Errors: a hook's exception is the user's error, raised as it is (its traceback runs through the hook), with a
note naming the callback, the hook, the step and the rank: the supervisor records it as that rank's error in
the code, never a node's fault (hpc_ddp.ledger.judge).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HOOKS = ("on_train_start", "on_step_end", "on_eval_end", "on_save", "on_train_end")


class Callback:
    """Derive from this and define any of the hooks (each takes one read-only `State`); a hook not defined costs
    nothing. Define `state_dict()` and `load_state_dict(state)` to be checkpointed PER RANK: every rank's own
    state is saved and each rank loads its own back on resume (before on_train_start). `state.request_stop()`
    ends the run as finished at an agreed step (see hpc_ddp.run.callbacks)."""

    def on_train_start(self, state: State) -> None:
        """Every start of training (a resume's too, after its checkpoint is loaded), before the first step."""

    def on_step_end(self, state: State) -> None:
        """After each optimizer step is counted: state.metrics holds its loss and extras, averaged over ranks."""

    def on_eval_end(self, state: State) -> None:
        """After each evaluation: state.metrics holds its means over every rank's samples."""

    def on_save(self, state: State) -> None:
        """After each checkpoint is taken (the write may still be in flight)."""

    def on_train_end(self, state: State) -> None:
        """Once the run has finished, after its final save (never at a preemption's stop)."""


@dataclass(frozen=True)
class State:
    """What a hook is given: read-only (its fields cannot be set; `metrics` is a read-only mapping).

    step, epoch   where training is (optimizer steps done; the epoch in progress)
    rank, world_size
    model         the model as the task built it (the strategy's `model`, never DDP's wrapper); under
                  --strategy fsdp its parameters are DTensors, each rank holding its shards
    optimizer     the optimizer the kit steps
    metrics       the step's (loss, Task.step's extras) or the evaluation's means; empty in the other hooks
    folder        the run folder
    """

    step: int
    epoch: int
    rank: int
    world_size: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    metrics: Mapping[str, float]
    folder: Path
    _stop: Callable[[], None] = field(repr=False, compare=False)

    def request_stop(self) -> None:
        """Ask the run to end, as finished, at an agreed step: any rank's request stops every rank after the same
        step (the one this hook is about; see hpc_ddp.run.callbacks)."""
        self._stop()


_EMPTY: Mapping[str, float] = MappingProxyType({})
WHAT = "the callbacks' state_dict()"  # how a checkpoint's errors name their state


def name_of(callback: object, index: int) -> str:
    """A callback's key in a checkpoint: its place in Task.callbacks and its class (a changed list is seen)."""
    return f"{index}.{type(callback).__name__}"


def stateful(callback: object) -> bool:
    return callable(getattr(callback, "state_dict", None)) and callable(
        getattr(callback, "load_state_dict", None)
    )


class Callbacks:
    """The task's callbacks, as the loop calls them. `model`, `optimizer`: the user's (unwrapped); `env`: this
    rank's place (its rank and world_size); `folder`: the run folder. `halt` is this rank's stop vote for the
    next step's packet (0.0 or 1.0)."""

    def __init__(
        self, callbacks: Sequence[Callback], model: Any, optimizer: Any, env: Any, folder: Path
    ) -> None:
        self.all = list(callbacks)
        self.model, self.optimizer, self.folder = model, optimizer, folder
        self.rank, self.world_size = int(env.rank), int(env.world_size)
        self.halt = 0.0
        # Per hook, the callbacks whose class defines it: the loop tests this list (empty: no work at all).
        self.hooks: dict[str, list[Callback]] = {
            hook: [cb for cb in self.all if getattr(type(cb), hook, None) is not getattr(Callback, hook)]
            for hook in HOOKS
        }
        self.on_step = bool(self.hooks["on_step_end"])
        self.stateful = [(name_of(cb, i), cb) for i, cb in enumerate(self.all) if stateful(cb)]

    def _request_stop(self) -> None:
        self.halt = 1.0

    def step_end(self, step: int, epoch: int, loss: float, extras: Mapping[str, float]) -> None:
        """The step is counted: on_step_end with its metrics (the step record's loss and extras). The loop calls
        this every step: without a callback that defines the hook it does nothing, not even build the metrics."""
        if self.on_step:
            self.call("on_step_end", step, epoch, {"loss": loss, **extras})

    def start(self, step: int, epoch: int) -> None:
        """Training starts (a resume's too, its checkpoint loaded): on_train_start, then the callbacks' state
        checked as every part's was before it (what they hold may be made only now): a state that a weights_only
        load would refuse is a usage error now, not a checkpoint that never loads."""
        self.call("on_train_start", step, epoch)
        if self.stateful:
            from hpc_ddp.run.checkpoint import content  # torch: only once there is a state to check

            content.check_savable(self.state_dict(), WHAT)

    def call(self, hook: str, step: int, epoch: int, metrics: Mapping[str, float] | None = None) -> None:
        """Call `hook` of every callback that defines it, in Task.callbacks' order, with one State."""
        chosen = self.hooks[hook]
        if not chosen:
            return
        state = State(
            step,
            epoch,
            self.rank,
            self.world_size,
            self.model,
            self.optimizer,
            MappingProxyType(dict(metrics)) if metrics else _EMPTY,
            self.folder,
            self._request_stop,
        )
        for callback in chosen:
            try:
                getattr(callback, hook)(state)
            except Exception as e:
                add_note = getattr(e, "add_note", None)  # Python 3.11+: shown under the traceback
                if add_note is not None:
                    add_note(
                        f"raised by the callback {type(callback).__name__}.{hook} (Task.callbacks) at step "
                        f"{step} on rank {self.rank}"
                    )
                raise

    # ----- checkpointed state (hpc_ddp.run.checkpoint.parts.CallbacksPart) -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state of every callback that has one, by its key (name_of)."""
        return {key: cb.state_dict() for key, cb in self.stateful}  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any] | None) -> list[str]:
        """Give each stateful callback its saved state; a callback with none saved (a new one, a new rank after
        a resize, a checkpoint written without it) starts fresh, and the notes returned say so."""
        missing = []
        for key, cb in self.stateful:
            if state is not None and key in state:
                cb.load_state_dict(state[key])  # type: ignore[attr-defined]
            else:
                missing.append(key)
        if not missing:
            return []
        return [
            f"the checkpoint holds no state of the callback(s) {', '.join(missing)} on rank {self.rank} (a new "
            "callback, a new rank, or one written without it): they start fresh"
        ]
