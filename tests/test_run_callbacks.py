"""Task.callbacks (issue 46): the read-only state, which hooks are called and in which order, the checkpoint part
that keeps a callback's state per rank, a stop request agreed by every rank; and in real 2-rank runs, an EMA of
the weights preempted twice and resumed bitwise, an early stop on one rank that ends every rank at one step, a
callback's exception recorded as the user's error on its rank (no node blamed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import local_checkpoints
from test_launch_local import finish, start
from test_run_models import preempted_twice

from hpc_ddp import Callback, exitcodes
from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.errors import CheckpointError, UsageError
from hpc_ddp.ledger import attempts
from hpc_ddp.log import RankLog
from hpc_ddp.run import callbacks as cbs
from hpc_ddp.run import tasks
from hpc_ddp.run.checkpoint import content, full, store
from hpc_ddp.run.checkpoint.part import PER_RANK, Loading
from hpc_ddp.run.checkpoint.parts import CallbacksPart
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop.trainer import Trainer


class Recorder(Callback):
    """Every hook call: (hook, step, metrics' names); asks to stop after `stop_at` (0: never)."""

    def __init__(self, calls: list[tuple[str, int, tuple[str, ...]]], stop_at: int = 0) -> None:
        self.calls, self.stop_at, self.seen = calls, stop_at, 0

    def _add(self, hook: str, state: cbs.State) -> None:
        self.calls.append((hook, state.step, tuple(sorted(state.metrics))))

    def on_train_start(self, state: cbs.State) -> None:
        self._add("on_train_start", state)

    def on_step_end(self, state: cbs.State) -> None:
        self._add("on_step_end", state)
        self.seen += 1
        if state.step == self.stop_at:
            state.request_stop()

    def on_eval_end(self, state: cbs.State) -> None:
        self._add("on_eval_end", state)

    def on_save(self, state: cbs.State) -> None:
        self._add("on_save", state)

    def on_train_end(self, state: cbs.State) -> None:
        self._add("on_train_end", state)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "t": torch.tensor([float(self.seen)])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


class OnlySteps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, state: cbs.State) -> None:
        self.steps.append(state.step)


def callbacks_of(*callbacks: Callback, rank: int = 0) -> cbs.Callbacks:
    return cbs.Callbacks(
        list(callbacks), "model", "optimizer", SimpleNamespace(rank=rank, world_size=2), Path("/run")
    )


# ----- unit: the state, the hooks, the part ----------------------------------------------------------------------
def test_the_state_is_read_only_and_a_stop_request_is_this_ranks_vote() -> None:
    seen: list[cbs.State] = []

    class Keep(Callback):
        def on_step_end(self, state: cbs.State) -> None:
            seen.append(state)

    group = callbacks_of(Keep(), rank=1)
    metrics = {"loss": 0.5, "mae": 0.25}
    group.call("on_step_end", 7, 2, metrics)
    state = seen[0]
    assert (state.step, state.epoch, state.rank, state.world_size) == (7, 2, 1, 2)
    assert (state.model, state.optimizer, state.folder) == ("model", "optimizer", Path("/run"))
    assert dict(state.metrics) == metrics
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        state.metrics["loss"] = 0.0  # type: ignore[index]
    metrics["loss"] = 9.0  # the caller's dict changing later does not change what the hook saw
    assert state.metrics["loss"] == 0.5
    assert group.halt == 0.0
    state.request_stop()
    assert group.halt == 1.0


def test_only_the_hooks_a_class_defines_are_called_in_the_tasks_order_and_none_costs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    steps = OnlySteps()
    group = callbacks_of(Recorder(calls), steps)
    assert group.hooks["on_step_end"] == group.all and group.hooks["on_save"] == [group.all[0]]
    assert group.on_step and [key for key, _ in group.stateful] == ["0.Recorder"]
    group.call("on_step_end", 1, 0, {"loss": 1.0})
    group.call("on_save", 1, 0)
    assert calls == [("on_step_end", 1, ("loss",)), ("on_save", 1, ())] and steps.steps == [1]
    # No callback defines the hook: no State is built (the loop's hot path tests `on_step` first).
    monkeypatch.setattr(cbs, "State", None)
    callbacks_of(steps).call("on_eval_end", 1, 0, {"loss": 1.0})
    empty = callbacks_of()
    assert not empty.on_step and not empty.stateful and not any(empty.hooks.values())
    empty.call("on_step_end", 1, 0, {"loss": 1.0})


def test_a_callbacks_exception_is_raised_as_it_is_with_a_note_naming_it() -> None:
    class Fails(Callback):
        def on_eval_end(self, state: cbs.State) -> None:
            raise KeyError("val_loss")

    with pytest.raises(KeyError) as raised:
        callbacks_of(Fails(), rank=1).call("on_eval_end", 12, 1, {"loss": 1.0})
    notes = getattr(raised.value, "__notes__", ["raised by the callback Fails.on_eval_end"])
    assert "raised by the callback" in notes[0] and "Fails.on_eval_end" in notes[0]
    if hasattr(raised.value, "add_note"):
        assert notes == ["raised by the callback Fails.on_eval_end (Task.callbacks) at step 12 on rank 1"]


def test_task_callbacks_must_be_instances_of_callback() -> None:
    task = tasks.build(TrainConfig())
    tasks.check(dataclasses.replace(task, callbacks=[OnlySteps()]), "--task t")
    for given, message in (
        ([OnlySteps], "Task.callbacks[0] is the class OnlySteps, expected an instance: OnlySteps()"),
        ([OnlySteps(), print], "Task.callbacks[1] is builtin_function_or_method, expected an instance of a"),
        (OnlySteps(), "Task.callbacks is OnlySteps, expected a list of hpc_ddp.Callback instances"),
    ):
        with pytest.raises(UsageError, match="^--task t: ") as raised:
            tasks.check(dataclasses.replace(task, callbacks=given), "--task t")
        assert message in str(raised.value)


def test_the_part_keeps_each_ranks_state_and_says_what_it_could_not_give_back(tmp_path: Path) -> None:
    calls: list[Any] = []
    first = Recorder(calls)
    first.seen = 4
    part = CallbacksPart(callbacks_of(first, OnlySteps()))
    assert (part.key, part.kind) == ("callbacks", PER_RANK)
    saved = part.state_dict()
    assert list(saved) == ["0.Recorder"] and saved["0.Recorder"]["seen"] == 4
    content.check_savable(saved, part.describe())
    # Through the full format's file: the entry is every rank's list; each rank loads its own.
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {}, "callbacks": [saved, {"0.Recorder": {"seen": 9, "t": torch.zeros(1)}}]}, path)
    opened = full.Loaded(full.load(path, verify=False, storage=Local()))
    again = Recorder(calls)
    ctx = Loading(path, {}, TrainConfig())
    CallbacksPart(callbacks_of(again, rank=1)).load_state_dict(opened.state_of(part, 1), ctx)
    assert again.seen == 9 and ctx.notes == []
    fresh = Recorder(calls)
    CallbacksPart(callbacks_of(fresh, rank=2)).load_state_dict(opened.state_of(part, 2), ctx)  # a new rank
    assert fresh.seen == 0
    assert ctx.notes == [
        "the checkpoint holds no state of the callback(s) 0.Recorder on rank 2 (a new callback, a new rank, or "
        "one written without it): they start fresh"
    ]


def test_a_callback_state_a_weights_only_load_would_refuse_is_a_usage_error() -> None:
    class Odd(Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    part = CallbacksPart(callbacks_of(Odd()))
    with pytest.raises(
        CheckpointError, match=r"the callbacks' state_dict\(\)\['0.Odd'\]\['when'\] is a builtins"
    ):
        content.check_savable(part.state_dict(), part.describe())
    assert issubclass(CheckpointError, UsageError)  # exit 2 at start


# ----- in-process: a real Trainer on a one-rank gloo group -----------------------------------------------------
def test_the_loop_calls_the_hooks_in_order_saves_their_state_and_stops_where_asked(tmp_path: Path) -> None:
    """linear: 1000 samples, batch 32: 32 steps an epoch; an evaluation every 2 steps; the callback asks to
    stop after step 3: step 4's forward runs, its update is not applied, and the run ends at step 3."""
    env = dist_env.detect({})
    cfg = TrainConfig(epochs=2, batch_size=32, eval_every_steps=2, save_every_steps=2).with_folder(
        str(tmp_path)
    )
    calls: list[tuple[str, int, tuple[str, ...]]] = []
    recorder = Recorder(calls, stop_at=3)
    with process_group(env, torch.device("cpu")):
        torch.manual_seed(cfg.seed)
        task = tasks.build(cfg)
        task = dataclasses.replace(task, eval_dataset=task.dataset, callbacks=[recorder])
        with Trainer(cfg, env, torch.device("cpu"), task, RankLog(0), local_checkpoints(cfg)) as trainer:
            assert trainer.callbacks.model is trainer.strategy.model is not trainer.strategy.wrapped
            trainer.callbacks.start(0, 0)
            before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            outcome = trainer.run()
            assert outcome.finished and trainer.pos.step == 3 and trainer.pos.stopped
            trainer.save(final=True)
            trainer.callbacks.call("on_train_end", trainer.pos.step, trainer.pos.epoch)
            assert trainer.finished()
    assert calls == [
        ("on_train_start", 0, ()),
        ("on_step_end", 1, ("loss",)),
        ("on_step_end", 2, ("loss",)),
        ("on_eval_end", 2, ("loss",)),
        ("on_save", 2, ()),
        ("on_step_end", 3, ("loss",)),
        ("on_eval_end", 3, ("loss",)),  # the run's final evaluation, at the step it ended
        ("on_save", 3, ()),
        ("on_train_end", 3, ()),
    ]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    saved = full.load(store.read_latest(tmp_path, storage=Local()), storage=Local())  # type: ignore[arg-type]
    assert saved["position"]["step"] == 3 and saved["position"]["stopped"]
    assert saved["callbacks"] == [{"0.Recorder": {"seen": 3, "t": torch.tensor([3.0])}}]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["event"] == "step"] == [1, 2, 3]  # step 4 was not taken


# ----- real runs: 1 node x 2 gloo ranks --------------------------------------------------------------------------
TWO = (
    "--nodes",
    "1",
    "--tasks-per-node",
    "2",
    "--gpus-per-node",
    "0",
    "--deterministic",
    "--batch-size",
    "16",
)


@pytest.mark.slow
@pytest.mark.deadline(240)
def test_an_ema_callback_preempted_twice_resumes_bit_for_bit(tmp_path: Path) -> None:
    """slow_tasks' slow (dropout, momentum) with callback_tasks.EMA: 16 steps an epoch, 3 epochs."""
    args = ("--task", "callback_tasks:ema", *TWO, "--epochs", "3", "--lr", "0.005")
    code, out = finish(start(tmp_path / "straight", *args, SLOW_TASK_SLEEP_S="0"))
    assert code == 0, out
    out = preempted_twice(tmp_path / "twice", *args, SLOW_TASK_SLEEP_S="0.03")
    assert out.count("Resuming from ") == 2
    straight, twice = (torch.load(tmp_path / f / "ema.pt", weights_only=True) for f in ("straight", "twice"))
    assert straight.keys() == twice.keys() and straight
    assert all(torch.equal(straight[k], twice[k]) for k in straight)
    models = [torch.load(tmp_path / f / "model.pth", weights_only=True) for f in ("straight", "twice")]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    # The EMA is not the model: it really averaged (a callback that did nothing would pass the rest).
    assert any(not torch.equal(straight[k], models[0][k].float()) for k in straight)
    last = full.load(store.read_latest(tmp_path / "twice", storage=Local()), storage=Local())  # type: ignore[arg-type]
    ranks = last["callbacks"]
    assert len(ranks) == 2 and all(torch.equal(ranks[0]["0.EMA"]["shadow"][k], straight[k]) for k in straight)


@pytest.mark.slow
@pytest.mark.deadline(120)
def test_an_early_stop_asked_on_one_rank_ends_every_rank_at_one_step_as_finished(tmp_path: Path) -> None:
    """callback_tasks.early_stop: the last rank asks to stop after step 5; 16 steps an epoch, 2 epochs."""
    args = ("--task", "callback_tasks:early_stop", *TWO, "--epochs", "2", "--eval-every-steps", "2")
    code, out = finish(start(tmp_path, *args, "--log-every-s", "0", STOP_AT_STEP="5", SLOW_TASK_SLEEP_S="0"))
    assert code == exitcodes.OK, out
    assert "a callback asked to stop: every rank ends the run at step 5" in out
    assert "preempted" not in out and (tmp_path / "model.pth").is_file()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if r["event"] == "step") == 5
    assert [r["step"] for r in records if r["event"] == "eval"] == [2, 4, 5]  # the final one where it ended
    latest = store.read_latest(tmp_path, storage=Local())
    assert latest is not None and store.ckpt_step(latest) == 5
    for rank in (0, 1):
        hooks = [json.loads(line) for line in (tmp_path / f"hooks-rank{rank}.jsonl").read_text().splitlines()]
        assert hooks[0]["hook"] == "on_train_start" and hooks[-1] == {
            **hooks[-1],
            "hook": "on_train_end",
            "step": 5,
        }
        assert [h["step"] for h in hooks if h["hook"] == "on_step_end"] == [1, 2, 3, 4, 5]
        assert {(h["model"], h["optimizer"], h["world_size"]) for h in hooks} == {("Sequential", "SGD", 2)}
        assert set(hooks[1]["metrics"]) == {"loss"} and hooks[1]["metrics"]["loss"] > 0
    # The same command again: the run is finished, and says why.
    code, again = finish(start(tmp_path, *args, STOP_AT_STEP="5", SLOW_TASK_SLEEP_S="0"))
    assert code == exitcodes.OK, again
    assert "already finished at epoch 0, step 5: a callback stopped it" in again


@pytest.mark.slow
@pytest.mark.deadline(120)
def test_a_callbacks_exception_is_its_ranks_error_in_the_code_never_a_nodes(tmp_path: Path) -> None:
    args = ("--task", "callback_tasks:boom", *TWO, "--epochs", "1", "--max-restarts", "0")
    code, out = finish(start(tmp_path, *args, SLOW_TASK_SLEEP_S="0"))
    assert code == exitcodes.FAILED, out
    (only,) = attempts.read(tmp_path)
    assert (only.outcome, only.rank, only.blamed) == ("failed", 1, False), out
    assert only.signature.startswith("ValueError: boom in a callback"), only
    assert "Traceback (most recent call last)" in out and "in on_step_end" in out, out
    note = json.loads(next((tmp_path / "exits").iterdir()).joinpath("rank1.json").read_text())
    assert "callback_tasks.py" in note["traceback"] and "in on_step_end" in note["traceback"]
    if hasattr(ValueError(), "add_note"):
        assert (
            "raised by the callback Boom.on_step_end (Task.callbacks) at step 3 on rank 1"
            in note["traceback"]
        )
