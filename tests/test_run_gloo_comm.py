"""hpc_ddp.run.strategy.gloo_comm: FSDP2's collectives on CPU ranks. The buffer pool's table in this process;
the collectives on a real 3-rank gloo group (tests/gloo_comm_ranks.py), against gloo's own and the sums
written out by hand. Whole fsdp runs go through them on every local run of the suite (test_run_fsdp: the loss
curve against ddp, bitwise resumes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import clean_environ, die_with_test

from hpc_ddp.run.strategy.gloo_comm import BufferPool

CPU = torch.device("cpu")


def test_the_pool_hands_out_a_kept_buffer_only_when_nothing_holds_it() -> None:
    pool = BufferPool(per_size=2)
    a = pool.take((2, 3), torch.float32, CPU)
    assert a.shape == (2, 3)
    b = pool.take((6,), torch.float32, CPU)  # the same size while `a` is held: another buffer
    assert b.data_ptr() != a.data_ptr()
    first = a.data_ptr()
    del a
    again = pool.take((3, 2), torch.float32, CPU)  # `a`'s buffer is free again: reused, in the shape asked
    assert again.data_ptr() == first and again.shape == (3, 2)
    assert all(again is not kept for kept in pool.kept[(6, torch.float32, CPU)])  # a view, never the kept one
    view_of_again = again[1:]
    del again
    assert pool.take((6,), torch.float32, CPU).data_ptr() not in (
        first,
        b.data_ptr(),
    )  # a view still holds it
    del view_of_again
    c = pool.take((6,), torch.float32, CPU)
    assert c.data_ptr() == first
    extra = pool.take((6,), torch.float32, CPU)  # both kept are held: a fresh one, not kept (2 a size)
    assert len(pool.kept[(6, torch.float32, CPU)]) == 2 and extra.data_ptr() not in (first, b.data_ptr())
    assert pool.take((6,), torch.float64, CPU).dtype == torch.float64  # dtypes are kept apart
    assert len(pool.kept) == 2
    # Training over: every kept buffer let go, and none kept from then on.
    del b, c, extra
    pool.release()
    assert pool.kept == {}
    assert pool.take((6,), torch.float32, CPU).shape == (6,) and pool.kept[(6, torch.float32, CPU)] == []


@pytest.mark.slow
@pytest.mark.deadline(120)
def test_the_collectives_on_3_gloo_ranks_match_gloo_and_the_sums_by_hand(tmp_path: Path) -> None:
    world = 3
    # Each rank's output goes to a file, not a pipe: a rank never blocks on a full pipe that the test is not
    # reading yet (it waits on one rank at a time), and what a rank said is still there when it must be killed.
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    ranks = []
    for r in range(world):
        with logs[r].open("w") as log:
            ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-W",
                        "ignore",
                        "-m",
                        "gloo_comm_ranks",
                        str(r),
                        str(world),
                        str(tmp_path / "store"),
                        str(tmp_path / f"rank{r}.json"),
                    ],
                    env=clean_environ(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_test,
                )  # fmt: skip
            )
    # Until all have ended, one has failed (the others would wait on it), or 100 s (within the test's
    # deadline, so that a stuck rank's output is still shown).
    ended = time.monotonic() + 100
    try:
        while time.monotonic() < ended:
            codes = [proc.poll() for proc in ranks]
            if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
                break
            time.sleep(0.2)
    finally:
        for proc in ranks:  # a rank that failed leaves the others waiting on it: they end here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = {r: (proc.returncode, logs[r].read_text()) for r, proc in enumerate(ranks)}
    assert all(code == 0 for code, _ in outputs.values()), outputs
    for r in range(world):
        found = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len(found) == 7 and all(found.values()), (r, found)
