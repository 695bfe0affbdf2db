"""The training loop: sampler epochs, gradient accumulation, AMP, agreed stops, and when to checkpoint.

The loop talks to two seams and never names DDP or a file format: its `Strategy` (hpc_ddp.run.strategy:
wrapping, the accumulation context, the comm hook, clipping, the model's and optimizer's state) and its
`Checkpointer` (hpc_ddp.run.checkpointer: named stateful parts saved through a checkpoint format).

One all-reduce of five numbers per optimizer step carries [loss sum, micro-batches, requeue votes, stop
votes, saving trouble]: the loss is averaged over all ranks for reporting, and a signal seen by any rank stops
every rank at the same step, at no extra collective. It comes before the optimizer step, so a loss that is NaN
or infinite on any rank is non-finite in the sum on every rank at the same step, and its update is never
applied (`--nonfinite-loss`: stop, the default, or skip that step).

Two seams serve whoever drives a Trainer other than `run()` (the bench): `train_step` is one optimizer step
exactly as the loop takes it, and `commit` (a constructor argument) is how the full format makes a checkpoint
durable.

Hangs and stragglers: the loop keeps the rank's progress beacon (run/beacon.py) on the phase it is in, for
the hang watchdog (run/watchdog.py), and splits each step's time into data, compute and communication wait.
Every few steps the ranks compare those splits with one small all-gather (run/stragglers.py).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from hpc_ddp.cluster import placement
from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import NonFinite, UsageError
from hpc_ddp.log import RankLog, count
from hpc_ddp.run import batches as batching
from hpc_ddp.run import beacon as phase
from hpc_ddp.run import best as best_of
from hpc_ddp.run import exact, loaders, metrics, preemption, progress, rng, schedules, seeding, stragglers
from hpc_ddp.run import strategy as strategies
from hpc_ddp.run.beacon import Beacon
from hpc_ddp.run.checkpoint import content, formats, full
from hpc_ddp.run.checkpointer import SAVING_OK, Checkpointer
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.evaluator import Evaluator, agree_names
from hpc_ddp.run.folder import MODEL
from hpc_ddp.run.parts import (
    BestPart,
    ModelPart,
    OptimizerPart,
    PositionPart,
    RngPart,
    ScalerPart,
    SchedulerPart,
    StreamPart,
)
from hpc_ddp.run.position import Outcome, Position
from hpc_ddp.run.strategy.base import Strategy
from hpc_ddp.run.strategy.ddp import CommHook
from hpc_ddp.run.tasks import Task
from hpc_ddp.run.workers import init as worker_start

MAX_SKIPPED = 10  # --nonfinite-loss skip: this many non-finite steps in a row stop the run anyway


class Agreed(NamedTuple):
    """What the per-step all-reduce returns: this step's numbers summed over every rank."""

    loss_sum: float  # the micro-batch losses of the step
    count: float  # the micro-batches
    requeue: float  # ranks that saw SIGUSR1/SIGUSR2 (their votes to stop and requeue)
    stop: float  # ranks that saw SIGTERM (their votes to stop)
    saving: float = SAVING_OK  # some rank's writer gave up (checkpointer.SAVING_*)
    exhausted: float = 0.0  # ranks whose stream has no next step (an IterableDataset): the epoch ends here
    extras: tuple[
        float, ...
    ] = ()  # the step's extra metrics (Task.step), summed over micro-batches and ranks


class Trainer:
    """Owns the model, optimizer and data of one rank; `run()` trains until done or an agreed stop.

    Use it as a context manager inside `process_group()`: leaving the block closes it (see `close`), on
    errors too, so its strategy's wrapped module (DDP) never outlives the group.

    `strategy`: how the model is spread over the ranks (default: DDP, with `comm_hook` as its comm hook if
    given). `commit(folder, state, step, keep)` makes a checkpoint of the full format durable on the writer
    thread (rank 0): `full.commit` unless the caller passes its own, e.g. one that times it.
    `mark_grads=False` (the baseline of `python -m hpc_ddp.bench watchdog`) skips the end-of-backward mark of
    the beacon."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        task: Task,
        folder: Path,
        log: RankLog,
        commit: full.Commit = full.commit,
        beacon: Beacon | None = None,
        comm_hook: CommHook | None = None,
        mark_grads: bool = True,
        strategy: Strategy | None = None,
        asked_grad_accum: int | None = None,
    ) -> None:
        self.cfg, self.env, self.device, self.folder, self.log = cfg, env, device, folder, log
        self.asked_grad_accum = asked_grad_accum  # --allow-resize chose cfg's: the command line said this
        self.beacon = beacon or Beacon()  # what this rank does, for the hang watchdog (run/watchdog.py)
        self.window = stragglers.Window()  # this rank's time split since the last straggler check
        self.judge = stragglers.Judge()
        self._grads_ready = 0.0  # when backward's last gradient bucket was ready (the comm wait starts)
        # What a checkpoint must hold, checked on every rank before the first step: a state that a weights_only
        # load would refuse is a usage error now, not a checkpoint that never loads. The model's before the first
        # collective: a slow state_dict() (a user hook) is then waited for before any rank's watchdog starts.
        if isinstance(task.model, torch.nn.Module):  # a factory's model is checked once it is built
            content.check_savable(task.model.state_dict(), "the model's state_dict()")
        # Every rank's host and pid, once, at start: the straggler report and the hang verdict name hosts.
        self.peers: list[tuple[str, int]] = [("", 0)] * env.world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()))
        self.best = _best(cfg, task)  # --keep-best (hpc_ddp.run.best)
        self.dataset = task.dataset
        # A stream (hpc_ddp.run.streams): no sampler, no length; its epoch ends when some rank's stream does.
        self.iterable = isinstance(task.dataset, IterableDataset)
        if self.iterable or isinstance(task.eval_dataset, IterableDataset):  # streams.reader, in every worker
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.rank), str(env.world_size)
        if self.iterable:
            if cfg.lr_schedule != "constant" and not cfg.max_steps:
                raise UsageError(
                    f"--lr-schedule {cfg.lr_schedule} over an IterableDataset needs --max-steps: a stream has "
                    "no length to end the schedule at. Fix: add --max-steps N"
                )
        self.loss_fn = task.loss_fn
        self.step_fn = task.step
        # The extra metrics of Task.step, agreed at the first step (a loss_fn has none).
        self.metric_names: list[str] | None = None if task.step is not None else []
        self._checked = False  # the first batch is checked before it is used
        self._step_extras: dict[str, torch.Tensor] = {}
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            task.dataset if not self.iterable else range(env.world_size),  # type: ignore[arg-type]
            num_replicas=env.world_size,
            rank=env.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        self.batches_per_epoch = len(self.sampler) // cfg.batch_size if not self.iterable else sys.maxsize
        if (
            self.batches_per_epoch == 0
        ):  # checked before the model is wrapped: nothing to release on this error
            raise UsageError(
                f"each rank gets {len(self.sampler)} samples of the dataset ({count(env.world_size, 'rank')}), "
                f"fewer than --batch-size {cfg.batch_size}. Fix: a smaller --batch-size or fewer ranks"
            )
        self.strategy = strategy or strategies.for_run(cfg, env, device, task, comm_hook)
        try:
            # Wrap first, then the optimizer over what the strategy says it steps (FSDP needs this order).
            self.strategy.setup(
                task.model, task.optimizer or (lambda params: torch.optim.SGD(params, lr=cfg.lr))
            )
            if not isinstance(task.model, torch.nn.Module):
                content.check_savable(self.strategy.model.state_dict(), "the model's state_dict()")
            self._finish_init(cfg, env, device, task, commit, mark_grads)
        except BaseException:
            self.close()  # a user optimizer or the DataLoader raised: release DDP before the group goes
            raise

    def _finish_init(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        task: Task,
        commit: full.Commit,
        mark_grads: bool,
    ) -> None:
        self.model = self.strategy.model  # the user's model, on this rank's device
        self.mark_grads = mark_grads
        self.optimizer = self.strategy.optimizer
        self.scaler = self.strategy.scaler
        # Chosen from the CPUs this rank is pinned to (cluster/placement), which its workers inherit.
        workers, note = placement.plan_workers(
            cfg.num_workers, device.type == "cuda", len(placement.current_affinity())
        )
        if note:
            self.log.main(note)
        self.workers = workers
        # The data's own randomness (hpc_ddp.run.seeding): a map-style dataset read by workers and every stream
        # seed each batch from where it is, so a resumed run's batches draw what the uninterrupted run's drew.
        # Read in this process, a map-style dataset draws from the training's generators, lazily: exact as is.
        self.skip = loaders.SkipSampler(self.sampler, keyed=workers > 0)
        # An explicit generator: otherwise each DataLoader iterator draws its seed from the global RNG, and a
        # resumed run's dropout would see a different random stream than the uninterrupted run.
        self.loader_gen = torch.Generator()
        options = loader_options(cfg, device, workers)
        # A stream with state_dict()/load_state_dict(): read in this process, the loop saves and loads its state
        # (`stateful`); read by workers, torchdata's StatefulDataLoader does, if installed (`loader_states`;
        # hpc_ddp.run.loaders). Either way its state before each step's fetch is saved, and a resume goes on
        # from it; without either its epoch restarts on resume, and says so.
        stream_state = self.iterable and loaders.has_state(task.dataset)
        self.stateful = stream_state and workers == 0
        stateful_loader = loaders.stateful_loader() if stream_state and workers > 0 else None
        self.loader_states = stateful_loader is not None
        # What keeps this run from resuming bit for bit, said at start (hpc_ddp.run.exact).
        self.not_exact = exact.limits(
            stream=self.iterable,
            stream_state=stream_state,
            workers=workers,
            stateful_loader=self.loader_states,
            cuda=device.type == "cuda",
            deterministic=cfg.deterministic,
        )
        self.stream = (
            (seeding.StatefulSeededStream if stream_state else seeding.SeededStream)(
                task.dataset, cfg.seed, seeding.TRAIN, cfg.batch_size
            )
            if self.iterable
            else None
        )
        data: Any = self.stream or (
            seeding.SeededBatches(task.dataset, cfg.seed, seeding.TRAIN) if workers else task.dataset
        )
        if self.iterable or stateful_loader:
            # A stream's workers start with each epoch: its key (the epoch) reaches them in their copy.
            options = loaders.stateful_options(options)
        self.loader = (stateful_loader or DataLoader)(
            data,
            batch_size=cfg.batch_size,
            sampler=self.skip if not self.iterable else None,
            drop_last=True,
            collate_fn=task.collate_fn,
            **options,
            generator=self.loader_gen,
        )
        self._step_loss = torch.zeros((), device=device)  # this step's micro-batch losses, on the device
        self.pos = Position()
        # This process's first optimizer step (after a start or a resume) pays for warm-up, lazy init and a
        # resumed checkpoint's first use: every phase of it is long for the hang watchdog (run/beacon.py).
        self.first_step = True
        self.skipped = 0  # non-finite steps in a row (--nonfinite-loss skip)
        self.save_due = False  # a periodic save waits for a finite step (see _periodic_save)
        self.notes: list[str] = []  # what a resume changed (said once training really starts)
        self.step_data_s = 0.0  # this step's wait for data (rank 0 records it)
        self._prefetch: Any = None  # a stream's fetch of its next step's batches (see _stream_epoch)
        self._stream_state: Any = None
        self._stream_loaded: Any = None
        self.step_lr = 0.0  # the rate this step was taken with (recorded: the scheduler moved on since)
        steps_per_epoch = math.ceil(self.batches_per_epoch / cfg.grad_accum)
        total = (
            progress.total_steps(cfg.epochs, steps_per_epoch, cfg.max_steps)
            if not self.iterable
            else cfg.max_steps
        )
        self.metrics = metrics.Recorder(
            self.folder if env.is_main else None, cfg, env, total, warn=self.log.warn
        )
        # Built before any state is loaded: a scheduler sets the groups' rates when it is made, and a resume's
        # optimizer and scheduler states then overwrite them (hpc_ddp.run.schedules).
        self.scheduler = _scheduler(task, cfg, self.optimizer, total if total or not self.iterable else None)
        self.plateau = schedules.is_plateau(self.scheduler)  # stepped by evaluations (hpc_ddp.run.schedules)
        if task.scheduler is not None and self.iterable and not total:
            self.log.main(
                "Task.scheduler got total_steps=None: a stream has no length and --max-steps is not set, so "
                "its schedule cannot end at the run's last step (add --max-steps N for one that does)"
            )
        self.evaluator = (
            Evaluator(task, cfg, env, device, self.strategy, self._eval_loss, self.beacon, options)
            if task.eval_dataset is not None
            else None
        )
        self._evaluated = -1  # the step this process last evaluated at
        # The checkpoint's named parts, in the order a resume loads them (RNG last).
        parts = [
            ModelPart(self.strategy),
            OptimizerPart(self.strategy),
            ScalerPart(self.scaler),
            SchedulerPart(lambda: self.scheduler),
            PositionPart(lambda: self.pos, self._set_pos),
            StreamPart(lambda: self._stream_state, self._set_stream),
            BestPart(self.best),
            RngPart(device),
        ]
        fmt = formats.for_run(cfg, self.folder, env, commit)
        self.checkpointer = Checkpointer(
            cfg, env, self.folder, parts, fmt, self.log, self.metrics.save, self.beacon, self.asked_grad_accum
        )
        self.checkpointer.check_savable()

    def _set_pos(self, pos: Position) -> None:
        self.pos = pos

    def _set_stream(self, state: Any) -> None:
        self._stream_loaded = state

    def _mark_grads_ready(self) -> None:
        self._grads_ready = self.beacon.set(phase.GRAD_ALLREDUCE, long=self.first_step)

    # ----- end of life ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End of life, on every path, before the process group is destroyed: wait until the checkpoint in
        flight is durable, then release what holds the group (the strategy's wrapped module: DDP and its
        Reducer) and drop the optimizer and data. `model` and `pos` stay readable. Idempotent; the writer's
        error, if any, is raised after the release."""
        try:
            # DataLoader workers first: they end at once here (not at the garbage collector's pace, 5 s a worker).
            if "loader" in self.__dict__:
                loaders.shut_down(self.loader)
            if self.__dict__.get("evaluator") is not None:
                self.evaluator.close()
            if "checkpointer" in self.__dict__:
                self.checkpointer.close()
        finally:
            if "strategy" in self.__dict__:
                self.strategy.close()
            for name in ("optimizer", "scaler", "scheduler", "loader", "skip"):
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
        # The frames of the error's traceback hold their locals until the error is dropped: DDP's forward
        # (`self` is the DDP module), a generator over its parameters. Clear them (the printed traceback
        # keeps its lines) so that DDP really goes with close().
        traceback.clear_frames(tb)
        try:
            self.close()
        except Exception as e:  # the error already propagating is the one to report
            self.log.warn(f"while stopping after an error: the checkpoint in flight failed too: {e}")

    # ----- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """Collective: the full format's checkpoint state (every part, every rank's RNG) on rank 0, None
        elsewhere."""
        fmt = full.Full(self.folder, self.env, self.cfg.keep)
        return fmt.gather(self.checkpointer.parts, self.checkpointer.meta())

    def save(self, final: bool = False) -> None:
        """Checkpoint at the current position (a collective; see Checkpointer.save). `final` also waits until
        it is durable."""
        self.save_due = False
        best = self.best is not None and self.best.step == self.pos.step
        self.checkpointer.save(self.pos, final, best=best)

    def restore(self, state: dict[str, Any], path: Path) -> None:
        """Load a full checkpoint's state (model, optimizer, scaler, position, this rank's RNG). A --lr that
        differs from the checkpoint's is applied, and said (`notes`), or refused if the optimizer does not take
        it."""
        self._resumed(self.checkpointer.restore(full.Loaded(state), path))

    def resume_from(self, path: Path, verify: bool = False) -> None:
        """Every rank: load checkpoint `path` (rank 0 verified it already unless `verify`)."""
        self._resumed(self.checkpointer.load(path, verify=verify))

    def _resumed(self, notes: list[str]) -> None:
        self.notes = notes
        self.checkpointer.resumed(self.pos)

    def finished(self) -> bool:
        """Nothing left to train at this position under the current --epochs and --max-steps."""
        return self.pos.epoch >= self.cfg.epochs or bool(
            self.cfg.max_steps and self.pos.step >= self.cfg.max_steps
        )

    # ----- one optimizer step -------------------------------------------------------------------------
    def train_step(self, batch: Any) -> Agreed:
        """One optimizer step on one batch, as the loop takes it: forward and backward through DDP (whose
        backward all-reduces the gradients), the per-step all-reduce of the loss and of every rank's signal
        votes, then the optimizer (skipped when the agreed loss is not finite or rank 0 cannot save). A
        collective: every rank calls it with its own batch."""
        return self.accumulated_step([batch], 1)

    def accumulated_step(self, micro_batches: Iterable[Any], count: int) -> Agreed:
        """One optimizer step over `count` micro-batches (--grad-accum): the gradients of all but the last
        accumulate locally (`no_sync`) and the last one's backward all-reduces them, once per step. The beacon
        follows each phase and the straggler window gets its time split; `micro_batches` is read lazily, so
        loading data (the loader iterator, timed as data loading) happens between micro-steps."""
        self._step_loss.zero_()
        done = 0
        window, beacon = self.window, self.beacon
        self._step_extras = {}
        for batch in micro_batches:
            done += 1
            # The step in the making, said again: a stream's fetch ahead set the beacon's step during the last.
            start = beacon.set(phase.COMPUTE, self.pos.step + 1, long=self.first_step)
            self._grads_ready = 0.0
            self._step_loss += self._micro_step(batch, 1.0 / count, sync=done == count)
            if done == count:
                # The step's all-reduce comes before the update: every rank learns at this step that some
                # rank's loss is not finite (or that rank 0 cannot save), and nobody applies that update.
                ready = self._grads_ready or time.monotonic()  # no end-of-backward mark (mark_grads=False)
                # A stream's next step is fetched now, so that its end rides in this all-reduce (fetch ahead).
                exhausted = 0.0 if self._prefetch is None else float(not self._prefetch())
                now = beacon.set(phase.STEP_ALLREDUCE, long=self.first_step)
                window.compute_s += ready - start
                window.comm_s += now - ready  # what remained of the gradient all-reduce after backward
                agreed = self._agree(self._step_loss, count, exhausted)
                start = beacon.set(phase.OPTIMIZER, long=self.first_step)
                window.comm_s += start - now
                self.step_lr = float(
                    self.optimizer.param_groups[0]["lr"]
                )  # this step's (the scheduler's next)
                if math.isfinite(agreed.loss_sum) and not agreed.saving:
                    self._optimizer_step()
                else:
                    self.optimizer.zero_grad(set_to_none=True)  # never applied: a poisoned or a last update
                window.compute_s += time.monotonic() - start
                window.steps += 1
                self.first_step = False
                return agreed
            window.compute_s += time.monotonic() - start
        raise RuntimeError(f"internal error: {done} micro-batch(es) came for an optimizer step of {count}")

    def _micro_step(self, batch: Any, scale: float, sync: bool) -> torch.Tensor:
        if not self._checked:  # before anything else uses it: a usage error names the element (exit 2)
            batching.check(batch)
            self._checked = True
        batch = batching.to_device(batch, self.device)
        strategy = self.strategy
        # no_sync on all but the last micro-batch: gradients accumulate locally, one synchronisation per step.
        with contextlib.nullcontext() if sync else strategy.no_sync():
            with strategy.autocast():
                loss, extras = self._forward(strategy.wrapped, batch)
            if not loss.requires_grad:
                raise UsageError(
                    "the training step's loss does not require gradients (computed under torch.no_grad() or "
                    "inference_mode(), detached, or from no trainable parameter): backward cannot train the "
                    "model. Fix: compute the loss from the model's output with gradients on"
                )
            scaled = loss * scale
            if sync and self.mark_grads:
                strategy.on_backward_end(scaled, self._mark_grads_ready)
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if self.metric_names is None:
            self._agree_names(sorted(extras))
        for name in self.metric_names or ():
            value = extras[name]
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            self._step_extras[name] = self._step_extras.get(name, 0.0) + value  # type: ignore[assignment]
        return loss.detach()

    def _forward(self, model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch's loss and extra metrics: Task.step(model, batch), or loss_fn(model(input), target)."""
        if self.step_fn is not None:
            return _loss_and_extras(self.step_fn(model, batch), self.metric_names)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise UsageError(
                f"Task.loss_fn needs (input, target) batches, but a batch is {_kind(batch)}. Fix: give "
                "Task.step(model, batch) -> loss instead of loss_fn, which takes a batch of any structure"
            )
        inputs, target = batch
        return _loss_and_extras(self.loss_fn(model(inputs), target), [])  # type: ignore[misc]

    def _agree_names(self, names: list[str]) -> None:
        """Once, at the first micro-batch: every rank's step must return the same extra metrics (they ride in
        the per-step all-reduce by position)."""
        agree_names(
            names,
            self.env,
            lambda theirs, rank: (
                f"Task.step returned the metrics {names} on rank {self.env.rank} but {theirs} "
                f"on rank {rank}. Fix: return the same names on every rank and every step"
            ),
        )
        self.metric_names = names

    def _optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.clip_grad > 0:
            self.strategy.clip_grad_norm(self.cfg.clip_grad)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if (
            self.scheduler is not None and not self.plateau
        ):  # once per applied optimizer step, never per micro-batch
            self.scheduler.step()
        # set_to_none even with DDP's bucket views (hpc_ddp.bench: mlp, 2 CPU ranks, ~1350 -> ~1460 samples/s):
        # backward then hands DDP a fresh gradient that it copies into the bucket once and re-views, instead
        # of a memset of every bucket here plus an in-place add during backward.
        self.optimizer.zero_grad(set_to_none=True)

    def _agree(self, loss_sum: torch.Tensor, count: int, exhausted: float = 0.0) -> Agreed:
        """The one per-step all-reduce: loss and micro-batch counts, every rank's signal votes, and whether a
        background writer gave up (checked without waiting; it also starts a retry that is due)."""
        requeue, stop = preemption.pending()
        saving = self.checkpointer.check()  # idle on the ranks that write nothing
        packet = torch.stack(
            [
                loss_sum.float(),
                torch.tensor(float(count), device=self.device),
                torch.tensor(float(requeue), device=self.device),
                torch.tensor(float(stop), device=self.device),
                torch.tensor(saving, device=self.device),
                torch.tensor(exhausted, device=self.device),
                *(
                    torch.as_tensor(self._step_extras[name], dtype=torch.float32, device=self.device)
                    for name in self.metric_names or ()
                ),
            ]
        )
        dist.all_reduce(packet)
        values = packet.tolist()
        return Agreed(values[0], values[1], values[2], values[3], values[4], values[5], tuple(values[6:]))

    def _nonfinite(self, loss: float, step: int) -> None:
        """The loss of `step`, averaged over all ranks, is NaN or infinite (every rank sees the same value):
        its update was not applied. Stop (raise NonFinite), or with --nonfinite-loss skip go on without it."""
        value = "NaN" if math.isnan(loss) else ("+inf" if loss > 0 else "-inf")
        where = f"step {step} (epoch {self.pos.epoch})"
        if self.cfg.nonfinite_loss == "skip" and self.skipped < MAX_SKIPPED:
            self.skipped += 1
            if self.env.is_main:
                self.log.warn(
                    f"{where}: the loss averaged over all ranks is {value}; that step's update was "
                    f"skipped (--nonfinite-loss skip; {self.skipped} in a row, the run stops at "
                    f"{MAX_SKIPPED + 1})"
                )
            return
        kept = self._kept()  # waits for the save in flight, and records it
        # The run stops here, whatever --nonfinite-loss says: the run's last record, after that save's.
        self.metrics.nonfinite(self.pos, step, "stop")
        if self.skipped:
            broken = self.strategy.nonfinite_parameters()  # every rank is here, at this step
            names = ", ".join(broken[:3]) + (", ..." if len(broken) > 3 else "")
            weights = (
                f"the weights themselves are not finite ({names})"
                if broken
                else "the weights are finite (none of those updates was applied): the data or the loss "
                "function gives it"
            )
            cause = (
                f"{where}: the loss averaged over all ranks was not finite in {self.skipped + 1} steps in a "
                f"row ({value} now); {weights}"
            )
        else:
            cause = (
                f"{where}: the loss averaged over all {self.env.world_size} ranks is {value} (a rank's loss "
                "or data became NaN/inf, or the learning rate is too high)"
            )
        raise NonFinite(
            f"{cause}. The run stopped before applying that update and saved nothing after the last "
            f"finite step ({kept}). Fix: check the data, a smaller --lr or --clip-grad; "
            "--nonfinite-loss skip drops such steps instead"
        )

    def _kept(self) -> str:
        """What the stop leaves, in the same words on every rank (a collective): rank 0 first waits for the
        write in flight, so that the checkpoint it names is durable (and one that just became so is named)."""
        self.beacon.set(phase.CHECKPOINT)  # the others wait for rank 0's write: no hang
        words: list[Any] = [None]
        if self.env.is_main:
            last = self.checkpointer.last_durable()
            text = f"the last checkpoint, {last.name}, is kept" if last else "no checkpoint was written"
            if (self.folder / MODEL).is_file():
                text += ", model.pth is untouched"
            words[0] = text
        if self.env.world_size > 1:
            dist.broadcast_object_list(words, src=0)
        return str(words[0])

    def _periodic_save(self, due: bool) -> None:
        """A save the schedule asks for now (`due`), or one it asked for during a run of skipped steps: not
        while the newest step's update was skipped (--nonfinite-loss skip), so that a stop after such a run
        has saved nothing after the last finite step; it comes at the next finite step."""
        self.save_due = self.save_due or due
        if self.save_due and not self.skipped:
            self.save()

    def _epoch(self, epoch: int) -> Outcome | None:
        """Train the rest of one epoch; an Outcome if the loop must end inside it."""
        cfg, pos = self.cfg, self.pos
        self.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one after a restart
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # a dataset that draws per epoch (augmentations, its own order)
        if self.iterable:
            return self._stream_epoch(epoch)
        self.skip.skip, self.skip.epoch = pos.batch * cfg.batch_size, epoch
        # Modulo 2**64: the same seed torch derives from a negative or small value, and no overflow for a large
        # --seed (any 64-bit seed is valid).
        self.loader_gen.manual_seed((cfg.seed * 1_000_003 + epoch) % 2**64)
        batches = self._timed(iter(self.loader))
        while pos.batch < self.batches_per_epoch:
            # A resumed epoch starts at a step boundary; the epoch's last step may have fewer micro-batches.
            size = min(cfg.grad_accum, self.batches_per_epoch - pos.batch)
            agreed = self.accumulated_step(itertools.islice(batches, size), size)
            ended = self._after_step(agreed, size)
            if ended is not None:
                return ended
        return None

    def _stream_epoch(self, epoch: int) -> Outcome | None:
        """One epoch of an IterableDataset: until some rank's stream has no next step. Each step's batches are
        fetched during the step before (fetch ahead), and whether every rank has them rides in the per-step
        all-reduce: every rank ends the epoch after the same step, and none waits for a peer that left."""
        cfg, pos = self.cfg, self.pos
        loaded, self._stream_loaded = self._stream_loaded, None
        by_loader = loaders.saved_by_loader(loaded)  # the state of a StatefulDataLoader, or of the dataset
        stream = self.stream
        assert stream is not None
        stream.start(epoch)  # the epoch's batches seed themselves from (epoch, reader, batch number)
        if pos.batch and self.stateful and loaded is not None and not by_loader:
            stream.load_state_dict(loaded)  # type: ignore[attr-defined]  # where its next step begins
        elif pos.batch and self.loader_states and by_loader:
            self.loader.load_state_dict(loaders.unwrap(loaded))  # every worker's, where its next step begins
        elif pos.batch:  # resumed mid-epoch: a stream without a state cannot be positioned
            why = (
                "it has no state_dict()/load_state_dict()"
                if not loaders.has_state(self.dataset)
                else "it is read by DataLoader workers and torchdata is not installed (pip install 'hpc-ddp[data]')"
                if not self.stateful and not self.loader_states
                else "its state was saved with another --num-workers (0 or not)"
            )
            self.log.main(
                f"the IterableDataset cannot be resumed mid-epoch: epoch {epoch} restarts from its beginning "
                f"(at step {pos.step}; its first {pos.batch} batches per rank are trained on again): {why}"
            )
            pos.batch, pos.loss_sum, pos.loss_count = 0, 0.0, 0.0
        self.loader_gen.manual_seed((cfg.seed * 1_000_003 + epoch) % 2**64)
        batches = self._timed(iter(self.loader))
        size = cfg.grad_accum

        def fetch() -> bool:
            """The next step's batches, read ahead: on generators of their own (read in this process, the
            stream's draws would otherwise move the training's between the step and its checkpoint)."""
            nonlocal ahead
            self._snapshot()
            with rng.isolated(self.device) if not self.workers else contextlib.nullcontext():
                ahead = list(itertools.islice(batches, size))
            return len(ahead) == size

        ahead: list[Any] = []
        fetch()
        flag = torch.tensor(float(len(ahead) < size), device=self.device)
        dist.all_reduce(flag)  # once an epoch: does every rank have a first step?
        more = flag.item() == 0

        while more:
            current = ahead
            self._prefetch = fetch
            try:
                agreed = self.accumulated_step(iter(current), size)
            finally:
                self._prefetch = None
            more = not agreed.exhausted
            ended = self._after_step(agreed, size, last=not more)
            if ended is not None:
                return ended
        return None

    def _snapshot(self) -> None:
        """A stateful stream's state before the next step's batches are fetched: what a save at the end of
        the current step holds (the batches fetched ahead are not trained on yet)."""
        if self.stateful:
            self._stream_state = copy.deepcopy(self.stream.state_dict())  # type: ignore[union-attr]
        elif self.loader_states:  # every worker's, as of the last batch this process took
            self._stream_state = loaders.wrap(copy.deepcopy(self.loader.state_dict()))

    def _after_step(self, agreed: Agreed, size: int, last: bool = False) -> Outcome | None:
        """What every rank does after an optimizer step of `size` micro-batches, the same way; an Outcome if
        the loop must end here. `last`: the epoch's last step of a stream."""
        cfg, pos = self.cfg, self.pos
        finite = math.isfinite(agreed.loss_sum)
        if not finite:
            self._nonfinite(agreed.loss_sum, pos.step + 1)  # raises, unless --nonfinite-loss skip
        if agreed.saving:
            raise self.checkpointer.stop(agreed.saving, pos.step)
        if finite:
            self.skipped = 0
            pos.loss_sum, pos.loss_count = pos.loss_sum + agreed.loss_sum, pos.loss_count + agreed.count
        pos.batch, pos.step = pos.batch + size, pos.step + 1
        self.metrics.step(
            pos,
            agreed.loss_sum / max(agreed.count, 1.0),
            cfg.batch_size * size * self.env.world_size,
            self.step_lr,
            self.step_data_s,
            {
                n: v / max(agreed.count, 1.0)
                for n, v in zip(self.metric_names or (), agreed.extras, strict=True)
            },
        )
        self.step_data_s = 0.0
        self.checkpointer.record_ended(only_if_written=True)  # rank 0 records a save once it is durable
        finished = bool(cfg.max_steps and pos.step >= cfg.max_steps)  # evaluated at the end, by run()
        evaluate = (
            cfg.eval_every_steps
            and pos.step % cfg.eval_every_steps == 0
            and pos.batch < self.batches_per_epoch
            and not last
            and not finished
            and self.evaluator is not None
        )
        if agreed.requeue or agreed.stop:
            # The step's evaluation is still due: the checkpoint says so, and the resume runs it first.
            pos.eval_pending = bool(evaluate)
            return Outcome(False, agreed.requeue, agreed.stop)
        if pos.step % stragglers.EVERY_STEPS == 0 and self.env.world_size > 1:
            self.check_stragglers()
        if finished:
            return Outcome(True)
        if evaluate:
            stopped = self.evaluate()
            if stopped is not None:
                return stopped
        self._periodic_save(bool(cfg.save_every_steps and pos.step % cfg.save_every_steps == 0))
        return None

    # ----- evaluation ----------------------------------------------------------------------------------------
    def _eval_due(self, last: bool) -> bool:
        """At the end of an epoch: evaluate at the end of training, every --eval-every-epochs, and at a step
        of --eval-every-steps (the epoch's last step is evaluated here, after the epoch's end)."""
        cfg, pos = self.cfg, self.pos
        if self.evaluator is None or self._evaluated == pos.step:
            return False
        epochs = cfg.eval_epochs()  # --eval-every-steps alone: evaluations come by steps instead
        every_epoch = epochs and (pos.epoch + 1) % epochs == 0
        every_step = cfg.eval_every_steps and pos.step % cfg.eval_every_steps == 0
        return bool(last or every_epoch or every_step)

    def evaluate(self) -> Outcome | None:
        """Evaluate at the current position (a collective); an Outcome if a signal came during it: every rank
        then stops right after it, and the position says it is pending (the resume evaluates first)."""
        assert self.evaluator is not None
        pos = self.pos
        pos.eval_pending = True
        result = self.evaluator.run(pos.step)
        if result.requeue or result.stop:
            return Outcome(False, result.requeue, result.stop)
        pos.eval_pending = False
        self._evaluated = pos.step
        new_best = self.best is not None and self.best.offer(pos.step, result.means)
        if new_best:
            # The save at this step is due (it comes right after, at the same step) and will be the best. A
            # checkpoint of this step written before its evaluation (the resume of one stopped during it, an
            # epoch's last step saved before the epoch's evaluation) is not written again: it becomes the best.
            self.save_due = True
        if self.plateau:  # ReduceLROnPlateau: stepped with the evaluation's --plateau-metric value
            first = self.scheduler.last_epoch == 0
            schedules.after_evaluation(self.scheduler, result.means, self.cfg.plateau_metric, first)
        self.metrics.eval(pos, result.samples, result.means)
        shown = " | ".join(f"{name} {value:.4f}" for name, value in result.means.items())
        self.log.main(f"Eval at step {pos.step} (epoch {pos.epoch}, {result.samples} samples): {shown}")
        if new_best and self.best is not None:  # --keep-best made visible: a line and a "best" record
            self.metrics.best(pos, self.best.name, self.best.value, self.best.mode)
            self.log.main(
                f"New best {self.best.name} {self.best.value:.4f} ({self.best.mode}) at step {pos.step}: its "
                "checkpoint is saved now and kept as checkpoints/best"
            )
        return None

    def _eval_loss(self, model: Any, batch: Any) -> torch.Tensor:
        """The evaluation's value without Task.eval_step: the training loss of the batch."""
        return self._forward(model, batch)[0]

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loader's batches, each fetched in the beacon's "data loading" phase and timed. The first batch of
        an epoch is a long phase for the hang watchdog: the loader's workers start (and open their data)."""
        first = True
        while True:
            # the step in the making, counted from 1
            start = self.beacon.set(phase.DATA, self.pos.step + 1, long=first or self.first_step)
            first = False
            try:
                batch = next(batches)
            except StopIteration:
                return
            waited = time.monotonic() - start
            self.window.data_s += waited
            self.step_data_s += waited
            yield batch

    def check_stragglers(self) -> None:
        """Every EVERY_STEPS steps, on every rank at the same step: all-gather each rank's time split of the
        window (one fixed-size row) and judge it the same way everywhere; rank 0 names a straggler."""
        self.beacon.set(phase.STRAGGLER_GATHER)
        mine = torch.tensor(self.window.row(), dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(rows, mine)
        self.window.reset()
        table = [row.tolist() for row in rows]
        self.metrics.ranks(self.pos, table)  # rank 0 records every rank's split (the report's heat map)
        for slow in self.judge.add(table):
            host = self.peers[slow.rank][0]
            self.log.main(stragglers.describe(slow, host, self.pos.step))
            self.metrics.straggler(self.pos, slow.rank, host, slow.phase, slow.slower)

    def run(self) -> Outcome:
        """Train from `self.pos` to the end, or until every rank agreed to stop."""
        if self.pos.eval_pending:  # stopped during the evaluation at this step, or before it: it comes first
            self.log.main(
                f"the evaluation at step {self.pos.step} was stopped by the signal (or not begun): it runs first"
            )
            stopped = self.evaluate()
            if stopped is not None:
                return stopped
            self._periodic_save(False)  # --keep-best: a new best is saved at its step
        if self.finished():  # never one more step than --max-steps, also after a resume
            return Outcome(True)
        while self.pos.epoch < self.cfg.epochs:
            outcome = self._epoch(self.pos.epoch)
            if outcome is not None and not outcome.finished:
                return outcome
            if self._eval_due(last=outcome is not None or self.pos.epoch + 1 >= self.cfg.epochs):
                stopped = self.evaluate()
                if stopped is not None:
                    return stopped
            mean = self.pos.loss_sum / max(self.pos.loss_count, 1.0)
            self.metrics.epoch(self.pos, mean)  # first: it erases the live progress line
            self.log.main(f"Epoch {self.pos.epoch}, Loss: {mean:.4f}")
            if outcome is not None:  # --max-steps reached inside the epoch
                return outcome
            self.pos = Position(epoch=self.pos.epoch + 1, step=self.pos.step)
            self._periodic_save(
                bool(self.cfg.save_every_epochs and self.pos.epoch % self.cfg.save_every_epochs == 0)
            )
        return Outcome(True)


def _kind(value: Any) -> str:
    return type(value).__name__ + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")


def _loss_and_extras(out: Any, names: list[str] | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """What a step returned: a scalar loss tensor, or (loss, {"name": value}); a usage error otherwise."""
    extras: Any = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, extras = out
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        found = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else _kind(out)
        raise UsageError(
            f"the training step returned {found} as its loss; expected a scalar tensor. Fix: reduce it "
            '(e.g. loss.mean()), and return loss or (loss, {"name": value, ...})'
        )
    for name, value in extras.items():
        if not isinstance(name, str) or not (
            isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        ):
            raise UsageError(
                f"Task.step returned the metric {name!r}: {_kind(value)}; expected a number or a scalar tensor "
                "named by a string"
            )
    if names is not None and sorted(extras) != names:
        raise UsageError(
            f"Task.step returned the metrics {sorted(extras)} after {names} at the first step. Fix: return "
            "the same names at every step"
        )
    return out.reshape(()), extras


def loader_options(cfg: TrainConfig, device: torch.device, workers: int) -> dict[str, Any]:
    """The DataLoader settings a user tunes, for the training and the evaluation loaders: --num-workers,
    --pin-memory (auto: on a GPU), --prefetch-factor (with workers only: torch refuses it without)."""
    pin = cfg.pin_memory == "on" or (cfg.pin_memory == "auto" and device.type == "cuda")
    options: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": pin,
        "worker_init_fn": worker_start if workers else None,
        # Workers start once, not at every epoch: a start that opens shards or sockets is paid once.
        "persistent_workers": workers > 0,
    }
    if workers and cfg.prefetch_factor:
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


def _best(cfg: TrainConfig, task: Task) -> best_of.Best | None:
    """--keep-best's tracker; a usage error now when the task cannot report NAME (known before training)."""
    rule = cfg.best_rule()
    if rule is None:
        return None
    best = best_of.Best(*rule)
    if task.eval_dataset is None:
        raise UsageError(
            f"{best.flag}: the task has no evaluation (no Task.eval_dataset). Fix: drop --keep-best, or give "
            "the task an eval_dataset"
        )
    if task.eval_step is None:  # the evaluation reports the loss only
        best.check_names(["loss"])
    return best


def _scheduler(task: Task, cfg: TrainConfig, optimizer: Any, total: int | None) -> Any | None:
    """Task.scheduler(optimizer, total_steps), or --lr-schedule/--warmup-steps; a usage error for a factory
    that raises or returns something that cannot step and save, or a ReduceLROnPlateau that nothing can step
    (the same on every rank: never retried). `total` None: no known end (a stream without --max-steps)."""
    if task.scheduler is None:
        return schedules.build(cfg.lr_schedule, cfg.warmup_steps, optimizer, total or 0)
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        raise UsageError(
            f"--lr-schedule {cfg.lr_schedule} --warmup-steps {cfg.warmup_steps}: this task brings its own "
            "Task.scheduler, which would be replaced. Fix: drop those flags, or Task.scheduler"
        )
    try:
        scheduler = schedules.from_task(task.scheduler, optimizer, total)
    except Exception as e:
        unknown = (
            " (total_steps is None: the dataset is a stream, which has no length, and --max-steps is not set. "
            "Fix: add --max-steps N, or a schedule that needs no total)"
            if total is None
            else ""
        )
        raise UsageError(f"Task.scheduler(optimizer, {total}) raised {type(e).__name__}: {e}{unknown}") from e
    if schedules.is_plateau(scheduler):
        reports = ["loss"] if task.eval_step is None else None
        schedules.check_plateau(cfg.plateau_metric, task.eval_dataset is not None, reports)
    return scheduler
