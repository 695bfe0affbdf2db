"""The task's own settings (issue 46): `[task-args]` in --config and `--task-arg`, read-only in the task, recorded,
round-tripped through config.toml and the tasks' command line, sent to the trackers, checked on resume; the
gradient norm in the step records; --prefetch-factor without workers refused."""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import clean_environ, local_checkpoints, run_module

from hpc_ddp.cli import build_parser
from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.group import process_group
from hpc_ddp.errors import UsageError
from hpc_ddp.log import RankLog
from hpc_ddp.run import configfile, tasks
from hpc_ddp.run.config import TrainConfig, add_train_arguments, differences, from_namespace
from hpc_ddp.run.loop.trainer import Trainer
from hpc_ddp.run.records import progress
from hpc_ddp.run.records.metrics import read_records
from hpc_ddp.run.sinks import trackers
from hpc_ddp.run.taskargs import TaskArgs


def parser() -> argparse.ArgumentParser:
    p = build_parser("test", "")
    configfile.add_argument(p)
    add_train_arguments(p)
    return p


def parse(*argv: str) -> TrainConfig:
    return from_namespace(configfile.parse(parser(), list(argv)))


def toml_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_the_command_line_overrides_the_file_key_by_key(tmp_path: Path) -> None:
    path = toml_file(tmp_path, 'epochs = 2\n[task-args]\ndepth = 12\nname = "wide"\nsizes = [64, 128]\n')
    cfg = parse(
        "--config", path, "--task-arg", "depth=16", "--task-arg", "lr=3e-4", "--task-arg", "tag=plain text"
    )
    assert cfg.epochs == 2
    assert dict(cfg.task_args) == {
        "depth": 16,
        "name": "wide",
        "sizes": (64, 128),
        "lr": 3e-4,
        "tag": "plain text",
    }
    # A quoted value is a string even when it looks like a number; a TOML date stays the text written.
    cfg = parse("--task-arg", 'n="12"', "--task-arg", "day=2024-01-01", "--task-arg", "on=true")
    assert dict(cfg.task_args) == {"n": "12", "day": "2024-01-01", "on": True}
    assert parse().task_args == {}


def test_task_args_are_read_only_hashable_and_pickle() -> None:
    cfg = TrainConfig(task_args={"depth": 12, "sizes": [1, 2], "inner": {"a": 1}})
    args = cfg.task_args
    assert isinstance(args, TaskArgs) and args["sizes"] == (1, 2) and isinstance(args["inner"], TaskArgs)
    with pytest.raises(TypeError):
        args["depth"] = 13  # type: ignore[index]
    with pytest.raises(AttributeError):
        args._items = {}  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # submitit pickles the config
    assert hash(cfg) == hash(pickle.loads(pickle.dumps(cfg)))
    assert json.loads(json.dumps(cfg.as_dict()))["task_args"] == {
        "depth": 12,
        "sizes": [1, 2],
        "inner": {"a": 1},
    }


def test_config_toml_and_the_tasks_argv_give_the_same_settings_back(tmp_path: Path) -> None:
    cfg = parse(
        "--epochs",
        "3",
        "--task-arg",
        "depth=16",
        "--task-arg",
        'name="a \\"b\\" é"',
        "--task-arg",
        "x=1.5",
        "--task-arg",
        "sizes=[1, 2]",
        "--task-arg",
        "t={a = 1}",
    )
    configfile.save(tmp_path, cfg)
    text = (tmp_path / "config.toml").read_text()
    assert "[task-args]\ndepth = 16\n" in text
    assert parse("--config", str(tmp_path / "config.toml")) == cfg
    argv = cfg.to_argv()
    assert "--task-arg=depth=16" in argv and "--task-arg=x=1.5" in argv
    assert from_namespace(parser().parse_args(argv)) == cfg  # what every task of a job parses


@pytest.mark.parametrize(
    ("argv", "table", "message"),
    [
        (["--task-arg", "novalue"], "", r"^--task-arg 'novalue': no '='; a task setting is KEY=VALUE"),
        (["--task-arg", "=3"], "", r"^--task-arg '=3': an empty key: a task setting's name is letters"),
        (["--task-arg", "a b=3"], "", r"^--task-arg 'a b=3': key 'a b'"),
        ([], "task-args = 3\n", r"task-args = 3: \[task-args\] must be a table of the task's settings. Fix:"),
        ([], "[task-args]\nday = 2024-01-01\n", r"day = 2024-01-01: a date or time; quote it"),
        ([], 'task-arg = "x=1"\n', r"the task's settings go in a \[task-args\] table"),
    ],
)
def test_bad_task_settings_are_one_line(argv: list[str], table: str, message: str, tmp_path: Path) -> None:
    if table:
        argv = ["--config", toml_file(tmp_path, table), *argv]
    with pytest.raises(UsageError, match=message) as caught:
        parse(*argv)
    assert "\n" not in str(caught.value)


def test_a_resume_with_other_task_settings_is_a_difference() -> None:
    saved = TrainConfig(task_args={"depth": 12, "name": "a"}).as_dict()
    assert differences(saved, TrainConfig(task_args={"depth": 12, "name": "a"})) == []
    assert differences(saved, TrainConfig(task_args={"depth": 12.0, "name": "a"})) == [
        "--task-arg depth=12 (now 12.0)"
    ]
    assert differences(saved, TrainConfig(task_args={"depth": 12, "new": 1})) == [
        '--task-arg name="a" (now unset)',
        "--task-arg new unset (now 1)",
    ]
    del saved["task_args"]  # a run recorded before task settings existed: nothing to compare
    assert differences(saved, TrainConfig(task_args={"depth": 3})) == []


def test_trackers_get_the_options_in_full_the_task_settings_and_the_tasks_own_parts(tmp_path: Path) -> None:
    cfg = TrainConfig(task="task_args_tasks:scheduled", epochs=1, task_args={"depth": 12, "sizes": [1, 2]})
    env = dist_env.detect({})
    with process_group(env, torch.device("cpu")):
        cfg = cfg.with_folder(str(tmp_path))
        with Trainer(
            cfg, env, torch.device("cpu"), tasks.build(cfg), RankLog(0), local_checkpoints(cfg)
        ) as trainer:
            params = trainer.metrics.params
    assert params is not None
    assert params["lr_schedule"] == "Task.scheduler (LambdaLR)"  # not --lr-schedule's default, "constant"
    assert params["optimizer"] == "Task.optimizer (AdamW)"
    assert params["task_args.depth"] == 12 and params["task_args.sizes"] == [1, 2]
    options = {k for k in cfg.as_dict() if k != "task_args"}
    assert options <= set(params)  # every kit option, in full
    assert trackers.run_params(TrainConfig().as_dict())["lr_schedule"] == "constant"
    # What a tracker sink is handed: the Recorder's params (a wandb/mlflow run gets them as its config).
    got: list[Any] = []
    from hpc_ddp.run import sinks

    monkey = pytest.MonkeyPatch()
    monkey.setattr(trackers, "open_all", lambda value, folder, config: got.append(dict(config)) or [])
    try:
        sinks.optional(tmp_path, TrainConfig(tracker="", task_args={"a": 1}), params)
        assert got == []  # no --tracker: nothing opened
        object.__setattr__(cfg, "tracker", "wandb")  # open_all is patched: no package needed
        sinks.optional(tmp_path, cfg, params)
    finally:
        monkey.undo()
    assert got == [params]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor (fsdp): on one rank, its shard is all of it
    return to_local() if to_local is not None else tensor


def run_steps(cfg: TrainConfig, folder: Path, wrap: str) -> tuple[list[float], list[dict[str, Any]]]:
    """A real Trainer's run of `cfg` on a one-rank gloo group, the strategy's `wrap` method recording what it
    returns (and, for grad_norm, the norm of the gradients computed apart); the step records."""
    env = dist_env.detect({})
    seen: list[float] = []
    with process_group(env, torch.device("cpu")):
        torch.manual_seed(cfg.seed)
        cfg = cfg.with_folder(str(folder))
        with Trainer(
            cfg, env, torch.device("cpu"), tasks.build(cfg), RankLog(0), local_checkpoints(cfg)
        ) as trainer:
            strategy = trainer.strategy
            original = getattr(strategy, wrap)

            def recorded(*args: Any) -> torch.Tensor:
                if (
                    wrap == "grad_norm"
                ):  # computed apart: every gradient as one vector (fsdp: one rank's shards)
                    grads = [_local(p.grad).flatten() for p in strategy.parameters() if p.grad is not None]
                    apart = float(torch.linalg.vector_norm(torch.cat(grads)))
                norm = original(*args)
                seen.append(float(norm))
                if wrap == "grad_norm":
                    assert float(norm) == pytest.approx(apart, rel=1e-6)
                return norm

            setattr(strategy, wrap, recorded)
            trainer.run()
    return seen, [r for r in read_records(folder / "metrics.jsonl") if r["event"] == "step"]


@pytest.mark.parametrize(
    ("clip", "wrap", "strategy"),
    [
        (0.05, "clip_grad_norm", "ddp"),
        (0.0, "grad_norm", "ddp"),
        (0.05, "clip_grad_norm", "fsdp"),
        (0.0, "grad_norm", "fsdp"),
    ],
)
def test_grad_norm_is_the_clippings_norm_in_every_step_record(
    clip: float, wrap: str, strategy: str, tmp_path: Path
) -> None:
    cfg = TrainConfig(
        epochs=1, batch_size=64, clip_grad=clip, save_every_epochs=0, log_every_s=1e9, strategy=strategy
    )
    seen, steps = run_steps(cfg, tmp_path, wrap)
    assert len(steps) == len(seen) >= 10  # a record for every step of a short run
    assert [r["grad_norm"] for r in steps] == seen  # rank 0's, exactly (the same on every rank after DDP)
    assert all(n > clip for n in seen)  # before clipping
    line = progress.line(steps[0], grad_norm=True)
    assert f"grad_norm {progress.value_text(seen[0])}" in line and "grad_norm" not in progress.line(steps[0])
    assert trackers.scalars_of(steps[0])["train/grad_norm"] == seen[0]


def test_prefetch_factor_without_workers_is_refused() -> None:
    with pytest.raises(
        UsageError, match=r"^--prefetch-factor 4 needs DataLoader workers, and --num-workers is auto"
    ):
        TrainConfig(prefetch_factor=4)
    assert TrainConfig(prefetch_factor=4, num_workers=2).prefetch_factor == 4


@pytest.mark.process
@pytest.mark.deadline(60)
def test_bad_input_at_the_entry_point_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for argv, said in (
        (["--task-arg", "novalue"], "--task-arg 'novalue': no '='"),
        (["--prefetch-factor", "2"], "--prefetch-factor 2 needs DataLoader workers"),
    ):
        proc = run_module("hpc_ddp.train", *argv, "--folder", str(tmp_path), timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], proc.stderr


@pytest.mark.process
@pytest.mark.deadline(60)
def test_print_sbatch_shows_and_passes_the_task_settings(tmp_path: Path) -> None:
    proc = run_module(
        "hpc_ddp.submit",
        "--print-sbatch",
        "--folder",
        str(tmp_path),
        "--task-arg",
        "depth=12",
        "--task-arg",
        "name=wide",
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stderr.splitlines() if line.startswith("# every task runs:")]
    assert runs and "--task-arg=depth=12" in runs[0] and "'--task-arg=name=\"wide\"'" in runs[0]
    assert "--task-arg=depth=12" in proc.stdout


def local(folder: Path, *args: str) -> Any:
    return run_module(
        "hpc_ddp.submit",
        "--local",
        "--nodes",
        "1",
        "--tasks-per-node",
        "1",
        "--folder",
        str(folder),
        "--task",
        "task_args_tasks:sized",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        *args,
        cwd=folder.parent,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.deadline(150)
def test_a_run_records_its_settings_and_refuses_a_resume_with_others(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    first = local(folder, "--task-arg", "width=3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert json.loads((folder / "run.json").read_text())["config"]["task_args"] == {"width": 3}
    assert "[task-args]\nwidth = 3\n" in (folder / "config.toml").read_text()
    again = local(folder, "--task-arg", "width=4")
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    said = [
        line for line in (again.stdout + again.stderr).splitlines() if "--task-arg width=3 (now 4)" in line
    ]
    assert said and "Fix:" in said[0], again.stdout[-2000:] + again.stderr[-2000:]


def test_the_resume_doctor_passes_the_settings_to_both_its_runs(tmp_path: Path) -> None:
    from hpc_ddp.doctor import resume

    ns = configfile.parse(
        resume.build_argparser(), ["--task-arg", "width=3", "--task", "task_args_tasks:sized"]
    )
    check = resume.Check(from_namespace(ns), tmp_path, ("--nodes", "1"), 10, 0)
    for name in ("uninterrupted", "stopped"):
        argv = check.argv(name)
        assert "--task-arg=width=3" in argv
        assert from_namespace(parser().parse_args(argv[argv.index("--nodes") + 2 :])).task_args == {
            "width": 3
        }


def test_the_report_draws_grad_norm_with_the_steps_own_values() -> None:
    from hpc_ddp.report.recorded import compile_records

    records = [
        {"event": "start", "job": "1", "restart": 0, "step": 0, "time": 1.0},
        {"event": "step", "step": 1, "loss": 1.0, "grad_norm": 2.5, "time": 2.0},
        {"event": "step", "step": 2, "loss": 0.5, "grad_norm": None, "time": 3.0},  # no update applied
        {"event": "step", "step": 3, "loss": 0.4, "grad_norm": 1.5, "time": 4.0},
    ]
    series = compile_records(records).extras["grad_norm"]
    assert list(series.steps) == [1, 3] and list(series.values) == [2.5, 1.5]


@pytest.mark.slow
@pytest.mark.deadline(150)
def test_fsdp_records_the_global_norm_as_ddp_does(tmp_path: Path) -> None:
    """2 ranks: the first step's gradients are the same under ddp and fsdp (same init, same data); fsdp's norm
    over its shards alone would be about 1/sqrt(2) of it."""
    first = {}
    for strategy in ("ddp", "fsdp"):
        folder = tmp_path / strategy
        proc = run_module(
            "hpc_ddp.submit", "--local", "--nodes", "1", "--tasks-per-node", "2", "--folder", str(folder),
            "--task", "mlp", "--epochs", "1", "--max-steps", "2", "--save-every-epochs", "0", "--strategy", strategy,
            cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        steps = [r for r in read_records(folder / "metrics.jsonl") if r["event"] == "step"]
        first[strategy] = steps[0]["grad_norm"]
    assert first["fsdp"] == pytest.approx(first["ddp"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.deadline(200)
def test_offline_trackers_get_the_settings_the_tasks_scheduler_and_grad_norm(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from test_report_run import offline_trackers  # wandb offline, an MLflow file store, under tmp_path
    from tracker_check import wandb_run

    folder = tmp_path / "run"
    proc = run_module(
        "hpc_ddp.submit", "--local", "--nodes", "1", "--tasks-per-node", "1", "--folder", str(folder),
        "--task", "task_args_tasks:scheduled", "--epochs", "1", "--max-steps", "2", "--save-every-epochs", "0",
        "--tracker", "wandb,mlflow", "--task-arg", "depth=12", "--task-arg", "name=wide",
        cwd=tmp_path, timeout=150, env=clean_environ(**offline_trackers(tmp_path)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = json.loads((folder / "trackers.json").read_text())
    (run_file,) = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    config = {k: json.loads(v) for k, v in wandb_run(run_file)["config"].items()}
    assert (
        config["lr_schedule"] == "Task.scheduler (LambdaLR)"
        and config["optimizer"] == "Task.optimizer (AdamW)"
    )
    assert (
        config["task_args.depth"] == 12 and config["task_args.name"] == "wide" and config["batch_size"] == 32
    )
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the test reads the file store the run wrote
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"]["id"])
    assert (
        run.data.params["lr_schedule"] == "Task.scheduler (LambdaLR)"
        and run.data.params["task_args.depth"] == "12"
    )
    norms = client.get_metric_history(run.info.run_id, "train/grad_norm")
    steps = [r for r in read_records(folder / "metrics.jsonl") if r["event"] == "step"]
    assert [m.value for m in norms] == pytest.approx([r["grad_norm"] for r in steps]) and len(norms) == 2
