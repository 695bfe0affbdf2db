"""Evaluation inside the loop: each rank evaluates its exact shard (hpc_ddp.run.evaluation), every rank runs the
same number of forwards (padding batches, whose results are dropped), and one all-reduce gives every rank the
means over all evaluated samples, weighted by each batch's samples.

That all-reduce also carries every rank's preemption votes, as the per-step one does: a signal that comes
during an evaluation stops every rank at the same point, right after it, with the evaluation not recorded (the
position says it is pending, and the resume evaluates again before training on: no finished training step is
repeated).

Model: `model.eval()` under `torch.no_grad()` (and the strategy's autocast), back to `train()` after. The
evaluation loader has its own generator: it never draws from the global RNG, so evaluating changes nothing of
the training's random streams (dropout, the loader's shuffles), and an interrupted run stays bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Subset

from hpc_ddp.cluster.env import DistEnv
from hpc_ddp.errors import UsageError
from hpc_ddp.run import batches as batching
from hpc_ddp.run import beacon as phase
from hpc_ddp.run import evaluation, preemption
from hpc_ddp.run.beacon import Beacon
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.strategy.base import Strategy
from hpc_ddp.run.tasks import Task


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
        if isinstance(dataset, IterableDataset):
            raise UsageError(
                "Task.eval_dataset is an IterableDataset: not supported yet. Fix: a map-style Dataset (with "
                "__len__ and __getitem__) for the evaluation"
            )
        assert dataset is not None
        self.env, self.device, self.strategy, self.beacon = env, device, strategy, beacon
        self.eval_step, self.loss_of = task.eval_step, loss_of
        size = len(dataset)  # type: ignore[arg-type]
        mine = evaluation.shard(size, env.rank, env.world_size)
        # Rank 0's shard is the largest: every rank knows the agreed number of batches without a collective.
        self.batches = evaluation.batches_of(len(evaluation.shard(size, 0, env.world_size)), cfg.batch_size)

        def loader(indices: Any) -> DataLoader[Any]:
            return DataLoader(
                Subset(dataset, indices),  # type: ignore[arg-type]
                batch_size=cfg.batch_size,
                shuffle=False,
                drop_last=False,
                collate_fn=task.collate_fn,
                generator=torch.Generator(),  # never the global RNG (see the module docstring)
                **options,
            )

        self.loader = loader(mine)
        self.padding = loader(range(min(size, 1)))  # the dataset's first sample, for a rank with none
        self.names: list[str] | None = None

    def run(self, step: int) -> Result:
        """Evaluate this rank's shard; every rank gets the same Result (the means over all ranks' samples)."""
        model = self.strategy.wrapped
        means = evaluation.Means()
        was_training = model.training
        model.eval()
        names: list[str] = []
        try:
            with torch.no_grad():
                done = 0
                first: Any = None
                for batch in self.loader:
                    self.beacon.set(phase.EVALUATION, step)
                    first = batch if first is None else first
                    names = self._add(model, batch, means, weight=None)
                    done += 1
                while done < self.batches:  # padding: the same number of forwards on every rank
                    self.beacon.set(phase.EVALUATION, step)
                    batch = first if first is not None else next(iter(self.padding))
                    names = self._add(model, batch, means, weight=0)
                    done += 1
        finally:
            model.train(was_training)
        if self.names is None:
            self._agree_names(names)
        names = self.names or []
        self.beacon.set(phase.EVAL_ALLREDUCE, step)
        requeue, stop = preemption.pending()
        totals = [*means.totals(names), float(requeue), float(stop)]
        packet = torch.tensor(totals, dtype=torch.float64, device=self.device)
        dist.all_reduce(packet)
        values = packet.tolist()
        samples, result = evaluation.Means.result(names, values[:-2])
        return Result(samples, result, values[-2], values[-1])

    def _add(self, model: Any, batch: Any, means: evaluation.Means, weight: float | None) -> list[str]:
        batch = batching.to_device(batch, self.device)
        with self.strategy.autocast():
            if self.eval_step is not None:
                values = self.eval_step(model, batch)
            else:
                values = {"loss": self.loss_of(model, batch)}
        if not isinstance(values, dict) or not all(
            isinstance(k, str)
            and (isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1))
            for k, v in values.items()
        ):
            raise UsageError(
                f'Task.eval_step returned {type(values).__name__}; expected {{"name": value}} with numbers or '
                "scalar tensors (means over the batch)"
            )
        means.add(values, batching.samples_in(batch) if weight is None else weight)
        return sorted(values)

    def _agree_names(self, names: list[str]) -> None:
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, names)
        for rank, theirs in enumerate(everyone):
            if theirs != names:
                raise UsageError(
                    f"the evaluation returned {names} on rank {self.env.rank} but {theirs} on rank {rank}. Fix: "
                    "return the same names for every batch"
                )
        self.names = names
