"""The training data of one rank: its sampler, its loader and workers, and where a resumed epoch goes on.

A map-style dataset is split over the ranks by a DistributedSampler, reshuffled every epoch (`set_epoch`), the
same shuffle after a restart; a resumed epoch skips the samples it trained on (`loaders.SkipSampler`). A stream
(an IterableDataset, hpc_ddp.run.data.streams) has no sampler and no length: its epoch ends when some rank's stream
does, and a resumed epoch goes on from the stream's saved state when it has one (`state`, `load`).

The data's own randomness (hpc_ddp.run.data.seeding): a map-style dataset read by workers and every stream seed
each batch from where it is, so a resumed run's batches draw what the uninterrupted run's drew. Read in this
process, a map-style dataset draws from the training's generators, lazily: exact as is. Each epoch's loader
draws its order from an explicit generator seeded from (--seed, epoch): otherwise each DataLoader iterator
draws its seed from the global RNG, and a resumed run's dropout would see another random stream.

What keeps this data from resuming bit for bit is said at start (`not_exact`, hpc_ddp.run.checkpoint.exact).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from hpc_ddp.cluster import placement
from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import UsageError
from hpc_ddp.log import RankLog, count
from hpc_ddp.run.checkpoint import exact
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.data import batches as batching
from hpc_ddp.run.data import forkrisk, loaders, seeding
from hpc_ddp.run.loop import rng
from hpc_ddp.run.loop.clock import StepClock
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.tasks import Task


class Feed:
    def __init__(
        self, cfg: TrainConfig, env: DistEnv, device: torch.device, task: Task, log: RankLog
    ) -> None:
        self.cfg, self.dataset, self.device = cfg, task.dataset, device
        self.iterable = isinstance(task.dataset, IterableDataset)
        if self.iterable or isinstance(task.eval_dataset, IterableDataset):  # streams.reader, in every worker
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.rank), str(env.world_size)
        if self.iterable and cfg.lr_schedule != "constant" and not cfg.max_steps:
            raise UsageError(
                f"--lr-schedule {cfg.lr_schedule} over an IterableDataset needs --max-steps: a stream has "
                "no length to end the schedule at. Fix: add --max-steps N"
            )
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            task.dataset if not self.iterable else range(env.world_size),  # type: ignore[arg-type]
            num_replicas=env.world_size,
            rank=env.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        self.batches_per_epoch = len(self.sampler) // cfg.batch_size if not self.iterable else sys.maxsize
        if self.batches_per_epoch == 0:
            raise UsageError(
                f"each rank gets {len(self.sampler)} samples of the dataset ({count(env.world_size, 'rank')}), "
                f"fewer than --batch-size {cfg.batch_size}. Fix: a smaller --batch-size or fewer ranks"
            )
        # Chosen from the CPUs this rank is pinned to (cluster/placement), which its workers inherit.
        self.workers, note = placement.plan_workers(
            cfg.num_workers, device.type == "cuda", len(placement.current_affinity())
        )
        if note:
            log.main(note)
        risk = forkrisk.note(sys.version_info[:3], self.workers, sys.implementation.name)
        if risk:
            log.main(risk)
        self.options = loaders.loader_options(cfg, device, self.workers)  # the evaluation's loader's too
        self._build_loader(cfg, device, task)
        self.state: Any = None  # a stream's state before the next step's fetch: what a save holds
        self.checked = False  # the first batch, checked before anything uses it
        self.loaded: Any = None  # a stream's state from the checkpoint a resume loaded

    def _build_loader(self, cfg: TrainConfig, device: torch.device, task: Task) -> None:
        # A stream with state_dict()/load_state_dict(): read in this process, the loop saves and loads its state
        # (`stateful`); read by workers, torchdata's StatefulDataLoader does, if installed (`loader_states`;
        # hpc_ddp.run.data.loaders). Either way its state before each step's fetch is saved, and a resume goes on
        # from it; without either its epoch restarts on resume, and says so.
        workers = self.workers
        stream_state = self.iterable and loaders.has_state(task.dataset)
        self.stateful = stream_state and workers == 0
        stateful_loader = loaders.stateful_loader() if stream_state and workers > 0 else None
        self.loader_states = stateful_loader is not None
        self.not_exact = exact.limits(
            stream=self.iterable,
            stream_state=stream_state,
            workers=workers,
            stateful_loader=self.loader_states,
            cuda=device.type == "cuda",
            deterministic=cfg.deterministic,
        )
        self.skip = loaders.SkipSampler(self.sampler, keyed=workers > 0)
        self.generator = torch.Generator()
        stream_kind = seeding.StatefulSeededStream if stream_state else seeding.SeededStream
        self.stream = (
            stream_kind(task.dataset, cfg.seed, seeding.TRAIN, cfg.batch_size) if self.iterable else None
        )
        data: Any = self.stream or (
            seeding.SeededBatches(task.dataset, cfg.seed, seeding.TRAIN) if workers else task.dataset
        )
        options = self.options
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
            generator=self.generator,
        )

    def steps(
        self, epoch: int, pos: Position, clock: StepClock, log: RankLog
    ) -> Iterator[tuple[Iterator[Any], int, Ahead | None]]:
        """The rest of epoch `epoch` from `pos`, one optimizer step at a time: its micro-batches (read lazily,
        timed), how many, and a stream's fetch of the next step (None for a map-style dataset). A map-style
        epoch ends with its batches (the last step may have fewer); a stream's when the step's all-reduce says
        some rank has no next step (the loop stops asking then)."""
        self.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one after a restart
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # a dataset that draws per epoch (augmentations, its own order)
        size = self.cfg.grad_accum
        if self.iterable:
            ahead = Ahead(self, self.stream_epoch(epoch, pos, clock, log), size, self.device)
            flag = torch.tensor(float(not ahead.fetch()), device=self.device)
            dist.all_reduce(flag)  # once an epoch: does every rank have a first step?
            while flag.item() == 0:
                yield iter(ahead.batches_ahead), size, ahead
            return
        batches = self.epoch(epoch, pos, clock)
        while pos.batch < self.batches_per_epoch:
            # A resumed epoch starts at a step boundary; the epoch's last step may have fewer micro-batches.
            count = min(size, self.batches_per_epoch - pos.batch)
            yield itertools.islice(batches, count), count, None

    def _seed(self, epoch: int) -> None:
        # Modulo 2**64: the same seed torch derives from a negative or small value, and no overflow for a large
        # --seed (any 64-bit seed is valid).
        self.generator.manual_seed((self.cfg.seed * 1_000_003 + epoch) % 2**64)

    def epoch(self, epoch: int, pos: Position, clock: StepClock) -> Iterator[Any]:
        """The rest of map-style epoch `epoch` from `pos` (a step boundary), each batch timed."""
        self.skip.skip, self.skip.epoch = pos.batch * self.cfg.batch_size, epoch
        self._seed(epoch)
        return self._checked(clock.timed(iter(self.loader), pos))

    def stream_epoch(self, epoch: int, pos: Position, clock: StepClock, log: RankLog) -> Iterator[Any]:
        """Stream epoch `epoch` from `pos`: from the saved state a resume loaded, or from its beginning when
        the stream cannot be positioned (said once; `pos` then restarts the epoch)."""
        loaded, self.loaded = self.loaded, None
        by_loader = loaders.saved_by_loader(loaded)  # the state of a StatefulDataLoader, or of the dataset
        stream = self.stream
        assert stream is not None
        stream.start(epoch)  # the epoch's batches seed themselves from (epoch, reader, batch number)
        if pos.batch and self.stateful and loaded is not None and not by_loader:
            stream.load_state_dict(loaded)  # type: ignore[attr-defined]  # where its next step begins
        elif pos.batch and self.loader_states and by_loader:
            self.loader.load_state_dict(loaders.unwrap(loaded))  # every worker's, where its next step begins
        elif pos.batch:  # resumed mid-epoch: a stream without a state cannot be positioned
            log.main(
                f"the IterableDataset cannot be resumed mid-epoch: epoch {epoch} restarts from its beginning "
                f"(at step {pos.step}; its first {pos.batch} batches per rank are trained on again): "
                f"{self._why_not()}"
            )
            pos.batch, pos.loss_sum, pos.loss_count = 0, 0.0, 0.0
        self._seed(epoch)
        return self._checked(clock.timed(iter(self.loader), pos))

    def _checked(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, the first of this process checked before anything uses it: a batch the kit cannot move
        to the device is a usage error that names the element (hpc_ddp.run.data.batches)."""
        for batch in batches:
            if not self.checked:
                batching.check(batch)
                self.checked = True
            yield batch

    def _why_not(self) -> str:
        if not loaders.has_state(self.dataset):
            return "it has no state_dict()/load_state_dict()"
        if not self.stateful and not self.loader_states:
            return "it is read by DataLoader workers and torchdata is not installed (pip install 'hpc-ddp[data]')"
        return "its state was saved with another --num-workers (0 or not)"

    def snapshot(self) -> None:
        """A stateful stream's state before the next step's batches are fetched: what a save at the end of
        the current step holds (the batches fetched ahead are not trained on yet)."""
        if self.stateful:
            self.state = copy.deepcopy(self.stream.state_dict())  # type: ignore[union-attr]
        elif self.loader_states:  # every worker's, as of the last batch this process took
            self.state = loaders.wrap(copy.deepcopy(self.loader.state_dict()))

    def load(self, state: Any) -> None:
        """The stream's state from a checkpoint: where the next `stream_epoch` goes on, and what a save holds
        until then (a run resumed only to end, stopped in its last step, saves the stream where it was)."""
        self.loaded = self.state = state

    def close(self) -> None:
        """DataLoader workers end at once here (not at the garbage collector's pace, 5 s a worker)."""
        loaders.shut_down(self.loader)


class Ahead:
    """A stream's next step, fetched during the step before (`fetch`), so that whether every rank has one rides
    in that step's all-reduce: every rank ends the epoch after the same step, and none waits for a peer that
    left. Read in this process, on generators of its own (the stream's draws would otherwise move the
    training's between the step and its checkpoint)."""

    def __init__(self, feed: Feed, batches: Iterator[Any], size: int, device: torch.device) -> None:
        self.feed, self.batches, self.size, self.device = feed, batches, size, device
        self.batches_ahead: list[Any] = []

    def fetch(self) -> bool:
        """Read the next step's batches; whether there were enough for one."""
        self.feed.snapshot()
        isolated: Callable[[], Any] = (
            (lambda: rng.isolated(self.device)) if not self.feed.workers else contextlib.nullcontext
        )
        with isolated():
            self.batches_ahead = list(itertools.islice(self.batches, self.size))
        return len(self.batches_ahead) == self.size
