"""The DDP training loop: sampler epochs, gradient accumulation, AMP, agreed stops, and checkpoints.

One all-reduce of four numbers per optimizer step carries [loss sum, micro-batches, requeue votes, stop
votes]: the loss is averaged over all ranks for reporting, and a signal seen by any rank stops every rank at
the same step, at no extra collective.

Two seams serve whoever drives a Trainer other than `run()` (the bench): `train_step` is one optimizer step
exactly as the loop takes it, and `commit` (a constructor argument) is how a checkpoint is made durable.

Hangs and stragglers: the loop keeps the rank's progress beacon (run/beacon.py) on the phase it is in, for
the hang watchdog (run/watchdog.py), and splits each step's time into data, compute and communication wait.
Every few steps the ranks compare those splits with one small all-gather (run/stragglers.py).
"""

from __future__ import annotations

import contextlib
import os
import itertools
import random
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from hpc_ddp._version import __version__
from hpc_ddp.dist import group
from hpc_ddp.dist.env import DistEnv
from hpc_ddp.errors import UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run import beacon as phase
from hpc_ddp.run import checkpoint, metrics, preemption, resume, stragglers
from hpc_ddp.run.beacon import Beacon
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.position import Outcome, Position
from hpc_ddp.run.tasks import Task


class Agreed(NamedTuple):
    """What the per-step all-reduce returns: this step's numbers summed over every rank."""

    loss_sum: float  # the micro-batch losses of the step
    count: float  # the micro-batches
    requeue: float  # ranks that saw SIGUSR1/SIGUSR2 (their votes to stop and requeue)
    stop: float  # ranks that saw SIGTERM (their votes to stop)


class _SkipSampler(Sampler[int]):
    """The epoch's DistributedSampler order, minus the samples a resumed run already trained on."""

    def __init__(self, base: DistributedSampler) -> None:
        self.base = base
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return len(self.base) - self.skip


def _ordered_mean_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    """--deterministic: all-gather each bucket and sum in rank order, so the result doesn't depend on how
    DDP laid out its buckets. DDP rebuilds buckets after a process's first backward; a resumed process would
    otherwise sum its first step in a different grouping than the uninterrupted run did."""
    buffer = bucket.buffer()
    world = dist.get_world_size()
    parts = [torch.empty_like(buffer) for _ in range(world)]
    future = dist.all_gather(parts, buffer, async_op=True).get_future()

    def ordered_sum(_: Any) -> torch.Tensor:
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total.div_(world)

    return future.then(ordered_sum)


CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


class Trainer:
    """Owns the model, optimizer and data of one rank; `run()` trains until done or an agreed stop.

    Use it as a context manager inside `process_group()`: leaving the block closes it (see `close`), on
    errors too, so its DDP module never outlives the group.

    `commit(folder, state, step, keep)` makes a checkpoint durable on the writer thread (rank 0):
    `checkpoint.commit` unless the caller passes its own, e.g. one that times it.

    `comm_hook`, if given, is DDP's comm hook (none by default: DDP's own C++ all-reduce). `mark_grads=False`
    (the baseline of `python -m hpc_ddp.bench watchdog`) skips the end-of-backward mark of the beacon."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, device: torch.device, task: Task, folder: Path,
                 log: RankLog, commit: checkpoint.Commit = checkpoint.commit, beacon: Beacon | None = None,
                 comm_hook: CommHook | None = None, mark_grads: bool = True) -> None:
        self.cfg, self.env, self.device, self.folder, self.log = cfg, env, device, folder, log
        self.commit = commit
        self.beacon = beacon or Beacon()  # what this rank does, for the hang watchdog (run/watchdog.py)
        self.window = stragglers.Window()  # this rank's time split since the last straggler check
        self.judge = stragglers.Judge()
        self._grads_ready = 0.0  # when backward's last gradient bucket was ready (the comm wait starts)
        # Every rank's host and pid, once, at start: the straggler report and the hang verdict name hosts.
        self.peers: list[tuple[str, int]] = [("", 0)] * env.world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()))
        self.loss_fn = task.loss_fn
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            task.dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=cfg.seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // cfg.batch_size
        if self.batches_per_epoch == 0:  # checked before DDP exists: nothing to release on this error
            raise UsageError(f"each rank gets {len(self.sampler)} samples of the dataset ({env.world_size} ranks), "
                             f"fewer than --batch-size {cfg.batch_size}. Fix: a smaller --batch-size or fewer ranks")
        self.writer = checkpoint.AsyncWriter()
        self.model = task.model.to(device)
        # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving a copy per step.
        self.ddp = DDP(self.model, device_ids=[device] if device.type == "cuda" else None,
                       gradient_as_bucket_view=True)
        group.hold(self.ddp)  # its Reducer holds the group: it must be gone before the group is
        try:
            self._finish_init(cfg, env, device, task, comm_hook, mark_grads)
        except BaseException:
            self.close()  # a user optimizer or the DataLoader raised: release DDP before the group goes
            raise

    def _finish_init(self, cfg: TrainConfig, env: DistEnv, device: torch.device, task: Task,
                     comm_hook: CommHook | None, mark_grads: bool) -> None:
        # No comm hook unless one is needed: any hook, even a Python copy of DDP's own all-reduce, costs an
        # extra pass over every gradient (DDP divides while copying into its buckets only without a hook).
        hook = comm_hook or (_ordered_mean_hook if cfg.deterministic and env.world_size > 1 else None)
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        self.mark_grads = mark_grads
        params = self.model.parameters()  # the same tensors as DDP's, without a reference to the DDP module
        self.optimizer = task.optimizer(params) if task.optimizer else torch.optim.SGD(params, lr=cfg.lr)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.skip = _SkipSampler(self.sampler)
        workers = cfg.num_workers if cfg.num_workers >= 0 else (2 if device.type == "cuda" else 0)
        # An explicit generator: otherwise each DataLoader iterator draws its seed from the global RNG, and a
        # resumed run's dropout would see a different random stream than the uninterrupted run.
        self.loader_gen = torch.Generator()
        self.loader = DataLoader(task.dataset, batch_size=cfg.batch_size, sampler=self.skip, drop_last=True,
                                 num_workers=workers, pin_memory=device.type == "cuda",
                                 worker_init_fn=preemption.ignore if workers else None,
                                 generator=self.loader_gen)
        self._step_loss = torch.zeros((), device=device)  # this step's micro-batch losses, on the device
        self.pos = Position()
        self.saved_step = -1  # the step of the newest checkpoint this process wrote or resumed from
        self.metrics = metrics.Recorder(self.folder if env.is_main else None, cfg, env)

    def _queue_mark(self, grad: torch.Tensor) -> None:
        # Runs as backward starts (the loss's gradient): queue a callback for the end of the backward graph.
        # It was queued before DDP's own (which DDP queues once its last bucket is ready), so it runs first:
        # all gradients are computed, and from here on this rank only waits for the all-reduce to finish.
        Variable._execution_engine.queue_callback(self._mark_grads_ready)

    def _mark_grads_ready(self) -> None:
        self._grads_ready = self.beacon.set(phase.GRAD_ALLREDUCE)

    # ----- end of life ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End of life, on every path, before the process group is destroyed: wait until the checkpoint in
        flight is durable, then drop what holds the group (DDP and its Reducer) and the optimizer and data.
        `model` and `pos` stay readable. Idempotent; the writer's error, if any, is raised after the release."""
        try:
            if "writer" in self.__dict__:
                self.writer.wait()
        finally:
            for name in ("ddp", "optimizer", "scaler", "loader", "skip"):
                self.__dict__.pop(name, None)

    def __enter__(self) -> "Trainer":
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

    # ----- checkpoint state -------------------------------------------------------------------------
    def _rank_rng(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": _to_lists(random.getstate())}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def state(self) -> dict[str, Any] | None:
        """Collective: gather every rank's RNG; returns the full checkpoint state on rank 0, None elsewhere."""
        rngs: list[Any] = [None] * self.env.world_size
        # RNG tensors travel as bytes: a pickled tensor goes through torch.save/torch.load inside
        # all_gather_object, which doubled the gather, a third of a save's stall (hpc_ddp.bench).
        mine = {k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v
                for k, v in self._rank_rng().items()}
        dist.all_gather_object(rngs, mine)
        rngs = [{k: torch.frombuffer(bytearray(v), dtype=torch.uint8) if isinstance(v, bytes) else v
                 for k, v in rng.items()} for rng in rngs]
        if not self.env.is_main:
            return None
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None, "position": asdict(self.pos),
                "rng": rngs, "world_size": self.env.world_size, "config": self.cfg.as_dict(),
                "version": __version__}

    def save(self, final: bool = False) -> None:
        """Checkpoint at the current position: rank 0 copies state to CPU now and writes it in the background.
        `final` also waits until the file is durable. A position already saved is not written twice."""
        if self.saved_step != self.pos.step:
            self.beacon.set(phase.CHECKPOINT)
            state = self.state()  # collective: every rank takes part, so every rank decides the same way
            self.saved_step = self.pos.step
            if self.env.is_main:
                snapshot = checkpoint.to_cpu(state)
                step, keep = self.pos.step, self.cfg.keep
                self.writer.submit(lambda: self.commit(self.folder, snapshot, step, keep))
        if final and self.env.is_main:
            self.writer.wait()

    def restore(self, state: dict[str, Any], path: Path) -> None:
        """Load a checkpoint's model, optimizer, scaler, position and this rank's RNG."""
        resume.check_compatible(state, path, self.cfg, self.env.world_size)
        resume.load_model_state(self.model, state, path)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.pos = Position(**state["position"])
        self.saved_step = self.pos.step
        rng = state["rng"][self.env.rank]
        torch.set_rng_state(rng["cpu"])
        random.setstate(_to_tuples(rng["python"]))
        if self.device.type == "cuda" and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    # ----- one optimizer step -------------------------------------------------------------------------
    def train_step(self, inputs: Any, target: Any) -> Agreed:
        """One optimizer step on one batch, as the loop takes it: forward and backward through DDP (whose
        backward all-reduces the gradients), the optimizer, then the per-step all-reduce of the loss and of
        every rank's signal votes. A collective: every rank calls it with its own batch."""
        return self.accumulated_step([(inputs, target)], 1)

    def accumulated_step(self, micro_batches: Iterable[tuple[Any, Any]], count: int) -> Agreed:
        """One optimizer step over `count` micro-batches (--grad-accum): the gradients of all but the last
        accumulate locally (`no_sync`) and the last one's backward all-reduces them, once per step. The beacon
        follows each phase and the straggler window gets its time split; `micro_batches` is read lazily, so
        loading data (the loader iterator, timed as data loading) happens between micro-steps."""
        self._step_loss.zero_()
        done = 0
        window, beacon = self.window, self.beacon
        for inputs, target in micro_batches:
            done += 1
            start = beacon.set(phase.COMPUTE)
            self._grads_ready = 0.0
            self._step_loss += self._micro_step(inputs, target, 1.0 / count, sync=done == count)
            if done == count:
                now = beacon.set(phase.OPTIMIZER)
                ready = self._grads_ready or now  # no hook call: world of one without buckets, or no_sync
                window.compute_s += ready - start
                window.comm_s += now - ready  # what remained of the gradient all-reduce after backward
                self._optimizer_step()
                now, start = beacon.set(phase.STEP_ALLREDUCE), now
                window.compute_s += now - start
                agreed = self._agree(self._step_loss, count)
                window.comm_s += time.monotonic() - now
                window.steps += 1
                return agreed
            window.compute_s += time.monotonic() - start
        raise RuntimeError(f"internal error: {done} micro-batch(es) came for an optimizer step of {count}")

    def _micro_step(self, inputs: Any, target: Any, scale: float, sync: bool) -> torch.Tensor:
        inputs = inputs.to(self.device, non_blocking=True)
        target = target.to(self.device, non_blocking=True)
        # no_sync on all but the last micro-batch: gradients accumulate locally, one all-reduce per step.
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                loss = self.loss_fn(self.ddp(inputs), target)
            scaled = loss * scale
            if sync and self.mark_grads:
                scaled.register_hook(self._queue_mark)
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach()

    def _optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # set_to_none even with bucket views (hpc_ddp.bench: mlp, 2 CPU ranks, ~1350 -> ~1460 samples/s):
        # backward then hands DDP a fresh gradient that it copies into the bucket once and re-views, instead
        # of a memset of every bucket here plus an in-place add during backward.
        self.optimizer.zero_grad(set_to_none=True)

    def _agree(self, loss_sum: torch.Tensor, count: int) -> Agreed:
        """The one per-step all-reduce: loss and micro-batch counts, plus every rank's signal votes."""
        requeue, stop = preemption.pending()
        packet = torch.stack([loss_sum.float(), torch.tensor(float(count), device=self.device),
                              torch.tensor(float(requeue), device=self.device),
                              torch.tensor(float(stop), device=self.device)])
        dist.all_reduce(packet)
        values = packet.tolist()
        return Agreed(values[0], values[1], values[2], values[3])

    # ----- the loop -----------------------------------------------------------------------------------
    def _epoch(self, epoch: int) -> Outcome | None:
        """Train the rest of one epoch; an Outcome if the loop must end inside it."""
        cfg, pos = self.cfg, self.pos
        self.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one after a restart
        self.skip.skip = pos.batch * cfg.batch_size
        self.loader_gen.manual_seed(cfg.seed * 1_000_003 + epoch)
        batches = self._timed(iter(self.loader))
        while pos.batch < self.batches_per_epoch:
            # A resumed epoch starts at a step boundary; the epoch's last step may have fewer micro-batches.
            size = min(cfg.grad_accum, self.batches_per_epoch - pos.batch)
            agreed = self.accumulated_step(itertools.islice(batches, size), size)
            pos.batch, pos.step = pos.batch + size, pos.step + 1
            pos.loss_sum, pos.loss_count = pos.loss_sum + agreed.loss_sum, pos.loss_count + agreed.count
            self.metrics.step(pos, agreed.loss_sum / max(agreed.count, 1.0),
                              cfg.batch_size * size * self.env.world_size)
            if agreed.requeue or agreed.stop:
                return Outcome(False, agreed.requeue, agreed.stop)
            if pos.step % stragglers.EVERY_STEPS == 0 and self.env.world_size > 1:
                self.check_stragglers()
            if cfg.save_every_steps and pos.step % cfg.save_every_steps == 0:
                self.save()
            if cfg.max_steps and pos.step >= cfg.max_steps:
                return Outcome(True)
        return None

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loader's batches, each fetched in the beacon's "data loading" phase and timed."""
        while True:
            start = self.beacon.set(phase.DATA, self.pos.step + 1)  # the step in the making, counted from 1
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.window.data_s += time.monotonic() - start
            yield batch

    def check_stragglers(self) -> None:
        """Every EVERY_STEPS steps, on every rank at the same step: all-gather each rank's time split of the
        window (one fixed-size row) and judge it the same way everywhere; rank 0 names a straggler."""
        self.beacon.set(phase.STRAGGLER_GATHER)
        mine = torch.tensor(self.window.row(), dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(rows, mine)
        self.window.reset()
        for slow in self.judge.add([row.tolist() for row in rows]):
            host = self.peers[slow.rank][0]
            self.log.main(stragglers.describe(slow, host, self.pos.step))
            self.metrics.straggler(self.pos, slow.rank, host, slow.phase, slow.slower)

    def run(self) -> Outcome:
        """Train from `self.pos` to the end, or until every rank agreed to stop."""
        while self.pos.epoch < self.cfg.epochs:
            outcome = self._epoch(self.pos.epoch)
            if outcome is not None and not outcome.finished:
                return outcome
            mean = self.pos.loss_sum / max(self.pos.loss_count, 1.0)
            self.log.main(f"Epoch {self.pos.epoch}, Loss: {mean:.4f}")
            self.metrics.epoch(self.pos, mean)
            if outcome is not None:  # --max-steps reached inside the epoch
                return outcome
            self.pos = Position(epoch=self.pos.epoch + 1, step=self.pos.step)
            if self.cfg.save_every_epochs and self.pos.epoch % self.cfg.save_every_epochs == 0:
                self.save()
        return Outcome(True)


def _to_lists(obj: Any) -> Any:
    """random.getstate() as nested lists: plain data that loads under weights_only=True."""
    return [_to_lists(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _to_tuples(obj: Any) -> Any:
    return tuple(_to_tuples(x) for x in obj) if isinstance(obj, list) else obj

