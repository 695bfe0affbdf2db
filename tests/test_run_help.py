"""`--help` tells the truth (issue 37 item 7): every option of every entry point shows its default, and each
text the issue found wrong is compared with the behaviour it describes: the task list, --folder's default per
entry point, --log-every-s and metrics.jsonl, --lr's default, --eval-every-steps "instead"."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import local_checkpoints
from torch import nn
from torch.utils.data import TensorDataset

from hpc_ddp import submit, train
from hpc_ddp.cli import build_parser
from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.doctor import checkup, resume
from hpc_ddp.log import RankLog
from hpc_ddp.run import configfile, folder, tasks
from hpc_ddp.run.config import TrainConfig, add_train_arguments
from hpc_ddp.run.loop.position import Position
from hpc_ddp.run.loop.trainer import Trainer
from hpc_ddp.run.records import metrics


def train_parser() -> argparse.ArgumentParser:
    parser = build_parser(train.PROG, "")
    configfile.add_argument(parser)
    add_train_arguments(parser, train.FOLDER_DEFAULT)
    return parser


PARSERS = {
    "train": train_parser,
    "submit": submit.build_argparser,
    "doctor": checkup.build_argparser,
    "doctor resume": resume.build_argparser,
}


def helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each long option's help as --help prints it (on one line)."""
    formatter = parser._get_formatter()
    out = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if longs and longs[0] != "--help":
            out[longs[0]] = " ".join(formatter._expand_help(action).split())
    return out


@pytest.mark.parametrize("entry", sorted(PARSERS))
def test_every_option_shows_its_default(entry: str) -> None:
    missing = [o for o, text in helps(PARSERS[entry]()).items() if "(default: " not in text]
    assert missing == [], f"{entry} --help: no default shown for {missing}"


def test_each_training_option_shows_the_default_it_has() -> None:
    """`--lr` showed none ("the default SGD" in its text was taken for one)."""
    shown = helps(train_parser())
    assert "(default: 0.01)" in shown["--lr"]
    for f in dataclasses.fields(TrainConfig):
        text = shown[f"--{f.name.replace('_', '-')}"]
        said = re.findall(r"\(default: ([^)]*)\)", text)[-1]
        if f.name in ("backend", "folder"):  # said in words: the backend by device, the folder by entry point
            continue
        expected = "off" if f.type in ("bool", bool) else ("none" if f.default == "" else str(f.default))
        assert said == expected, (f.name, said, f.default)


def test_the_task_list_is_every_builtin_task() -> None:
    """It listed (linear, mlp); gpt and cnn exist too."""
    text = helps(train_parser())["--task"]
    listed = re.search(r"a built-in task \(([^)]*)\)", text)
    assert listed is not None and listed.group(1).split(", ") == list(tasks.BUILTINS)


def test_folder_says_where_each_entry_point_puts_a_run() -> None:
    """It said runs/<job id> everywhere; a local run goes to runs/<task>, a submitted one elsewhere again."""
    assert "(default: runs/<job id>, " in helps(train_parser())["--folder"]
    assert folder.default_for_task("42") == Path("runs/42")
    said = helps(submit.build_argparser())["--folder"]
    assert (
        "--local: runs/<task>, e.g. runs/linear" in said
        and "a Slurm job: runs/<job-name>-<task>, absolute" in said
        and "--doctor: runs/doctor-<job-name>-<timestamp>" in said
    )
    assert folder.default_for_local_run("linear") == Path("runs/linear")
    submitted = folder.default_for_submission("hpc_ddp", "mytasks:build")
    assert (
        submitted.is_absolute()
        and submitted.parent.name == "runs"
        and submitted.name == "hpc_ddp-mytasks-build"
    )


def test_log_every_s_says_every_step_of_a_short_run_is_recorded(tmp_path: Path) -> None:
    """It said it set how often records reach metrics.jsonl; every step of a short run is recorded."""
    text = helps(train_parser())["--log-every-s"]
    assert f"metrics.jsonl gets a step record every step of a run of up to {metrics.POINTS:,} steps" in text
    recorder = metrics.Recorder(tmp_path, TrainConfig(log_every_s=30), dist_env.detect({}), total_steps=10)
    pos = Position()
    for step in range(1, 11):
        pos.step = step
        recorder.step(pos, loss=1.0, samples=8)
    recorder.close()
    steps = [r["step"] for r in metrics.read_records(tmp_path / "metrics.jsonl") if r["event"] == "step"]
    assert steps == list(range(1, 11))


def evaluated_at(tmp_path: Path, **options: int) -> list[int]:
    """The steps a one-rank run of 2 epochs x 8 steps evaluates at."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randn(64, 1, generator=gen))
    task = tasks.Task(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, eval_dataset=data)
    tmp_path.mkdir()
    cfg = TrainConfig(epochs=2, batch_size=8, save_every_epochs=0, folder=str(tmp_path), **options)  # type: ignore[arg-type]
    env = dist_env.detect({})
    with process_group(env, torch.device("cpu")):
        with Trainer(cfg, env, torch.device("cpu"), task, RankLog(0), local_checkpoints(cfg)) as trainer:
            assert trainer.run().finished
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["event"] == "eval"]


def test_eval_every_steps_evaluates_instead_of_every_epoch(tmp_path: Path) -> None:
    """It said "instead", and the epochs' evaluations (step 8) still ran; both when both are given."""
    assert (
        "evaluate every N optimizer steps instead of every epoch"
        in helps(train_parser())["--eval-every-steps"]
    )
    assert evaluated_at(tmp_path / "steps", eval_every_steps=3) == [3, 6, 9, 12, 15, 16]
    assert evaluated_at(tmp_path / "both", eval_every_steps=3, eval_every_epochs=1) == [
        3,
        6,
        8,
        9,
        12,
        15,
        16,
    ]
    assert evaluated_at(tmp_path / "epochs") == [8, 16]
