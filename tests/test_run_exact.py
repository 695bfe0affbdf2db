"""Issue 32, the data, RNG and evaluation half: a stop anywhere resumes bit for bit, in-process on a real one-rank
gloo group (the loop is the same at every world size; tests/test_run_exact_ranks.py runs the 2-rank ones).

Each case trains a task of tests/exact_tasks.py twice: straight through, and stopped at a chosen point (the task
notes a SIGUSR2 there, as the handler would), its state gathered as a checkpoint holds it and loaded into a new
Trainer, which trains to the end. Both must end with the same weights, optimizer state, step losses and
evaluation records. The straight runs are shared between the cases that use the same options."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import trainer_state
from conftest import local_checkpoints

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.errors import UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run import tasks
from hpc_ddp.run.config import TrainConfig
from hpc_ddp.run.loop import preemption, rng
from hpc_ddp.run.loop.trainer import Trainer

pytestmark = pytest.mark.deadline(120)


@dataclass
class Ended:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    steps: list[tuple[int, float]]  # (step, loss) of every step record
    lrs: list[float]  # the rate of every step record
    evals: list[tuple[int, dict[str, float]]]
    stopped_at: int | None  # the step the stop came at (None: straight through)


def _records(folder: Path, event: str) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _trainer(cfg: TrainConfig, folder: Path) -> Trainer:
    rng.seed(cfg.seed)  # as a rank starts (hpc_ddp.run.session)
    cfg = cfg.with_folder(str(folder))
    return Trainer(
        cfg, dist_env.detect({}), torch.device("cpu"), tasks.build(cfg), RankLog(0), local_checkpoints(cfg)
    )


def train(cfg: TrainConfig, folder: Path) -> Ended:
    """Train to the end; if the task stops the run, resume a new Trainer from the stopped one's state."""
    stopped_at = None
    with process_group(dist_env.detect({}), torch.device("cpu")):
        with _trainer(cfg, folder) as first:
            outcome = first.run()
            state = trainer_state.gather(first) if not outcome.finished else None
            stopped_at = first.pos.step if not outcome.finished else None
            ended = first
        if state is not None:
            preemption._received[:] = [0, 0]  # the stop was taken: the new process starts without it
            with _trainer(cfg, folder) as second:
                trainer_state.restore(second, state, folder / "stopped.pt")
                assert second.run().finished
                ended = second
        model = {k: v.clone() for k, v in ended.model.state_dict().items()}
        optimizer = ended.strategy.optimizer_state() if ended.strategy.optimizer is not None else {}
    steps = [(r["step"], r["loss"]) for r in _records(folder, "step")]
    lrs = [r["lr"] for r in _records(folder, "step")]
    evals = [(r["step"], r["metrics"]) for r in _records(folder, "eval")]
    return Ended(model, optimizer, steps, lrs, evals, stopped_at)


_straight: dict[TrainConfig, Ended] = {}


def straight(cfg: TrainConfig, tmp_path_factory: pytest.TempPathFactory) -> Ended:
    if cfg not in _straight:
        _straight[cfg] = train(cfg, tmp_path_factory.mktemp("straight"))
    return _straight[cfg]


def stopped(cfg: TrainConfig, folder: Path, monkeypatch: pytest.MonkeyPatch, **at: int) -> Ended:
    """`cfg` stopped once at EXACT_STOP_<KIND>=N for each `kind=N` (tests/exact_tasks.py), then resumed."""
    monkeypatch.setenv("EXACT_STOP_MARK", str(folder / "stop-"))
    for kind, n in at.items():
        monkeypatch.setenv(f"EXACT_STOP_{kind.upper()}", str(n))
    ended = train(cfg, folder)
    assert ended.stopped_at is not None, "the stop never came"
    return ended


def assert_same_end(a: Ended, b: Ended) -> None:
    assert a.steps == b.steps  # every step's loss, in order: no step lost, none twice, the same batches
    assert a.lrs == b.lrs
    assert a.model.keys() == b.model.keys() and all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert str(a.optimizer) == str(b.optimizer)  # tensors printed whole: equal values print equal
    assert a.evals == b.evals


def config(task: str, **more: Any) -> TrainConfig:
    return TrainConfig(
        task=f"exact_tasks:{task}",
        batch_size=8,
        log_every_s=0,
        save_every_epochs=0,
        eval_every_epochs=0,
        **more,
    )


AUGMENTED = config("augmented", epochs=2, num_workers=2, eval_every_steps=5)  # 12 steps an epoch


def test_augmentation_in_workers_resumes_exactly(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 1: random augmentation in __getitem__, read by 2 persistent workers, stopped in epoch 1."""
    ended = stopped(AUGMENTED, tmp_path, monkeypatch, step=16)
    assert ended.stopped_at == 16
    assert_same_end(straight(AUGMENTED, tmp_path_factory), ended)


def test_a_run_stopped_in_its_last_step_and_given_more_steps_trains_on(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-steps 10 stopped in step 10, its last (its end, the final evaluation, still to do), then resumed
    with --max-steps 15: the resume trains on to step 15 (before the fix it only ended the run at step 10, and
    exited), with the evaluation --eval-every-steps 5 has at step 10, as a run of --max-steps 15 does."""
    more = replace(AUGMENTED, num_workers=0, max_steps=15)
    monkeypatch.setenv("EXACT_STOP_MARK", str(tmp_path / "stop-"))
    monkeypatch.setenv("EXACT_STOP_STEP", "10")
    with process_group(dist_env.detect({}), torch.device("cpu")):
        with _trainer(replace(more, max_steps=10), tmp_path) as first:
            assert not first.run().finished and first.pos.step == 10 and first.pos.end_pending
            state = trainer_state.gather(first)
        preemption._received[:] = [0, 0]
        with _trainer(more, tmp_path) as second:
            trainer_state.restore(second, state, tmp_path / "stopped.pt")
            assert not second.finished()
            assert second.run().finished and second.pos.step == 15 and not second.pos.end_pending
            model = {k: v.clone() for k, v in second.model.state_dict().items()}
    reference = straight(more, tmp_path_factory)
    assert [s for s, _ in reference.evals] == [5, 10, 15]
    resumed = [(r["step"], r["metrics"]) for r in _records(tmp_path, "eval")]
    assert resumed == reference.evals and [r["step"] for r in _records(tmp_path, "step")][-1] == 15
    assert all(torch.equal(model[k], reference.model[k]) for k in model)


def test_an_evaluation_that_draws_and_is_stopped_reruns_identically(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 3: the evaluation at step 5 masks its input at random; the stop comes in its second batch."""
    ended = stopped(AUGMENTED, tmp_path, monkeypatch, eval=2)
    assert ended.stopped_at == 5
    reference = straight(AUGMENTED, tmp_path_factory)
    assert_same_end(reference, ended)
    assert len({m["draw"] for _, m in reference.evals}) == len(reference.evals)  # really drawn, per step


def test_a_stop_on_the_step_of_an_evaluation_leaves_it_pending(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 4: the stop lands in step 10, at which --eval-every-steps 5 evaluates: that evaluation runs
    on resume, before any step."""
    ended = stopped(AUGMENTED, tmp_path, monkeypatch, step=10)
    assert ended.stopped_at == 10
    assert [s for s, _ in ended.evals] == [5, 10, 15, 20, 24]  # and at the end
    assert_same_end(straight(AUGMENTED, tmp_path_factory), ended)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_draws_in_iter_resumes_exactly(
    workers: int, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 2: a stream with state whose __iter__ draws; its next batch is fetched before the save. Read
    in the rank's process, and by 2 workers (torchdata's StatefulDataLoader)."""
    cfg = config("drawing_stream", epochs=2, num_workers=workers, grad_accum=2, eval_every_steps=4)
    ended = stopped(cfg, tmp_path, monkeypatch, step=7)  # the first micro-batch of step 4
    assert ended.stopped_at == 4
    assert_same_end(straight(cfg, tmp_path_factory), ended)


def test_dataloader_workers_end_when_the_trainer_closes(tmp_path: Path) -> None:
    """Finding 13: persistent workers (training and evaluation) end at close, not when the garbage collector
    frees their iterator (it lives in a reference cycle: its queues were finalized first, the workers never
    heard the end and the join waited 5 s per worker, 20-25 s at the end of every run)."""
    import psutil

    def workers() -> list[psutil.Process]:
        return [p for p in psutil.Process().children() if p.name() == "pt_data_worker"]

    cfg = config("augmented", epochs=1, max_steps=3, num_workers=2, eval_every_steps=2)
    with process_group(dist_env.detect({}), torch.device("cpu")):
        with _trainer(cfg, tmp_path) as trainer:
            assert trainer.run().finished
            assert len(workers()) == 4  # 2 training and 2 evaluation workers
        assert workers() == []


def test_evaluation_weighting_is_one_rule_and_missing_is_missing(tmp_path: Path) -> None:
    """Findings 6 and 7: batches counted by what the loader collated (a 0-dim tensor first in a dict batch
    counted 1 sample), a (sum, count) pair for a token-weighted mean, and a value that a later evaluation does
    not report absent from its record (not 0.0), so it cannot win --keep-best rare:min."""
    cfg = config("weighted", epochs=1, max_steps=4, eval_every_steps=2, keep_best="rare:min")
    with process_group(dist_env.detect({}), torch.device("cpu")):
        with _trainer(cfg, tmp_path) as trainer:
            assert trainer.run().finished
            best = trainer.best
    evals = _records(tmp_path, "eval")
    assert [(r["step"], r["samples"]) for r in evals] == [(2, 37), (4, 37)]
    lengths = [1 + i % 5 for i in range(37)]
    for r in evals:
        assert r["metrics"]["id_mean"] == pytest.approx(18.0)
        assert r["metrics"]["per_token"] == pytest.approx(
            sum(i * n for i, n in enumerate(lengths)) / sum(lengths)
        )
    assert "rare" in evals[0]["metrics"] and "rare" not in evals[1]["metrics"]
    assert best is not None and (best.step, best.value) == (2, 1.0)


@pytest.mark.parametrize("schedule", ["warmup_cosine", "annealing"])
def test_a_schedule_over_a_stream_without_a_known_total_is_one_line_at_start(
    schedule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 8: the factory got total_steps=0 and a warm-up + cosine trained at lr 0 from step 2, silently.
    Now it gets None, and a schedule that needs the total fails at start (its factory or its first step),
    saying what None means and the fix."""
    monkeypatch.setenv("SCHEDULE", schedule)
    cfg = config("stream_schedule", epochs=1)
    with process_group(dist_env.detect({}), torch.device("cpu")):
        with pytest.raises(
            UsageError, match=r"Task.scheduler\(optimizer, None\) raised TypeError: .*--max-steps"
        ):
            _trainer(cfg, tmp_path)
        with _trainer(replace(cfg, max_steps=6), tmp_path) as trainer:  # with a total: trains at a real rate
            assert trainer.run().finished
    assert all(r["lr"] > 0 for r in _records(tmp_path, "step"))


@pytest.mark.parametrize(
    ("task", "more", "message"),
    [
        ("plateau_without_eval", {}, "ReduceLROnPlateau, which is stepped with an evaluation value, but the"),
        (
            "plateau",
            {"plateau_metric": "f1"},
            "--plateau-metric f1: the evaluation reports draw, mse, not 'f1'",
        ),
        (
            "no_grad_loss",
            {},
            "the training step's loss does not require gradients (computed under torch.no_gr",
        ),
    ],
)
def test_a_plateau_nothing_can_step_and_a_loss_without_gradients_are_one_line(
    task: str, more: dict, message: str, tmp_path: Path
) -> None:
    """Part of finding 15: ReduceLROnPlateau passed the start and failed in the loop (retried, exit 1); a loss
    computed under no_grad ended in an internal hook error (retried, exit 1). Usage errors now: exit 2."""
    cfg = config(task, epochs=1, eval_every_steps=2, **more)
    with process_group(dist_env.detect({}), torch.device("cpu")):
        with pytest.raises(UsageError) as raised:
            with _trainer(cfg, tmp_path) as trainer:
                trainer.run()
    assert message in str(raised.value)


PLATEAU = config("plateau", epochs=1, eval_every_steps=2, plateau_metric="draw")  # 6 evaluations in 12 steps


def test_reduce_lr_on_plateau_steps_with_each_evaluation_and_resumes_exactly(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ReduceLROnPlateau (mode max on the evaluation's `draw`) halves the rate after each evaluation that is
    not a new maximum, and a run stopped during the evaluation at step 6 reduces it where the other did."""
    reference = straight(PLATEAU, tmp_path_factory)
    draws = [m["draw"] for _, m in reference.evals]
    lrs = reference.lrs
    expected, rate, top = [], 0.01, -1.0
    for s in range(1, 13):
        expected.append(rate)
        if s % 2 == 0 and s < 12:  # stepped after the evaluation at s (12's comes after the last step)
            draw = draws[s // 2 - 1]
            rate, top = (rate, draw) if draw > top else (rate * 0.5, top)
    assert lrs == pytest.approx(expected) and min(lrs) < 0.01
    ended = stopped(PLATEAU, tmp_path, monkeypatch, eval=5)  # 24 samples in 3 batches: step 4's second
    assert ended.stopped_at == 4
    assert_same_end(reference, ended)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, []),
        ({"stream": True, "stream_state": True}, []),
        ({"stream": True, "stream_state": True, "workers": 2, "stateful_loader": True}, []),
        ({"stream": True}, ["the IterableDataset has no state_dict()/load_state_dict()"]),
        (
            {"stream": True, "stream_state": True, "workers": 2},
            ["read by DataLoader workers and torchdata is not"],
        ),
        ({"cuda": True}, ["CUDA kernels are not deterministic without --deterministic"]),
        ({"cuda": True, "deterministic": True}, []),
        ({"stream": True, "cuda": True}, ["has no state_dict()", "without --deterministic"]),
    ],
)
def test_what_cannot_resume_bitwise_is_known_at_start(given: dict, expected: list[str]) -> None:
    """Build item 11 (pure): each reason a run cannot be exact, with its fix."""
    from hpc_ddp.run.checkpoint import exact

    options = {"stream": False, "stream_state": False, "workers": 0, "stateful_loader": False, "cuda": False}
    why = exact.limits(**{**options, "deterministic": False, **given})
    assert len(why) == len(expected) and all(e in w for e, w in zip(expected, why, strict=True))


def test_run_json_says_whether_the_run_is_exact(tmp_path: Path) -> None:
    from hpc_ddp.run.records import record

    record.write(tmp_path, {}, {}, str(tmp_path), ["the IterableDataset has no state_dict()"])
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["exact"] is False and written["not_exact"] == ["the IterableDataset has no state_dict()"]
    record.write(tmp_path, {}, {}, str(tmp_path), [])
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["exact"] is True and "not_exact" not in written
