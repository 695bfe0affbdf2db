"""The training loop of one rank: epochs of optimizer steps, agreed stops, evaluations and checkpoints.

`step` is one optimizer step, top to bottom as nanoGPT's loop reads: each micro-batch's forward and backward
(gradients accumulate locally on all but the last, whose backward synchronises them), the step's one all-reduce
(hpc_ddp.run.loop.agreed: the loss, every rank's signal votes, whether saving still works), then unscale, clip, the
optimizer and the scheduler, and the step counted and recorded. `run` walks the epochs over this rank's feed
(hpc_ddp.run.data.feed) and, after each step, every rank decides the same way whether to stop, evaluate, compare
its time with the others' (stragglers) or save (`_after_step`).

The loop talks to two seams and names neither a parallel strategy nor a checkpoint format: its `Strategy`
(hpc_ddp.run.strategy: wrapping, the accumulation context, autocast, the end-of-backward mark, clipping, the
model's and optimizer's state) and its `Checkpointer` (hpc_ddp.run.checkpoint.checkpointer: named stateful parts saved
through the format --checkpoint-format names, into the run's storage). A caller hands it the run's checkpoint
store (`checkpoints`: the folder and its storage, hpc_ddp.run.checkpoint.store.CheckpointStore, built once per
process), composes the rest with what the options choose, or gives its own `strategy` and `beacon` (what the
hang watchdog reads; a NullBeacon for an unwatched rank: the bench's baseline).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.log import RankLog
from hpc_ddp.run import strategy as strategies
from hpc_ddp.run.callbacks import Callbacks
from hpc_ddp.run.checkpoint import content, formats
from hpc_ddp.run.checkpoint.checkpointer import Checkpointer
from hpc_ddp.run.checkpoint.format import Opened
from hpc_ddp.run.checkpoint.part import Part
from hpc_ddp.run.checkpoint.parts import (
    BestPart,
    CallbacksPart,
    ModelPart,
    OptimizerPart,
    PositionPart,
    RngPart,
    ScalerPart,
    SchedulerPart,
    StreamPart,
)
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.data import batches as batching
from hpc_ddp.run.data.feed import Ahead, Feed
from hpc_ddp.run.loop import best as best_of
from hpc_ddp.run.loop import forward, nonfinite, schedules
from hpc_ddp.run.loop.agreed import Agreed, Pending, launch
from hpc_ddp.run.loop.clock import StepClock
from hpc_ddp.run.loop.evaluator import Evaluations, Evaluator
from hpc_ddp.run.loop.position import Outcome, Position, trained
from hpc_ddp.run.records import metrics, progress
from hpc_ddp.run.sinks import trackers
from hpc_ddp.run.snapshot import taker as snapshot
from hpc_ddp.run.strategy.base import Strategy
from hpc_ddp.run.tasks import Task
from hpc_ddp.run.watch import stragglers
from hpc_ddp.run.watch.beacon import Beacon


class Trainer:
    """Owns the model, optimizer and data of one rank; `run()` trains until done or an agreed stop.

    Use it as a context manager inside `process_group()`: leaving the block closes it (see `close`), on
    errors too, so its strategy's wrapped module (DDP) never outlives the group. `cfg.folder` is the run folder.
    `asked_grad_accum`: the command line's --grad-accum, when --allow-resize chose the one `cfg` has."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        task: Task,
        log: RankLog,
        checkpoints: CheckpointStore,
        beacon: Beacon | None = None,
        strategy: Strategy | None = None,
        asked_grad_accum: int | None = None,
    ) -> None:
        assert cfg.folder, "the Trainer needs the run folder (TrainConfig.folder)"
        self.cfg, self.env, self.device, self.log, self.folder = cfg, env, device, log, Path(cfg.folder)
        self.clock = StepClock(beacon or Beacon())  # the beacon's phases and the straggler window
        self.beacon = self.clock.beacon
        # What a checkpoint must hold, checked on every rank before the first step: a state that a weights_only
        # load would refuse is a usage error now, not a checkpoint that never loads. The model's before the first
        # collective: a slow state_dict() (a user hook) is then waited for before any rank's watchdog starts.
        if isinstance(task.model, torch.nn.Module):  # a factory's model is checked once it is built
            content.check_savable(task.model.state_dict(), "the model's state_dict()")
        # Every rank's host and pid, once, at start: the straggler report and the hang verdict name hosts.
        self.peers: list[tuple[str, int]] = [("", 0)] * env.world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()))
        self.best = best_of.for_run(cfg.best_rule(), task)  # --keep-best (hpc_ddp.run.loop.best)
        # The data, checked before the model is wrapped: a usage error there has nothing to release.
        self.feed = Feed(cfg, env, device, task, log)
        self.batches_per_epoch, self.not_exact = self.feed.batches_per_epoch, self.feed.not_exact
        self.forward = forward.Forward(task, env)
        self.strategy = strategy or strategies.for_run(cfg, env, device, task)
        try:
            self._assemble(task, checkpoints, asked_grad_accum)
        except BaseException:
            self.close()  # a user optimizer or scheduler raised: release DDP before the group goes
            raise

    def _assemble(self, task: Task, checkpoints: CheckpointStore, asked_grad_accum: int | None) -> None:
        cfg, env = self.cfg, self.env
        # Wrap first, then the optimizer over what the strategy says it steps (FSDP needs this order).
        self.strategy.setup(task.model, task.optimizer or (lambda params: torch.optim.SGD(params, lr=cfg.lr)))
        if not isinstance(task.model, torch.nn.Module):
            content.check_savable(self.strategy.model.state_dict(), "the model's state_dict()")
        self.model, self.optimizer = self.strategy.model, self.strategy.optimizer  # the user's, on the device
        self.scaler = self.strategy.scaler
        self.callbacks = Callbacks(task.callbacks, self.model, self.optimizer, env, self.folder)  # the task's
        self.pos = Position()
        self.save_due = False  # a periodic save waits for a finite step (see _periodic_save)
        self.notes: list[str] = []  # what a resume changed (said once training really starts)
        self.step_lr = 0.0  # the rate this step was taken with (recorded: the scheduler moved on since)
        self.grad_norm: torch.Tensor | None = None  # the step's norm before clipping (a tensor)
        self._step_loss = torch.zeros((), device=self.device)  # this step's micro-batch losses, on the device
        total = _total_steps(cfg, self.feed)
        main_folder = self.folder if env.is_main else None  # rank 0 records
        self.metrics = metrics.Recorder(main_folder, cfg, env, total, warn=self.log.warn)
        # Built before any state is loaded (it sets the rates; a resume's states overwrite them: run/loop/schedules).
        known = total if total or not self.feed.iterable else None  # None: a stream without --max-steps
        self.scheduler = schedules.for_run(task, cfg, self.optimizer, known, self.log.main)
        self.plateau = schedules.is_plateau(self.scheduler)  # stepped by evaluations (run/loop/schedules)
        self.metrics.params = _tracker_params(cfg, task, self.optimizer, self.scheduler)
        self.evaluations = _evaluations(self, task)
        fmt, record = formats.for_run(cfg, self.folder, env, checkpoints.storage), self.metrics.save
        self.checkpointer = Checkpointer(
            cfg, env, self.folder, _parts(self), fmt, self.log, record, self.beacon, asked_grad_accum
        )
        self.checkpointer.total_steps = known  # in every checkpoint: a resume over another says so (parts.py)
        self.checkpointer.check_savable()
        guarded = (self.metrics, self.strategy, self.checkpointer)  # --nonfinite-loss (run/loop/nonfinite)
        self.guard = nonfinite.Guard(cfg.nonfinite_loss, env, self.log, *guarded)
        self.snapshots = snapshot.for_run(cfg, env, self.checkpointer, self.model, self.log)  # or None

    # ----- end of life ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End of life, on every path, before the process group is destroyed: wait until the checkpoint in
        flight is durable, then release what holds the group (the strategy's wrapped module: DDP and its
        Reducer) and drop the optimizer and data. `model` and `pos` stay readable. Idempotent; the writer's
        error, if any, is raised after the release."""
        try:
            # DataLoader workers first: they end at once here (not at the garbage collector's pace, 5 s a worker).
            for name in ("feed", "evaluations", "checkpointer", "snapshots"):
                if self.__dict__.get(name) is not None:
                    self.__dict__[name].close()
        finally:
            if "strategy" in self.__dict__:
                self.strategy.close()
            for name in ("optimizer", "scaler", "scheduler", "feed"):
                self.__dict__.pop(name, None)
            if "metrics" in self.__dict__:
                try:
                    self.metrics.close()  # every sink flushed (run/sinks), on every path out
                except Exception as e:  # the run's outcome stands; the records lose their last lines
                    self.log.warn(f"metrics.jsonl could not be flushed and closed: {e}")

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is None:
            self.close()
            return
        # The traceback's frames hold their locals (DDP's forward, `self` the DDP module; a generator over its
        # parameters) until the error is dropped: cleared (its lines stay) so that DDP goes with close().
        traceback.clear_frames(tb)
        try:
            self.close()
        except Exception as e:  # the error already propagating is the one to report
            self.log.warn(f"while stopping after an error: the checkpoint in flight failed too: {e}")

    # ----- checkpoints ------------------------------------------------------------------------------------
    def save(self, final: bool = False) -> None:
        """Checkpoint here (a collective: Checkpointer.save; `final`: until durable), then the callbacks' on_save."""
        self.save_due = False
        best = self.best is not None and self.best.step == self.pos.step
        if self.checkpointer.save(self.pos, final, best=best):
            self.callbacks.call("on_save", self.pos.step, self.pos.epoch)

    def resume_from(self, path: Path, verify: bool = False) -> None:
        """Every rank: load checkpoint `path` (rank 0 verified it already unless `verify`)."""
        self.load(self.checkpointer.open(path, verify), path)

    def load(self, opened: Opened, path: Path) -> None:
        """Every rank: give each part its state from checkpoint `path`, read back (`opened`). A --lr that differs
        from the checkpoint's is applied, and said (`notes`), or refused if the optimizer does not take it."""
        self.notes = self.checkpointer.restore(opened, path)
        self.checkpointer.resumed(self.pos)

    def finished(self) -> bool:
        """Nothing left to do: every step trained and the run's end done (a run stopped in its last step has
        its final evaluation and epoch record still to come)."""
        return trained(self.pos, self.cfg.epochs, self.cfg.max_steps) and not self.pos.end_pending

    # ----- one optimizer step -------------------------------------------------------------------------
    def step(self, micro_batches: Iterable[Any], count: int, ahead: Ahead | None = None) -> Agreed:
        """One optimizer step over `count` micro-batches (--grad-accum), as the loop takes it; a collective.
        `micro_batches` is read lazily: loading data (the loader's iterator, timed) happens between micro-steps.
        `ahead`: a stream's fetch of its next step (run/data/feed.py), whose end rides in this step's all-reduce."""
        strategy, clock, names, hooks = self.strategy, self.clock, self.forward.names, self.callbacks
        loss_sum, extras, done = self._step_loss.zero_(), {}, 0
        pending: Pending | None = None
        rows = clock.rows(self.pos.step + 1, self.env)  # every few steps, each rank's straggler window
        for batch in micro_batches:
            done += 1
            last = done == count
            # The step in the making, said again: a stream's fetch ahead set the beacon's step during the last.
            clock.compute(self.pos.step + 1)
            batch = batching.to_device(batch, self.device)
            # no_sync on all but the last micro-batch: gradients accumulate locally, one synchronisation a step.
            with contextlib.nullcontext() if last else strategy.no_sync():
                with strategy.autocast(), clock.task:
                    loss, more = self.forward(strategy.wrapped, batch)
                forward.trainable(loss)
                if names is None:  # the first micro-batch: the same metrics on every rank (a collective)
                    self.forward.agree(more)
                    names = self.forward.names
                forward.add(extras, more, names)
                loss_sum += loss.detach()
                if last:
                    # The step's all-reduce starts now, its latency hidden behind this backward (run/loop/agreed.py).
                    # A stream's next step is fetched first, so that whether it has one rides in it.
                    exhausted = 0.0 if ahead is None else float(not ahead.fetch())
                    if ahead is not None:
                        clock.computing()  # the fetch said "data loading"; the backward comes now
                    saving = self.checkpointer.check()
                    pending = launch(loss_sum, count, saving, exhausted, extras, names, hooks.halt, rows)
                scaled = loss * (1.0 / count)
                if last and clock.watched:
                    strategy.on_backward_end(scaled, clock.mark_grads_ready)
                with clock.task:  # DDP's gradient all-reduce included: it overlaps the backward
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            if last:
                break
            clock.micro_done()
        if pending is None:
            raise RuntimeError(f"internal error: {done} micro-batch(es) for an optimizer step of {count}")
        clock.backward_done()
        clock.all_reduce()
        # Before the update: every rank learns at this step that some rank's loss is not finite (or that rank 0
        # cannot save), and nobody applies that update.
        agreed = pending.wait()
        clock.optimizer()
        # The rate this step is taken with, recorded with it (the scheduler's next one is set by then).
        self.step_lr, self.grad_norm = float(self.optimizer.param_groups[0]["lr"]), None  # a norm: if applied
        with clock.task:  # the update, as a hand-written loop has it
            if math.isfinite(agreed.loss_sum) and not agreed.saving and not agreed.halt:
                if self.scaler:
                    self.scaler.unscale_(self.optimizer)
                self.grad_norm = _norm_before_update(
                    strategy, self.cfg.clip_grad, clock
                )  # clips, with --clip-grad
                if self.scaler:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
                # Once per applied step, never per micro-batch; a plateau schedule by evaluations instead.
                if self.scheduler is not None and not self.plateau:
                    self.scheduler.step()
            # set_to_none even with DDP's bucket views (hpc_ddp.bench: mlp, 2 CPU ranks, ~1350 -> ~1460
            # samples/s): backward then hands DDP a fresh gradient that it copies into the bucket once and
            # re-views, instead of a memset of every bucket here plus an in-place add during backward.
            self.optimizer.zero_grad(set_to_none=True)
        clock.step_done()
        if not agreed.halt or agreed.saving:  # a callback's stop request: this step is not taken, not counted
            self._count(agreed, count)
        return agreed

    def _count(self, agreed: Agreed, size: int) -> None:
        """Every rank: the step is taken (or its update skipped, everywhere alike), counted and recorded."""
        pos = self.pos
        finite = math.isfinite(agreed.loss_sum)
        if not finite:  # raises, unless --nonfinite-loss skip (hpc_ddp.run.loop.nonfinite)
            self.guard.nonfinite(agreed.loss_sum, pos.step + 1, pos, self.folder, self.beacon)
        if agreed.saving:
            raise self.checkpointer.stop(agreed.saving, pos.step)
        if finite:
            self.guard.finite()
            pos.loss_sum, pos.loss_count = pos.loss_sum + agreed.loss_sum, pos.loss_count + agreed.count
        pos.batch, pos.step = pos.batch + size, pos.step + 1
        per = max(agreed.count, 1.0)
        extras = dict(zip(self.forward.names or (), (v / per for v in agreed.extras), strict=True))
        samples = self.cfg.batch_size * size * self.env.world_size
        clock = self.clock
        mean, lr, norm = agreed.loss_sum / per, self.step_lr, self.grad_norm
        self.metrics.step(pos, mean, samples, lr, clock.data_s, extras, clock.task_s, norm, clock.norm_s)
        clock.data_s = clock.task_s = clock.norm_s = 0.0
        self.checkpointer.record_ended(only_if_written=True)  # rank 0 records a save once it is durable
        self.callbacks.step_end(pos.step, pos.epoch, agreed.loss_sum / per, extras)

    # ----- the loop -------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        """Train from `self.pos` to the end, or until every rank agreed to stop."""
        pos = self.pos
        if pos.end_pending and not trained(pos, self.cfg.epochs, self.cfg.max_steps):
            # Stopped in what was the run's last step, resumed with a higher --max-steps (or --epochs): that end
            # is no end any more. Training goes on, after the step's evaluation if the schedule has one there.
            mid_epoch = pos.batch < self.batches_per_epoch
            pos.end_pending = False
            pos.eval_pending = self.evaluations.after_step(pos, mid_epoch, last=False, finished=False)
        if self.pos.eval_pending:  # stopped during the evaluation at this step, or before it: it comes first
            self.log.main(
                f"the evaluation at step {self.pos.step} was stopped by the signal (or not begun): it runs first"
            )
            stopped = self._evaluate()
            if stopped is not None:
                return stopped
            if not self.pos.end_pending:  # else the final save comes right after, at this step
                self._periodic_save(False)  # --keep-best: a new best is saved at its step
        if self.pos.end_pending:  # stopped in the run's last step (--max-steps) or in its final evaluation
            return self._end_inside_epoch()
        if trained(self.pos, self.cfg.epochs, self.cfg.max_steps):  # never more steps, also after a resume
            return Outcome(True)
        while self.pos.epoch < self.cfg.epochs:
            outcome = self._epoch(self.pos.epoch)
            if outcome is not None and not outcome.finished:
                return outcome
            if outcome is not None:  # --max-steps reached inside the epoch
                return self._end_inside_epoch()
            stopped = self._epoch_end(last=self.pos.epoch + 1 >= self.cfg.epochs)
            if stopped is not None:
                return stopped
            self.pos = Position(epoch=self.pos.epoch + 1, step=self.pos.step)
            self._periodic_save(
                bool(self.cfg.save_every_epochs and self.pos.epoch % self.cfg.save_every_epochs == 0)
            )
        return Outcome(True)

    def _epoch_end(self, last: bool) -> Outcome | None:
        """The end of an epoch (`last`: of the run): its evaluation when due, then its record and line; an
        Outcome if a signal came during the evaluation."""
        if self.evaluations.after_epoch(self.pos, last):
            stopped = self._evaluate()
            if stopped is not None:
                return stopped
        mean = self.pos.loss_sum / max(self.pos.loss_count, 1.0)
        self.metrics.epoch(self.pos, mean)  # first: it erases the live progress line
        self.log.main(f"Epoch {self.pos.epoch}, Loss: {mean:.4f}")
        return None

    def _end_inside_epoch(self) -> Outcome:
        """--max-steps reached inside an epoch: the run's end, the epoch's end at its last step. Until it is
        done the position says so (`end_pending`), so that a stop during the final evaluation, or in the step
        before it, is resumed into this end and not taken for a finished run."""
        self.pos.end_pending = True
        stopped = self._epoch_end(last=True)
        if stopped is not None:
            return stopped
        self.pos.end_pending = False
        return Outcome(True)

    def _epoch(self, epoch: int) -> Outcome | None:
        """Train the rest of one epoch, step by step as the feed gives them; an Outcome if the loop must end
        inside it. A stream's epoch ends after the step whose all-reduce says some rank's stream has no next."""
        for micro_batches, size, ahead in self.feed.steps(epoch, self.pos, self.clock, self.log):
            agreed = self.step(micro_batches, size, ahead)
            last = bool(agreed.exhausted)
            ended = self._after_step(agreed, last)
            if ended is not None or last:
                return ended
        return None

    def _after_step(self, agreed: Agreed, last: bool) -> Outcome | None:
        """What every rank decides after a step, the same way: an Outcome if the loop must end here. `last`:
        the epoch's last step of a stream."""
        cfg, pos = self.cfg, self.pos
        if agreed.halt and not agreed.saving:  # a callback asked to stop: every rank learned it here
            return _stopped(pos, self.log)
        finished = bool(cfg.max_steps and pos.step >= cfg.max_steps)  # evaluated at the end, by run()
        mid_epoch = pos.batch < self.batches_per_epoch
        evaluate = self.evaluations.after_step(pos, mid_epoch, last, finished)
        if agreed.requeue or agreed.stop:
            # The step's evaluation is still due: the checkpoint says so, and the resume runs it first. So is the
            # run's end, when this was its last step (--max-steps): the resume evaluates and ends the run.
            pos.eval_pending, pos.end_pending = bool(evaluate), finished
            return Outcome(False, agreed.requeue, agreed.stop)
        if agreed.rows:  # every rank's time split of the window, judged alike everywhere (run/loop/clock)
            slow = self.clock.judge.add(agreed.rows)
            self.metrics.ranks(pos, agreed.rows)  # rank 0 records every rank's split (the report's heat map)
            for s in slow:  # rank 0 names a straggler, and its host
                self.log.main(stragglers.describe(s, self.peers[s.rank][0], pos.step))
                self.metrics.straggler(pos, s.rank, self.peers[s.rank][0], s.phase, s.slower)
        if finished:
            return Outcome(True)
        if evaluate:
            stopped = self._evaluate()
            if stopped is not None:
                return stopped
        self._periodic_save(bool(cfg.save_every_steps and pos.step % cfg.save_every_steps == 0))
        snapshot.after_step(self.snapshots, pos.step, self.guard.skipped)  # into memory: run/snapshot
        return None

    def _periodic_save(self, due: bool) -> None:
        """A save the schedule asks for now (`due`), or asked for during skipped steps: not while the newest
        step's update was skipped (--nonfinite-loss skip); it comes at the next finite step."""
        self.save_due = self.save_due or due
        if self.save_due and not self.guard.skipped:
            self.save()

    def _evaluate(self) -> Outcome | None:
        """Evaluate at the current position (a collective; hpc_ddp.run.loop.evaluator.Evaluations.run): an Outcome
        if a signal came during it; a new best makes the save at this step due."""
        with self.clock.task:  # the task's work, not the kit's (the next step's time holds it)
            stopped, new_best = self.evaluations.run(self.pos)
        self.save_due = self.save_due or new_best
        return stopped


def _norm_before_update(strategy: Strategy, clip: float, clock: StepClock) -> torch.Tensor:
    """The gradients' norm before clipping, a tensor (read for a record only: run/records/metrics.py). With --clip-grad
    the clipping's own (and the gradients clipped), free; else one reduction for the records: the kit's own
    work, not the task's (`clock.kit`)."""
    if clip > 0:
        return strategy.clip_grad_norm(clip)
    with clock.norm:
        return strategy.grad_norm()


def _evaluations(trainer: Trainer, task: Task) -> Evaluations:
    """When and how `trainer` evaluates `task` (nothing is ever due without Task.eval_dataset)."""
    evaluator = None
    if task.eval_dataset is not None:
        loss, options, t = trainer.forward.loss, trainer.feed.options, trainer
        evaluator = Evaluator(task, t.cfg, t.env, t.device, t.strategy, loss, t.beacon, options)
    plateau = trainer.scheduler if trainer.plateau else None
    hooks = (trainer.metrics, trainer.log, trainer.callbacks)
    return Evaluations(evaluator, trainer.cfg, trainer.best, plateau, *hooks)


def _stopped(pos: Position, log: RankLog) -> Outcome:
    """A callback asked to stop (hpc_ddp.run.callbacks): the step whose packet said so was not taken, and the run
    ends as finished at the one before, as --max-steps would end it there (its final evaluation, the epoch's
    record, the final save), for good: a rerun finds it finished."""
    log.main(f"a callback asked to stop: every rank ends the run at step {pos.step}")
    pos.stopped = True
    return Outcome(True)


def _tracker_params(cfg: TrainConfig, task: Task, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """The trackers' run parameters: the options, the task's settings, and the task's own optimizer and
    scheduler said by their class (hpc_ddp.run.sinks.trackers.run_params)."""
    return trackers.run_params(
        cfg.as_dict(),
        f"Task.optimizer ({type(optimizer).__name__})" if task.optimizer else "SGD (--lr)",
        f"Task.scheduler ({type(scheduler).__name__})" if task.scheduler else "",
    )


def _total_steps(cfg: TrainConfig, feed: Feed) -> int:
    """The run's last step, from --epochs and --max-steps; a stream's is --max-steps alone (0: unknown)."""
    if feed.iterable:
        return cfg.max_steps
    steps_per_epoch = math.ceil(feed.batches_per_epoch / cfg.grad_accum)
    return progress.total_steps(cfg.epochs, steps_per_epoch, cfg.max_steps)


def _parts(trainer: Trainer) -> list[Part]:
    """The checkpoint's named parts of `trainer`, in the order a resume loads them (RNG last)."""

    def set_pos(pos: Position) -> None:
        trainer.pos = pos

    return [
        ModelPart(trainer.strategy),
        OptimizerPart(trainer.strategy),
        ScalerPart(trainer.scaler),
        SchedulerPart(lambda: trainer.scheduler),
        PositionPart(lambda: trainer.pos, set_pos),
        StreamPart(lambda: trainer.feed.state, trainer.feed.load),
        BestPart(trainer.best),
        RngPart(trainer.device),
    ] + ([CallbacksPart(trainer.callbacks)] if trainer.callbacks.stateful else [])
