"""The resume check as a property test (issue 32, "Tests"): over a matrix of task shapes, a run stopped at seeded
points resumes bit for bit, or the task is refused at start with its line. One `python -m hpc_ddp.doctor resume`
per cell (tests/matrix_tasks.py: the shapes).

The shapes: map-style and stream; 0 and 2 DataLoader workers; ddp and fsdp. Each pair of these three appears in
some cell (four cells, an orthogonal array), and the other features ride along: random augmentation while
making samples, an evaluation that draws random numbers, --grad-accum, BatchNorm, --keep-best (with --keep 1:
the best beside the latest, in both formats), and a run ended by --max-steps inside an epoch (its end, the final
evaluation and the epoch's record, comes after its last step). What proves a cell at the least cost: 2 ranks
(the fewest that exercise the distributed paths: DDP's buffer broadcast, fsdp's shards, a stream's parts), 2
epochs of 4 steps (an epoch's last step inside the run, 8 steps in all), an evaluation every 2 steps and a save
every 3. Each cell stops its run at 3 kinds of the 6 points the check knows (each stop is one more start: ranks,
rendezvous, resume): the run's last step always (a stop, then only the run's end to do), two others chosen with
the points by a seed per cell, the same in every run, so that the four cells cover the six kinds;
RESUME_MATRIX_SEED (default 0) explores other points, and a failure names its seed.

Every cell passes on main (a cell that did not would be left out, never marked xfail)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

SEED = int(os.environ.get("RESUME_MATRIX_SEED", "0"))
STOPS = 3  # kinds of stop points per cell (of the 6 the check knows): the cells' seeds cover all 6
SHAPE = ("--epochs", "2", "--batch-size", "16", "--eval-every-steps", "2", "--save-every-steps", "3")

# name: (MATRIX_* settings, options)
CELLS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "map-0workers-ddp-batchnorm": (
        {"MATRIX_DATA": "map", "MATRIX_BN": "1"},
        tuple("--num-workers 0 --strategy ddp".split()),
    ),
    "map-2workers-fsdp-augment-evalrng-accum-batchnorm-best": (
        {"MATRIX_DATA": "map", "MATRIX_AUG": "1", "MATRIX_BN": "1", "MATRIX_EVAL": "1"},
        tuple("--num-workers 2 --strategy fsdp --grad-accum 2 --keep-best loss:min --keep 1".split()),
    ),
    "stream-0workers-fsdp-augment-evalrng-accum-best-maxsteps": (
        {"MATRIX_DATA": "stream", "MATRIX_AUG": "1", "MATRIX_EVAL": "1"},
        tuple("--num-workers 0 --strategy fsdp --grad-accum 2 --keep-best loss:min --max-steps 7".split()),
    ),
    "stream-2workers-ddp-augment-evalrng-accum-batchnorm-best": (
        {"MATRIX_DATA": "stream", "MATRIX_AUG": "1", "MATRIX_BN": "1", "MATRIX_EVAL": "1"},
        tuple("--num-workers 2 --strategy ddp --grad-accum 2 --keep-best loss:min --keep 1".split()),
    ),
}


def check(folder: Path, matrix: dict[str, str], options: tuple[str, ...], seed: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "hpc_ddp.doctor", "resume", "--task", "matrix_tasks:build", *SHAPE, *options]
    cmd += ["--stops", str(STOPS), "--stop-seed", str(seed), "--folder", str(folder)]
    proc = subprocess.run(
        cmd,
        env=clean_environ(**matrix),
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=die_with_test,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.deadline(300)
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_a_stopped_run_resumes_bitwise_or_is_refused_at_start(tmp_path: Path, cell: str) -> None:
    matrix, options = CELLS[cell]
    # Each cell its own points, the same in every run: with RESUME_MATRIX_SEED=0 (the cells' --stop-seed 4 to 7)
    # the four cells' stops are of all six kinds (the run's last step in each, its training or its final
    # evaluation; an epoch's last step, a save in flight, an evaluation, the first step after a resume, within
    # accumulation in some).
    seed = (SEED + 1) * len(CELLS) + list(CELLS).index(cell)
    code, out = check(tmp_path, matrix, options, seed)
    refused = code == 2 and "was refused at start: " in out
    assert code == 0 or refused, f"cell {cell}, --stop-seed {seed} (RESUME_MATRIX_SEED={SEED}):\n{out}"
    if code == 0:
        assert "every stop matched" in out
        # Every stop happened where it was meant to, one in the run's last step (its training, or its final
        # evaluation): then only the run's end to do, and the same command on the finished run changes nothing
        # (the check's last word). Ended by --max-steps, the run's last step is inside its second epoch.
        found = re.search(r"uninterrupted: (\d+) steps; now stopped", out)
        assert found is not None, out
        steps, micro = int(found.group(1)), 2 if "--grad-accum" in options else 1
        cut = "--max-steps" in options
        assert steps == 7 or not cut, out
        last = rf"in the run's last step: (micro-batch \d of {micro} of step|batch \d of \d of the evaluation at step)"
        assert re.search(rf"stop \d, {last} {steps}\n", out), out
        finished = (tmp_path / "finished.log").read_text()
        assert f"already finished at epoch {1 if cut else 2}, step {steps}" in finished
        if "MATRIX_EVAL" not in matrix:
            assert "not tried: during an evaluation: the task has no evaluation (Task.eval_dataset)" in out
