"""The DDP training loop: sampler epochs, gradient accumulation, AMP, agreed stops, and checkpoints.

One all-reduce of five numbers per optimizer step carries [loss sum, micro-batches, requeue votes, stop
votes, rank 0's saving trouble]: the loss is averaged over all ranks for reporting, and a signal seen by any
rank stops every rank at the same step, at no extra collective. It comes before the optimizer step, so a loss
that is NaN or infinite on any rank is non-finite in the sum on every rank at the same step, and its update
is never applied (`--nonfinite-loss`: stop, the default, or skip that step).

Two seams serve whoever drives a Trainer other than `run()` (the bench): `train_step` is one optimizer step
exactly as the loop takes it, and `commit` (a constructor argument) is how a checkpoint is made durable.

Hangs and stragglers: the loop keeps the rank's progress beacon (run/beacon.py) on the phase it is in, for
the hang watchdog (run/watchdog.py), and splits each step's time into data, compute and communication wait.
Every few steps the ranks compare those splits with one small all-gather (run/stragglers.py).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from hpc_ddp._version import __version__
from hpc_ddp.cluster import group
from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import NonFinite, SavingFailed, UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run import beacon as phase
from hpc_ddp.run import checkpoint, metrics, preemption, progress, resume, stragglers
from hpc_ddp.run.beacon import Beacon
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.folder import MODEL
from hpc_ddp.run.position import Outcome, Position
from hpc_ddp.run.tasks import Task
from hpc_ddp.run.workers import init as worker_start

MAX_SKIPPED = 10  # --nonfinite-loss skip: this many non-finite steps in a row stop the run anyway

# The 5th number of the per-step all-reduce: what rank 0's background writer reports.
_SAVING_OK, _SAVING_FAILED, _SAVING_NONFINITE = 0.0, 1.0, 2.0


class Agreed(NamedTuple):
    """What the per-step all-reduce returns: this step's numbers summed over every rank."""

    loss_sum: float  # the micro-batch losses of the step
    count: float  # the micro-batches
    requeue: float  # ranks that saw SIGUSR1/SIGUSR2 (their votes to stop and requeue)
    stop: float  # ranks that saw SIGTERM (their votes to stop)
    saving: float = _SAVING_OK  # rank 0's writer gave up: _SAVING_FAILED, or _SAVING_NONFINITE weights


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


@dataclass
class _PendingSave:
    """A checkpoint of rank 0's whose "save" record waits for its background write to end."""

    epoch: int
    step: int
    stall_s: float  # the training loop was blocked this long by the save
    timing: dict[str, float] = field(default_factory=dict)  # set by the writer thread: began, write_s
    final: bool = False


class Trainer:
    """Owns the model, optimizer and data of one rank; `run()` trains until done or an agreed stop.

    Use it as a context manager inside `process_group()`: leaving the block closes it (see `close`), on
    errors too, so its DDP module never outlives the group.

    `commit(folder, state, step, keep)` makes a checkpoint durable on the writer thread (rank 0):
    `checkpoint.commit` unless the caller passes its own, e.g. one that times it.

    `comm_hook`, if given, is DDP's comm hook (none by default: DDP's own C++ all-reduce). `mark_grads=False`
    (the baseline of `python -m hpc_ddp.bench watchdog`) skips the end-of-backward mark of the beacon."""

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        task: Task,
        folder: Path,
        log: RankLog,
        commit: checkpoint.Commit = checkpoint.commit,
        beacon: Beacon | None = None,
        comm_hook: CommHook | None = None,
        mark_grads: bool = True,
    ) -> None:
        self.cfg, self.env, self.device, self.folder, self.log = cfg, env, device, folder, log
        self.commit = commit
        self.beacon = beacon or Beacon()  # what this rank does, for the hang watchdog (run/watchdog.py)
        self.window = stragglers.Window()  # this rank's time split since the last straggler check
        self.judge = stragglers.Judge()
        self._grads_ready = 0.0  # when backward's last gradient bucket was ready (the comm wait starts)
        # What a checkpoint must hold, checked on every rank before the first step: a state that a weights_only
        # load would refuse is a usage error now, not a checkpoint that never loads. The model's before the first
        # collective: a slow state_dict() (a user hook) is then waited for before any rank's watchdog starts.
        checkpoint.check_savable(task.model.state_dict(), "the model's state_dict()")
        # Every rank's host and pid, once, at start: the straggler report and the hang verdict name hosts.
        self.peers: list[tuple[str, int]] = [("", 0)] * env.world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()))
        self.loss_fn = task.loss_fn
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            task.dataset,
            num_replicas=env.world_size,
            rank=env.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        self.batches_per_epoch = len(self.sampler) // cfg.batch_size
        if self.batches_per_epoch == 0:  # checked before DDP exists: nothing to release on this error
            raise UsageError(
                f"each rank gets {len(self.sampler)} samples of the dataset ({env.world_size} ranks), "
                f"fewer than --batch-size {cfg.batch_size}. Fix: a smaller --batch-size or fewer ranks"
            )
        self.pending_save: _PendingSave | None = None  # before the writer: close() records what it wrote
        self.writer = checkpoint.AsyncWriter(warn=log.warn)
        self.model = task.model.to(device)
        # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving a copy per step.
        self.ddp = DDP(
            self.model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        group.hold(self.ddp)  # its Reducer holds the group: it must be gone before the group is
        try:
            self._finish_init(cfg, env, device, task, comm_hook, mark_grads)
        except BaseException:
            self.close()  # a user optimizer or the DataLoader raised: release DDP before the group goes
            raise

    def _finish_init(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        device: torch.device,
        task: Task,
        comm_hook: CommHook | None,
        mark_grads: bool,
    ) -> None:
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
        self.loader = DataLoader(
            task.dataset,
            batch_size=cfg.batch_size,
            sampler=self.skip,
            drop_last=True,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            worker_init_fn=worker_start if workers else None,
            # Workers start once, not at every epoch: a start that opens shards or sockets is paid once.
            persistent_workers=workers > 0,
            generator=self.loader_gen,
        )
        self._step_loss = torch.zeros((), device=device)  # this step's micro-batch losses, on the device
        self.pos = Position()
        # This process's first optimizer step (after a start or a resume) pays for warm-up, lazy init and a
        # resumed checkpoint's first use: every phase of it is long for the hang watchdog (run/beacon.py).
        self.first_step = True
        self.saved_step = -1  # the step of the newest checkpoint this process wrote or resumed from
        self.skipped = 0  # non-finite steps in a row (--nonfinite-loss skip)
        self.save_error: BaseException | None = None  # the writer's error that stopped the run, once raised
        self.notes: list[str] = []  # what a resume changed (said once training really starts)
        self.param_names = [name for name, _ in self.model.named_parameters()]
        self.step_data_s = 0.0  # this step's wait for data (rank 0 records it)
        steps_per_epoch = math.ceil(self.batches_per_epoch / cfg.grad_accum)
        self.metrics = metrics.Recorder(
            self.folder if env.is_main else None,
            cfg,
            env,
            progress.total_steps(cfg.epochs, steps_per_epoch, cfg.max_steps),
        )
        checkpoint.check_savable(self.optimizer.state_dict(), "the optimizer's state_dict()")

    def _queue_mark(self, grad: torch.Tensor) -> None:
        # Runs as backward starts (the loss's gradient): queue a callback for the end of the backward graph.
        # It was queued before DDP's own (which DDP queues once its last bucket is ready), so it runs first:
        # all gradients are computed, and from here on this rank only waits for the all-reduce to finish.
        Variable._execution_engine.queue_callback(self._mark_grads_ready)

    def _mark_grads_ready(self) -> None:
        self._grads_ready = self.beacon.set(phase.GRAD_ALLREDUCE, long=self.first_step)

    # ----- end of life ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End of life, on every path, before the process group is destroyed: wait until the checkpoint in
        flight is durable, then drop what holds the group (DDP and its Reducer) and the optimizer and data.
        `model` and `pos` stay readable. Idempotent; the writer's error, if any, is raised after the release."""
        try:
            if "writer" in self.__dict__:
                try:
                    self.writer.wait()
                except BaseException as e:
                    if e is not self.__dict__.get("save_error"):  # it stopped the run: reported already
                        raise
                finally:
                    with contextlib.suppress(OSError):  # a record lost to a full disk must not hide the error
                        self._record_save()  # its write ended, durable or not
        finally:
            for name in ("ddp", "optimizer", "scaler", "loader", "skip"):
                self.__dict__.pop(name, None)
            if "metrics" in self.__dict__:
                try:
                    self.metrics.close()  # TensorBoard's events flushed, on every path out
                except Exception as e:  # the run's outcome stands; the curves lose their last events
                    self.log.warn(f"TensorBoard's event file could not be flushed and closed: {e}")

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
        mine = {
            k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v for k, v in self._rank_rng().items()
        }
        dist.all_gather_object(rngs, mine)
        rngs = [
            {
                k: torch.frombuffer(bytearray(v), dtype=torch.uint8) if isinstance(v, bytes) else v
                for k, v in rng.items()
            }
            for rng in rngs
        ]
        if not self.env.is_main:
            return None
        self.beacon.set(phase.CHECKPOINT)
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "position": asdict(self.pos),
            "rng": rngs,
            "world_size": self.env.world_size,
            "config": self.cfg.as_dict(),
            "version": __version__,
        }

    def save(self, final: bool = False) -> None:
        """Checkpoint at the current position: rank 0 copies state to CPU now and writes it in the background.
        `final` also waits until the file is durable (retrying a failed write, see checkpoint.AsyncWriter). A
        position already saved is not written twice.

        Rank 0 records each save ("save" in metrics.jsonl) once its write has ended: how long it blocked the
        loop (for the final one, the wait until durable included) and how long the write took."""
        began = time.monotonic()
        if self.saved_step != self.pos.step:
            # The gather is a collective (a peer frozen here is found at the steady limit); the writer's own work
            # after it is a long phase (state()), which it answers for if peers diagnose meanwhile.
            self.beacon.set(phase.CHECKPOINT_GATHER)
            state = self.state()  # collective: every rank takes part, so every rank decides the same way
            self.saved_step = self.pos.step
            if self.env.is_main:
                snapshot = checkpoint.to_cpu(state, "the checkpoint state")
                step, keep, names, commit = self.pos.step, self.cfg.keep, self.param_names, self.commit

                timing: dict[str, float] = {}

                def write() -> tuple[Path, int]:  # on the writer thread: the check costs the training nothing
                    timing.setdefault("began", time.monotonic())  # a retry counts from the first attempt
                    checkpoint.require_finite(snapshot["model"], names, step)
                    done = commit(self.folder, snapshot, step, keep)
                    timing["write_s"] = time.monotonic() - timing["began"]
                    return done

                self.writer.submit(write)  # waits for the previous write first
                self._record_save()  # the previous save: its write has ended
                self.pending_save = _PendingSave(
                    self.pos.epoch, self.pos.step, time.monotonic() - began, timing
                )
        if final and self.env.is_main:
            waited = time.monotonic()
            try:
                self.writer.wait(retry=True)
            except BaseException as e:
                self.save_error = e
                if isinstance(e, OSError):  # the disk: one line; anything else as it is
                    raise SavingFailed(self._saving_failed_message(e)) from e
                raise
            pending = self.pending_save
            if pending is not None and pending.step == self.pos.step:  # this position's save is the last one
                pending.stall_s += time.monotonic() - waited
                pending.final = True
            self._record_save()

    def _record_save(self) -> None:
        """Rank 0: write the "save" record of the pending save (its write has ended, or never will)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            self.metrics.save(
                pending.epoch, pending.step, pending.stall_s, pending.timing.get("write_s"), pending.final
            )

    def _saving_failed_message(self, error: BaseException) -> str:
        last = checkpoint.read_latest(self.folder)
        kept = f"the last checkpoint written, {last}, is kept" if last else "no checkpoint was written"
        tries = f" after {self.writer.failures} attempts" if self.writer.failures > 1 else ""
        return (
            f"checkpoints cannot be written to {checkpoint.ckpt_dir(self.folder)}{tries}: "
            f"{checkpoint.describe(error)}. Every rank stops at step {self.pos.step} so that no more work depends "
            f"on a save that does not happen; {kept}. Fix: free space (or quota) there, then run the same "
            "command to resume"
        )

    def _stop_for_saving(self, code: float) -> None:
        """Every rank, at the same step: rank 0's writer gave up (see `_agree`)."""
        error = self.save_error = self.writer.fatal
        if isinstance(error, OSError):  # the disk: one line
            raise SavingFailed(self._saving_failed_message(error)) from error
        if error is not None:  # non-finite weights (one line), or a bug (its traceback)
            raise error
        message = (
            f"rank 0 could not write checkpoints (see its log); every rank stopped with it at step "
            f"{self.pos.step}"
        )
        raise NonFinite(message) if code == _SAVING_NONFINITE else SavingFailed(message)

    def finished(self) -> bool:
        """Nothing left to train at this position under the current --epochs and --max-steps."""
        return self.pos.epoch >= self.cfg.epochs or bool(
            self.cfg.max_steps and self.pos.step >= self.cfg.max_steps
        )

    def restore(self, state: dict[str, Any], path: Path) -> None:
        """Load a checkpoint's model, optimizer, scaler, position and this rank's RNG. A --lr that differs from
        the checkpoint's is applied, and said (`notes`), or refused if the optimizer does not take it."""
        resume.check_compatible(state, path, self.cfg, self.env.world_size)
        resume.load_model_state(self.model, state, path)
        fresh = [g.get("lr") for g in self.optimizer.param_groups]  # as the current options build it
        self.optimizer.load_state_dict(state["optimizer"])
        note = resume.reapply_lr(self.optimizer, fresh, state, self.cfg, path)
        self.notes = [note] if note else []
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
        backward all-reduces the gradients), the per-step all-reduce of the loss and of every rank's signal
        votes, then the optimizer (skipped when the agreed loss is not finite or rank 0 cannot save). A
        collective: every rank calls it with its own batch."""
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
            start = beacon.set(phase.COMPUTE, long=self.first_step)
            self._grads_ready = 0.0
            self._step_loss += self._micro_step(inputs, target, 1.0 / count, sync=done == count)
            if done == count:
                # The step's all-reduce comes before the update: every rank learns at this step that some
                # rank's loss is not finite (or that rank 0 cannot save), and nobody applies that update.
                now = beacon.set(phase.STEP_ALLREDUCE, long=self.first_step)
                ready = self._grads_ready or now  # no end-of-backward mark (mark_grads=False)
                window.compute_s += ready - start
                window.comm_s += now - ready  # what remained of the gradient all-reduce after backward
                agreed = self._agree(self._step_loss, count)
                start = beacon.set(phase.OPTIMIZER, long=self.first_step)
                window.comm_s += start - now
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

    def _micro_step(self, inputs: Any, target: Any, scale: float, sync: bool) -> torch.Tensor:
        inputs = inputs.to(self.device, non_blocking=True)
        target = target.to(self.device, non_blocking=True)
        # no_sync on all but the last micro-batch: gradients accumulate locally, one all-reduce per step.
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            with torch.autocast(
                self.device.type,
                dtype=self.autocast_dtype or torch.float32,
                enabled=self.autocast_dtype is not None,
            ):
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
        """The one per-step all-reduce: loss and micro-batch counts, every rank's signal votes, and whether rank
        0's background writer gave up (checked without waiting; it also starts a retry that is due)."""
        requeue, stop = preemption.pending()
        fatal = self.writer.check()  # idle on every rank but 0
        saving = (
            _SAVING_OK
            if fatal is None
            else (_SAVING_NONFINITE if isinstance(fatal, NonFinite) else _SAVING_FAILED)
        )
        packet = torch.stack(
            [
                loss_sum.float(),
                torch.tensor(float(count), device=self.device),
                torch.tensor(float(requeue), device=self.device),
                torch.tensor(float(stop), device=self.device),
                torch.tensor(saving, device=self.device),
            ]
        )
        dist.all_reduce(packet)
        values = packet.tolist()
        return Agreed(values[0], values[1], values[2], values[3], values[4])

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
        self.metrics.nonfinite(self.pos, step, self.cfg.nonfinite_loss)
        last = checkpoint.read_latest(self.folder)
        kept = f"the last checkpoint, {last.name}, is kept" if last else "no checkpoint was written"
        if (self.folder / MODEL).is_file():
            kept += ", model.pth is untouched"
        if self.skipped:
            cause = (
                f"{where}: the loss averaged over all ranks was not finite in {self.skipped + 1} steps in a "
                f"row ({value} now), so the weights themselves are probably not finite"
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

    # ----- the loop -----------------------------------------------------------------------------------
    def _epoch(self, epoch: int) -> Outcome | None:
        """Train the rest of one epoch; an Outcome if the loop must end inside it."""
        cfg, pos = self.cfg, self.pos
        self.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one after a restart
        self.skip.skip = pos.batch * cfg.batch_size
        # Modulo 2**64: the same seed torch derives from a negative or small value, and no overflow for a large
        # --seed (any 64-bit seed is valid).
        self.loader_gen.manual_seed((cfg.seed * 1_000_003 + epoch) % 2**64)
        batches = self._timed(iter(self.loader))
        while pos.batch < self.batches_per_epoch:
            # A resumed epoch starts at a step boundary; the epoch's last step may have fewer micro-batches.
            size = min(cfg.grad_accum, self.batches_per_epoch - pos.batch)
            agreed = self.accumulated_step(itertools.islice(batches, size), size)
            finite = math.isfinite(agreed.loss_sum)
            if not finite:
                self._nonfinite(agreed.loss_sum, pos.step + 1)  # raises, unless --nonfinite-loss skip
            if agreed.saving:
                self._stop_for_saving(agreed.saving)
            if finite:
                self.skipped = 0
                pos.loss_sum, pos.loss_count = pos.loss_sum + agreed.loss_sum, pos.loss_count + agreed.count
            pos.batch, pos.step = pos.batch + size, pos.step + 1
            self.metrics.step(
                pos,
                agreed.loss_sum / max(agreed.count, 1.0),
                cfg.batch_size * size * self.env.world_size,
                float(self.optimizer.param_groups[0]["lr"]),
                self.step_data_s,
            )
            self.step_data_s = 0.0
            if self.pending_save is not None and "write_s" in self.pending_save.timing:
                self._record_save()  # the background write is durable: rank 0 records the save
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
        if self.finished():  # never one more step than --max-steps, also after a resume
            return Outcome(True)
        while self.pos.epoch < self.cfg.epochs:
            outcome = self._epoch(self.pos.epoch)
            if outcome is not None and not outcome.finished:
                return outcome
            mean = self.pos.loss_sum / max(self.pos.loss_count, 1.0)
            self.metrics.epoch(self.pos, mean)  # first: it erases the live progress line
            self.log.main(f"Epoch {self.pos.epoch}, Loss: {mean:.4f}")
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
