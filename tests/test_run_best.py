"""--keep-best: which evaluation is the best (a table), what a checkpoint keeps of it, and the store's rotation
that never deletes the checkpoint `best` names."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpc_ddp.errors import UsageError
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.loop.best import Best


@pytest.mark.parametrize(
    ("mode", "values", "best_step"),
    [
        ("max", [0.5, 0.7, 0.6], 2),
        ("min", [0.5, 0.7, 0.6], 1),
        ("max", [0.5, 0.5, 0.4], 1),  # a tie keeps the earlier one
        ("min", [math.nan, 0.9, math.inf], 2),  # not finite: never the best
        ("max", [math.nan, math.nan], None),
        ("min", [3.0, 2.0, 1.0], 3),
    ],
)
def test_the_best_is_chosen_by_mode_strictly_and_only_among_finite_values(
    mode: str, values: list[float], best_step: int | None
) -> None:
    best = Best("acc", mode)
    news = [best.offer(step, {"acc": v, "loss": 1.0}) for step, v in enumerate(values, start=1)]
    assert best.step == best_step
    assert news.count(True) == len({s for s, new in enumerate(news, start=1) if new})
    if best_step is not None:
        assert news[best_step - 1] and best.value == values[best_step - 1]


def test_an_evaluation_that_did_not_report_the_name_cannot_be_the_best() -> None:
    """Finding 6: missing is missing, never 0.0, and never the best (here the minimum), after a resume too."""
    best = Best("rare", "min")
    assert best.offer(2, {"rare": 0.5, "loss": 1.0})
    assert not best.offer(4, {"loss": 0.1})
    assert (best.step, best.value) == (2, 0.5)
    resumed = Best("rare", "min")
    resumed.load_state_dict(best.state_dict())
    assert not resumed.offer(6, {"loss": 0.1}) and resumed.step == 2


def test_a_name_the_evaluation_does_not_report_is_one_usage_line() -> None:
    with pytest.raises(UsageError, match=r"--keep-best acc:max: the evaluation reports loss, mse, not 'acc'"):
        Best("acc", "max").offer(3, {"mse": 1.0, "loss": 2.0})


def test_the_best_survives_a_checkpoint_and_another_rule_starts_afresh() -> None:
    best = Best("loss", "min")
    best.offer(4, {"loss": 0.25})
    resumed = Best("loss", "min")
    assert resumed.load_state_dict(best.state_dict()) is None
    assert (resumed.value, resumed.step) == (0.25, 4)
    assert not resumed.offer(9, {"loss": 0.3})  # compares against the real best, not the first after resume
    other = Best("accuracy", "max")
    note = other.load_state_dict(best.state_dict())
    assert note and "best was by loss:min" in note and other.value is None
    assert Best("loss", "min").load_state_dict(None) is None  # a checkpoint from before --keep-best


def _ckpt(folder: Path, step: int) -> Path:
    path = store.ckpt_dir(folder) / store.ckpt_name(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_rotation_keeps_the_best_beside_the_keep_newest_and_drops_a_dethroned_one(tmp_path: Path) -> None:
    keep = 2
    first = _ckpt(tmp_path, 10)
    store.promote(tmp_path, first, keep, storage=Local())
    store.point_best(tmp_path, first, keep, storage=Local())
    for step in (20, 30, 40):
        store.promote(tmp_path, _ckpt(tmp_path, step), keep, storage=Local())
    # 40 and 30 are the keep newest; 10 is the best, never rotated away; 20 went.
    assert [store.ckpt_step(p) for p in store.list_checkpoints(tmp_path, storage=Local())] == [40, 30, 10]
    assert store.read_best(tmp_path, storage=Local()) == first and store.read_latest(
        tmp_path, storage=Local()
    ) == tmp_path / "checkpoints" / (store.ckpt_name(40))
    newer = _ckpt(tmp_path, 50)
    store.promote(tmp_path, newer, keep, storage=Local())
    store.point_best(
        tmp_path, newer, keep, storage=Local()
    )  # a new best: the old one is an ordinary old checkpoint now
    assert [store.ckpt_step(p) for p in store.list_checkpoints(tmp_path, storage=Local())] == [50, 40]
    assert store.read_best(tmp_path, storage=Local()) == newer
    assert (store.ckpt_dir(tmp_path) / store.BEST).read_text() == "ckpt-00000050.pt\n"


def test_keep_one_with_a_best_keeps_exactly_two(tmp_path: Path) -> None:
    store.promote(tmp_path, _ckpt(tmp_path, 1), 1, storage=Local())
    store.point_best(tmp_path, store.ckpt_dir(tmp_path) / store.ckpt_name(1), 1, storage=Local())
    for step in range(2, 6):
        store.promote(tmp_path, _ckpt(tmp_path, step), 1, storage=Local())
    assert [store.ckpt_step(p) for p in store.list_checkpoints(tmp_path, storage=Local())] == [5, 1]
    assert store.latest_step(tmp_path, storage=Local()) == 5  # `best` never changes what a resume starts from
