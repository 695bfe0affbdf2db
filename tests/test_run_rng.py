"""hpc_ddp.run.loop.rng: --seed starts every generator a step may draw from, and a checkpoint's `rng` part puts each
back where it was (the real runs: test_run_models' scheduler test, test_run_fsdp's bitwise resume)."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from hpc_ddp.run.loop import rng

CPU = torch.device("cpu")


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_the_same_seed_gives_the_same_draws_from_every_generator() -> None:
    rng.seed(7)
    first = [draws() for _ in range(3)]
    rng.seed(7)
    assert [draws() for _ in range(3)] == first
    rng.seed(8)
    assert all(a != b for a, b in zip(draws(), first[0], strict=True))


def test_a_saved_state_loaded_under_weights_only_draws_what_would_have_come_next() -> None:
    rng.seed(3)
    draws()
    buffer = io.BytesIO()
    torch.save(rng.state(CPU), buffer)
    expected = [draws() for _ in range(3)]
    rng.seed(99)  # elsewhere, as a resumed process would be
    buffer.seek(0)
    rng.load(torch.load(buffer, weights_only=True), CPU)
    assert [draws() for _ in range(3)] == expected


def test_a_checkpoint_without_numpys_state_leaves_numpy_on_its_stream() -> None:
    rng.seed(5)
    saved = rng.state(CPU)
    del saved["numpy"]  # a checkpoint written before NumPy's state was kept
    np.random.seed(11)
    expected = np.random.rand()
    np.random.seed(11)
    rng.load(saved, CPU)
    assert np.random.rand() == expected
