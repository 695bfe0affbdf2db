"""Evaluation inside the loop: each rank evaluates its exact shard (hpc_ddp.run.loop.evaluation), every rank runs the
same number of forwards (padding batches, whose results are dropped), and one all-reduce gives every rank the
means over all evaluated samples, by the one weighting rule (hpc_ddp.run.loop.evaluation): a value is a mean over
its batch's samples, counted as the items the loader collated into it (`Counted`), or a (total, weight) pair.
The names are those any rank reported in this evaluation (one all-gather): a name some batches do not report
is averaged over those that do, and one no batch reported is missing from the result.

That all-reduce also carries every rank's preemption votes, as the per-step one does: a signal that comes
during an evaluation stops every rank at the same point, right after it, with the evaluation not recorded (the
position says it is pending, and the resume evaluates again before training on: no finished training step is
repeated).

An `IterableDataset` (a stream) has no length to shard or to agree on: each rank evaluates its own part of it
(the dataset reads hpc_ddp.run.data.streams.reader(), as for training), each sample once, and the ranks go in
lockstep, one small all-reduce per batch saying which ranks still have one. A rank whose part has ended
evaluates a padding batch (its own first, dropped) until every part has; a rank whose part is empty from the
start gets the first batch of the lowest rank that has one (one broadcast, only then). Uneven parts end together,
and no rank waits in a collective for a peer that left.

Batches of --eval-batch-size samples (0: --batch-size): no gradients are kept, so it may be larger.

Model: `model.eval()` under `torch.no_grad()` (and the strategy's autocast), back to `train()` after.

Randomness: an evaluation runs on generators of its own, seeded from --seed and its step (rng.isolated), and
gives the training's back untouched: what it draws (a step that masks its input, sampling) never moves the
training's streams, and an evaluation cut short by a signal runs again with the same draws. Its loaders have
their own generator, and a dataset read by DataLoader workers seeds each batch from the step and its position
(hpc_ddp.run.data.seeding), so a worker's draws are the same whichever run, and whenever, it evaluates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Subset, default_collate

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run.callbacks import Callbacks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.data import batches as batching
from hpc_ddp.run.data import loaders, seeding
from hpc_ddp.run.loop import evaluation, preemption, rng, schedules
from hpc_ddp.run.loop.best import Best
from hpc_ddp.run.loop.position import Outcome, Position
from hpc_ddp.run.records import progress
from hpc_ddp.run.records.metrics import Recorder
from hpc_ddp.run.strategy.base import Strategy
from hpc_ddp.run.tasks import Task
from hpc_ddp.run.watch import beacon as phase
from hpc_ddp.run.watch.beacon import Beacon


class Result:
    def __init__(self, samples: int, means: dict[str, float], requeue: float, stop: float) -> None:
        self.samples, self.means, self.requeue, self.stop = samples, means, requeue, stop


class Evaluator:
    """The evaluation of one rank: its shard's loader, and `run()` (a collective)."""

    def __init__(
        self,
        task: Task,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        strategy: Strategy,
        loss_of: Callable[[Any, Any], torch.Tensor],
        beacon: Beacon,
        options: dict[str, Any],
    ) -> None:
        dataset = task.eval_dataset
        assert dataset is not None
        self.env, self.device, self.strategy, self.beacon = env, device, strategy, beacon
        self.eval_step, self.loss_of = task.eval_step, loss_of
        self.seed = cfg.seed
        batch_size = cfg.eval_batch_size or cfg.batch_size
        self.stream = isinstance(dataset, IterableDataset)
        workers = bool(options.get("num_workers"))
        self.keys: list[loaders.Keyed] = []  # the samplers that carry the step to the workers

        def loader(data: Any, **more: Any) -> DataLoader[Any]:
            sampler = None
            if workers and not self.stream:  # each batch seeded in its worker from the step and its index
                sampler = loaders.Keyed(len(data))
                self.keys.append(sampler)
                data = seeding.SeededBatches(data, cfg.seed, seeding.EVAL)
            return DataLoader(
                data,
                batch_size=batch_size,
                sampler=sampler,
                drop_last=False,
                collate_fn=Counted(task.collate_fn),  # each batch with its count of samples
                generator=torch.Generator(),  # never the global RNG (see the module docstring)
                **{**options, **more},
            )

        self.seeded: seeding.SeededStream | None = None
        if self.stream:  # the dataset shards itself (streams.reader); the ranks agree batch by batch
            self.seeded = seeding.SeededStream(dataset, cfg.seed, seeding.EVAL, batch_size)
            # Workers that start with each evaluation: the step reaches them in their copy of the stream.
            self.loader = loader(self.seeded, **({"persistent_workers": False} if workers else {}))
            self.batches = 0
        else:
            size = len(dataset)  # type: ignore[arg-type]
            mine = evaluation.shard(size, env.rank, env.world_size)
            # Rank 0's shard is the largest: every rank knows the agreed number of batches without a collective.
            self.batches = evaluation.batches_of(len(evaluation.shard(size, 0, env.world_size)), batch_size)
            self.loader = loader(Subset(dataset, mine))  # type: ignore[arg-type]
            self.padding = loader(Subset(dataset, range(min(size, 1))))  # type: ignore[arg-type]

    def close(self) -> None:
        """End the loaders' DataLoader workers now (hpc_ddp.run.data.loaders.shut_down)."""
        for name in ("loader", "padding"):
            if name in self.__dict__:
                loaders.shut_down(self.__dict__[name])

    def run(self, step: int) -> Result:
        """Evaluate this rank's shard; every rank gets the same Result (the means over all ranks' samples)."""
        model = self.strategy.wrapped
        self.strategy.sync_buffers()  # every rank evaluates with the same (rank 0's) running statistics
        means = evaluation.Means()
        was_training = model.training
        model.eval()
        for keyed in self.keys:
            keyed.key = step
        if self.seeded is not None:
            self.seeded.start(step)
        try:
            with torch.no_grad(), rng.isolated(self.device, seeding.derive(self.seed, seeding.EVAL, step)):
                if self.stream:
                    self._stream(model, means, step)
                else:
                    self._shard(model, means, step)
        finally:
            model.train(was_training)
        self.beacon.set(phase.EVAL_ALLREDUCE, step)
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, means.names())  # the names any rank reported, in one order
        names = sorted({name for theirs in everyone for name in theirs})
        requeue, stop = preemption.pending()
        totals = [*means.totals(names), float(requeue), float(stop)]
        packet = torch.tensor(totals, dtype=torch.float64, device=self.device)
        dist.all_reduce(packet)
        values = packet.tolist()
        samples, result = evaluation.Means.result(names, values[:-2])
        return Result(samples, result, values[-2], values[-1])

    def _shard(self, model: Any, means: evaluation.Means, step: int) -> None:
        """A map-style dataset: this rank's shard, then padding batches up to the agreed number."""
        done = 0
        first: Any = None
        for counted in self.loader:
            self.beacon.set(phase.EVALUATION, step)
            first = counted if first is None else first
            self._add(model, counted, means)
            done += 1
        while done < self.batches:  # padding: the same number of forwards on every rank
            self.beacon.set(phase.EVALUATION, step)
            _, batch = first if first is not None else next(iter(self.padding))
            self._add(model, (0, batch), means)
            done += 1

    def _stream(self, model: Any, means: evaluation.Means, step: int) -> None:
        """An IterableDataset: batch by batch in lockstep, until no rank has one (see the module docstring)."""
        batches = iter(self.loader)
        first: Any = None
        rank, world = self.env.rank, self.env.world_size
        for round_ in itertools.count():
            self.beacon.set(phase.EVALUATION, step)
            batch = next(batches, None)
            have = torch.zeros(world, dtype=torch.float32, device=self.device)
            have[rank] = float(batch is not None)
            self.beacon.set(phase.EVAL_ALLREDUCE, step)
            dist.all_reduce(have)  # which ranks still have a batch: the same answer everywhere
            flags = have.tolist()
            self.beacon.set(phase.EVALUATION, step)
            if not any(flags):
                return
            if round_ == 0 and not all(flags):
                # Some rank's part is empty: every rank knows it from the same flags and joins the broadcast of
                # the lowest such rank's first batch, its padding. Once: after it every rank has a `first`.
                self.beacon.set(phase.EVAL_ALLREDUCE, step)
                box = [batch if rank == flags.index(1.0) else None]
                dist.broadcast_object_list(box, src=flags.index(1.0))
                self.beacon.set(phase.EVALUATION, step)
                first = box[0]
            if batch is not None:
                first = batch if round_ == 0 else first
                self._add(model, batch, means)
            else:
                self._add(model, (0, first[1]), means)

    def _add(self, model: Any, counted: tuple[int, Any], means: evaluation.Means) -> None:
        """One batch, (its samples, the batch) as `Counted` gives it: 0 samples for a padding batch."""
        samples, batch = counted
        batch = batching.to_device(batch, self.device)
        with self.strategy.autocast():
            if self.eval_step is not None:
                values = self.eval_step(model, batch)
            else:
                values = {"loss": self.loss_of(model, batch)}
        if not isinstance(values, dict) or not all(
            isinstance(k, str) and (_scalar(v) or (isinstance(v, (tuple, list)) and all(map(_scalar, v))))
            for k, v in values.items()
        ):
            raise UsageError(
                f'Task.eval_step returned {_shown(values)}; expected {{"name": value}} with numbers or scalar '
                'tensors (means over the batch), or (total, weight) pairs, e.g. {"loss": (loss_sum, tokens)}'
            )
        try:
            means.add(values, samples)
        except ValueError as e:
            raise UsageError(f"Task.eval_step returned {e}") from e


class Counted:
    """The evaluation loaders' collate_fn: the user's (or torch's default), and how many samples it collated,
    the batch's weight whatever its structure (hpc_ddp.run.loop.evaluation)."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate if collate is not None else default_collate

    def __call__(self, items: list[Any]) -> tuple[int, Any]:
        return len(items), self.collate(items)


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _shown(values: Any) -> str:
    """What eval_step returned, for the error: its kind, and the first entry that is not a scalar or a pair."""
    if not isinstance(values, dict):
        return type(values).__name__
    for k, v in values.items():
        if not isinstance(k, str):
            return f"the key {k!r}"
        if not (_scalar(v) or (isinstance(v, (tuple, list)) and all(map(_scalar, v)))):
            shape = f" of shape {list(v.shape)}" if isinstance(v, torch.Tensor) else ""
            return f"{k!r}: {type(v).__name__}{shape}"
    return "dict"


def agree_names(names: list[str], env: DistEnv, mismatch: Callable[[Any, int], str]) -> None:
    """Every rank returned the same value names (a step's extras, an evaluation's means): their values ride in
    an all-reduce by position, so a rank with other names would add up unrelated numbers. One all-gather; a
    mismatch is the user's to fix (`mismatch(their names, their rank)` says how), on every rank alike."""
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, names)
    for rank, theirs in enumerate(everyone):
        if theirs != names:
            raise UsageError(mismatch(theirs, rank))


class Evaluations:
    """When the loop evaluates (hpc_ddp.run.loop.evaluation: pure, the same on every rank) and what an evaluation
    changes: the best so far (--keep-best), a ReduceLROnPlateau schedule (stepped with the evaluation's
    --plateau-metric value), the "eval" and "best" records and rank 0's lines. Without an evaluator (a task
    without eval_dataset) nothing is ever due."""

    def __init__(
        self,
        evaluator: Evaluator | None,
        cfg: TrainConfig,
        best: Best | None,
        plateau: Any | None,
        metrics: Recorder,
        log: RankLog,
        callbacks: Callbacks | None = None,
    ) -> None:
        self.evaluator, self.cfg, self.best, self.plateau = evaluator, cfg, best, plateau
        self.metrics, self.log, self.callbacks = metrics, log, callbacks
        self.last = -1  # the step this process last evaluated at

    def after_step(self, pos: Position, mid_epoch: bool, last: bool, finished: bool) -> bool:
        """Whether an evaluation is due right after the step of `pos` (see evaluation.due_after_step)."""
        every = self.cfg.eval_every_steps
        return self.evaluator is not None and evaluation.due_after_step(
            every, pos.step, mid_epoch, last, finished
        )

    def after_epoch(self, pos: Position, last: bool) -> bool:
        """Whether one is due at the end of the epoch of `pos`, unless its step was evaluated already."""
        cfg = self.cfg
        if self.evaluator is None or self.last == pos.step:
            return False
        return evaluation.due_after_epoch(cfg.eval_epochs(), cfg.eval_every_steps, pos.epoch, pos.step, last)

    def run(self, pos: Position) -> tuple[Outcome | None, bool]:
        """Evaluate at `pos` (a collective): (an Outcome if a signal came during it, whether it is a new best).
        A stopped evaluation is pending in `pos` (the resume evaluates first) and every rank stops right after.
        A new best makes the save at this step due (it comes right after, at the same step, and is the best); a
        checkpoint of this step written before the evaluation (the resume of one stopped during it, an epoch's
        last step saved before the epoch's evaluation) is not written again: it becomes the best."""
        assert self.evaluator is not None
        pos.eval_pending = True
        result = self.evaluator.run(pos.step)
        if result.requeue or result.stop:
            return Outcome(False, result.requeue, result.stop), False
        pos.eval_pending = False
        self.last = pos.step
        best = self.best
        new_best = best is not None and best.offer(pos.step, result.means)
        if self.plateau is not None:
            first = self.plateau.last_epoch == 0
            schedules.after_evaluation(self.plateau, result.means, self.cfg.plateau_metric, first)
        self.metrics.eval(pos, result.samples, result.means)
        shown = " | ".join(f"{name} {progress.value_text(value)}" for name, value in result.means.items())
        self.log.main(f"Eval at step {pos.step} (epoch {pos.epoch}, {result.samples} samples): {shown}")
        if new_best and best is not None:  # --keep-best made visible: a line and a "best" record
            self.metrics.best(pos, best.name, best.value, best.mode)
            self.log.main(
                f"New best {best.name} {progress.value_text(best.value)} ({best.mode}) at step {pos.step}: its "
                "checkpoint is saved now and kept as checkpoints/best"
            )
        if self.callbacks is not None:  # the evaluation is done and recorded: the task's hooks see its means
            self.callbacks.call("on_eval_end", pos.step, pos.epoch, result.means)
        return None, new_best

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
