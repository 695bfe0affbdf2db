"""Batches of any structure (hpc_ddp.run.data.batches), schedules (run.schedules), exact evaluation shards and
weighted means (run.evaluation), stream parts (run.streams): unit tables."""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
from typing import Any, NamedTuple

import pytest
import torch

from hpc_ddp.errors import UsageError
from hpc_ddp.run.data import batches, streams
from hpc_ddp.run.loop import evaluation, schedules


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    ids: torch.Tensor
    name: str


class Encoding(collections.UserDict):  # what a Hugging Face BatchEncoding looks like: a mapping with .to()
    def to(self, device: Any) -> Encoding:
        self.moved = device
        return self


META = torch.device("meta")  # a device every machine has: tensors moved there really change device


@pytest.mark.parametrize(
    "batch, check",
    [
        (torch.ones(2), lambda b: b.device == META),
        ((torch.ones(2), torch.zeros(2)), lambda b: type(b) is tuple and all(t.device == META for t in b)),
        ([torch.ones(2), "text", 3, None], lambda b: b[0].device == META and b[1:] == ["text", 3, None]),
        ({"ids": torch.ones(2), "mask": torch.ones(2)}, lambda b: all(t.device == META for t in b.values())),
        (collections.OrderedDict(a=torch.ones(1)), lambda b: type(b) is collections.OrderedDict),
        (Pair(torch.ones(1), torch.ones(1)), lambda b: type(b) is Pair and b.y.device == META),
        (Frozen(torch.ones(1), "n"), lambda b: type(b) is Frozen and b.ids.device == META and b.name == "n"),
        ({"nested": [{"deep": (torch.ones(1),)}]}, lambda b: b["nested"][0]["deep"][0].device == META),
        (Encoding(ids=torch.ones(1)), lambda b: b.moved == META),
    ],
)
def test_any_structure_goes_to_the_device_keeping_its_types(batch: Any, check: Any) -> None:
    moved = batches.to_device(batch, META)
    assert check(moved)
    batches.check(batch)  # usable


def test_the_users_batch_is_not_changed_in_place() -> None:
    original = Frozen(torch.ones(1), "n")
    batches.to_device(original, META)
    assert original.ids.device.type == "cpu"


@pytest.mark.parametrize(
    "batch, where",
    [
        ({"ids": torch.ones(1), "tags": {"a", "b"}}, "batch['tags']: set"),
        ((torch.ones(1), [torch.ones(1), iter([1])]), "batch[1][1]: list_iterator"),
        (Pair(torch.ones(1), object()), "batch.y: object"),  # type: ignore[arg-type]
        ({"f": lambda: 0}, "batch['f']: function"),
    ],
)
def test_what_cannot_be_used_is_named_by_its_path(batch: Any, where: str) -> None:
    with pytest.raises(UsageError) as info:
        batches.check(batch)
    message = str(info.value)
    assert message.startswith(where) and "Fix:" in message and "\n" not in message


@pytest.mark.parametrize(
    "kind, step, warmup, total, expected",
    [
        ("constant", 0, 0, 100, 1.0),
        ("constant", 0, 4, 100, 0.25),
        ("constant", 3, 4, 100, 1.0),
        ("linear", 4, 4, 104, 1.0),
        ("linear", 54, 4, 104, 0.5),
        ("linear", 104, 4, 104, 0.0),
        ("linear", 500, 4, 104, 0.0),  # past the end: stays at 0
        ("cosine", 0, 0, 10, 1.0),
        ("cosine", 5, 0, 10, 0.5),
        ("cosine", 10, 0, 10, 0.0),
    ],
)
def test_schedule_factors(kind: str, step: int, warmup: int, total: int, expected: float) -> None:
    assert schedules.factor(kind, step, warmup, total) == pytest.approx(expected, abs=1e-12)


def test_a_schedule_pickles_and_resumes_exactly() -> None:
    def rates(resume_at: int | None) -> list[float]:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = schedules.build("cosine", 3, optimizer, 20)
        seen = []
        for step in range(20):
            if step == resume_at:  # a new process: fresh objects, state from the checkpoint
                saved = pickle.loads(pickle.dumps((optimizer.state_dict(), scheduler.state_dict())))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                # built before the optimizer's state is loaded: building it sets the rates of step 0
                scheduler = schedules.build("cosine", 3, optimizer, 20)
                optimizer.load_state_dict(saved[0])
                scheduler.load_state_dict(saved[1])
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    assert rates(None) == rates(7)


@pytest.mark.parametrize(
    ("old", "new", "before", "after", "own", "expected"),
    [
        (8, 8, 0.0, 0.0, False, None),
        (
            None,
            12,
            0.0,
            0.005,
            False,
            None,
        ),  # a checkpoint written before it said its total: nothing to compare
        (
            8,
            12,
            0.0,
            0.005,
            False,
            "the LR schedule's total changed from 8 to 12 optimizer steps (--epochs 2 -> 3): it goes on over the "
            "new total, so the learning rate goes from 0 to 0.005 at step 8",
        ),
        (
            8,
            12,
            0.02,
            0.02,
            True,
            "Task.scheduler's total changed from 8 to 12 optimizer steps (--epochs 2 -> 3): it goes on over the new "
            "total, so the learning rate stays at 0.02 at step 8 (its next step, with the new total)",
        ),
    ],
)
def test_a_changed_total_is_said_with_both_totals_and_rates(
    old: int | None, new: int, before: float, after: float, own: bool, expected: str | None
) -> None:
    assert schedules.total_changed(old, new, 8, before, after, own, "--epochs 2 -> 3") == expected


@pytest.mark.parametrize(
    ("saved", "now", "expected"),
    [
        ({"epochs": 2, "max_steps": 0}, {"epochs": 3, "max_steps": 0}, "--epochs 2 -> 3"),
        ({"epochs": 2, "max_steps": 0}, {"epochs": 2, "max_steps": 5}, "--max-steps 0 -> 5"),
        (
            {"epochs": 2, "max_steps": 0},
            {"epochs": 2, "max_steps": 0},
            "another number of ranks or --grad-accum",
        ),
    ],
)
def test_why_a_total_changed_names_the_flags(saved: dict, now: dict, expected: str) -> None:
    assert schedules.why_total(saved, now) == expected


@pytest.mark.parametrize("own", [False, True])
def test_a_resume_over_another_total_says_so_in_the_part_that_loads_it(tmp_path: Any, own: bool) -> None:
    """Issue 42: --epochs raised on a finished cosine run moved the rate about 100x, unsaid. The scheduler part
    (real LambdaLR objects, a state as a checkpoint holds it) goes on over the new total and says so."""
    from hpc_ddp.run.checkpoint.part import Loading
    from hpc_ddp.run.checkpoint.parts import SchedulerPart
    from hpc_ddp.run.config import TrainConfig

    def make(total: int) -> tuple[Any, Any]:
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.01)
        if own:  # a task's own: a closure over its total (LambdaLR saves no function)
            return optimizer, torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: 1 - min(s, total) / total
            )
        return optimizer, schedules.build("cosine", 0, optimizer, total)

    optimizer, scheduler = make(8)
    for _ in range(8):
        optimizer.step()
        scheduler.step()
    state = pickle.loads(pickle.dumps(scheduler.state_dict()))
    meta = {"config": TrainConfig(epochs=2, lr=0.01).as_dict(), "total_steps": 8}
    for total, said in ((8, False), (12, True)):
        optimizer, scheduler = make(total)
        ctx = Loading(tmp_path, meta, TrainConfig(epochs=3 if said else 2, lr=0.01), total_steps=total)
        SchedulerPart(lambda s=scheduler: s).load_state_dict(state, ctx)
        if not said:
            assert ctx.notes == []
            continue
        after = 0.01 * (1 - 9 / 12) if own else 0.01 * schedules.factor("cosine", 8, 0, 12)
        (note,) = ctx.notes
        assert "total changed from 8 to 12 optimizer steps (--epochs 2 -> 3)" in note
        assert f"goes from 0 to {after:.4g} at step {9 if own else 8}" in note
        # a built-in schedule's rate is the new total's at once; a task's own keeps its reached rate one step
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0 if own else after)


def test_no_scheduler_when_the_rate_never_changes() -> None:
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    assert schedules.build("constant", 0, optimizer, 10) is None


@pytest.mark.parametrize("size", [0, 1, 7, 10, 11])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_evaluation_sample_exactly_once(size: int, world: int) -> None:
    seen = [i for rank in range(world) for i in evaluation.shard(size, rank, world)]
    assert sorted(seen) == list(range(size))


def test_means_are_weighted_by_samples_and_padding_counts_nothing() -> None:
    ranks = [evaluation.Means(), evaluation.Means()]
    ranks[0].add({"loss": 1.0, "acc": torch.tensor(0.5)}, samples=3)
    ranks[0].add({"loss": 100.0, "acc": 0.0}, samples=0)  # a padding batch
    ranks[1].add({"loss": 3.0, "acc": 1.0}, samples=1)
    names = ["acc", "loss"]
    summed = [sum(col) for col in zip(*(m.totals(names) for m in ranks), strict=True)]
    samples, means = evaluation.Means.result(names, summed)
    assert samples == 4
    assert means == {"acc": pytest.approx((0.5 * 3 + 1.0) / 4), "loss": pytest.approx((1.0 * 3 + 3.0) / 4)}
    assert evaluation.Means.result(["loss"], [0.0, 0.0, 0.0]) == (0, {})  # nothing evaluated: missing


def test_a_pair_brings_its_own_weight_and_a_name_no_batch_reported_is_missing() -> None:
    """Finding 7: (total, weight) pairs give token-weighted means, exact over ranks and uneven batches;
    finding 6: a name reported by some batches is averaged over those, one reported by none is missing."""
    ranks = [evaluation.Means(), evaluation.Means()]
    ranks[0].add({"nll": (torch.tensor(12.0), 4), "rare": 2.0}, samples=2)  # 4 tokens in 2 samples
    ranks[0].add({"nll": (3.0, torch.tensor(1)), "never": (5.0, 0)}, samples=1)
    ranks[1].add({"nll": (10.0, 5)}, samples=3)
    names = ["never", "nll", "rare"]
    summed = [sum(col) for col in zip(*(m.totals(names) for m in ranks), strict=True)]
    samples, means = evaluation.Means.result(names, summed)
    assert samples == 6
    assert means == {"nll": pytest.approx(25.0 / 10), "rare": 2.0}  # "never": weight 0 everywhere
    for bad in [(1.0, -1), (1.0, math.inf), (1.0, 2.0, 3.0)]:
        with pytest.raises(ValueError, match="'x'"):
            evaluation.Means().add({"x": bad}, samples=1)


def test_every_reader_of_a_stream_takes_its_own_part() -> None:
    index, count = streams.reader({"RANK": "2", "WORLD_SIZE": "3"})
    assert (index, count) == (2, 3)
    parts = [list(streams.take(range(10), i, 3)) for i in range(3)]
    assert sorted(x for part in parts for x in part) == list(range(10))
