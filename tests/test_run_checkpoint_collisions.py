"""Checkpoints never collide (issue 32, finding 9 and build item 3): a new best at a step already saved reuses
that checkpoint, no rename lands on an existing folder, ranks never race a rename, and `best` is never rotated
away, in both formats; a run stopped in its last step and finished by the resume is finished (finding 11)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_launch_local import finish, start

from hpc_ddp.doctor.probe import PROBE_TASK, Plan, Stop
from hpc_ddp.run.checkpoint import store
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.variables import RESUME_PROBE


def test_install_never_renames_onto_an_existing_folder(tmp_path: Path) -> None:
    final = tmp_path / "ckpt-00000008"
    final.mkdir()
    (final / "old").write_text("old")
    temp = tmp_path / ".ckpt-00000008.tmp-sharded-2"
    temp.mkdir()
    (temp / "new").write_text("new")
    with pytest.raises(OSError):  # what a plain rename does (ENOTEMPTY): the collision of finding 9
        os.rename(temp, final)
    store.install(temp, final, storage=Local())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000008"]
    assert [p.name for p in final.iterdir()] == ["new"]


def records(folder: Path, event: str) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


# 2 ranks x 16 samples: 8 steps an epoch. Saved and evaluated every 4 steps; loss:max finds new bests at 4, 8
# and 12 and not at 16. Stopped at step 8, an epoch's last step (its evaluation then comes after the resume, a
# new best at a step already saved); --keep 1 keeps the best beside the latest.
ARGS = (
    "--nodes", "1", "--gpus-per-node", "2", "--strategy", "fsdp", "--epochs", "2", "--batch-size", "16",
    "--save-every-steps", "4", "--eval-every-steps", "4", "--keep-best", "loss:max", "--keep", "1",
    "--deterministic", "--log-every-s", "0",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.deadline(180)
@pytest.mark.parametrize("fmt", ["sharded"])  # the full format: tests/test_resume_matrix.py (ddp, --keep 1)
def test_fsdp_keep_best_stopped_at_an_epochs_last_step_keeps_its_best_and_finishes_once(
    tmp_path: Path, fmt: str
) -> None:
    plan = Plan("resume_tasks:blocks_eval", str(tmp_path / "trace"), (Stop(0, "train", 8, 0, "epoch end"),))
    args = ("--task", PROBE_TASK, *ARGS, "--checkpoint-format", fmt)
    code, out = finish(start(tmp_path, *args, **{RESUME_PROBE: plan.to_json()}), timeout=170)
    assert code == 0, out
    assert "[launcher] preempted" in out and "could not be written" not in out, out
    evals = records(tmp_path, "eval")
    assert [r["step"] for r in evals] == [4, 8, 12, 16]  # each once: step 8's after the resume
    top = max(evals, key=lambda r: (r["metrics"]["loss"], -r["step"]))["step"]
    best, latest = store.read_best(tmp_path, storage=Local()), store.read_latest(tmp_path, storage=Local())
    assert best is not None and store.ckpt_step(best) == top, out
    assert latest is not None and store.ckpt_step(latest) == 16
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if store.is_checkpoint(p, storage=Local())) == sorted(
        {best.name, latest.name}
    )
    assert not list(ckpts.glob(".*tmp*"))  # no save left a temporary folder behind
    # Finished is finished: the same command trains and writes nothing.
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and "logs" not in p.parts}
    code, out = finish(start(tmp_path, *args, **{RESUME_PROBE: plan.to_json()}), timeout=120)
    assert code == 0, out
    assert "already finished at epoch 2, step 16" in out
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and "logs" not in p.parts}
    assert after == before
