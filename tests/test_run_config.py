"""TrainConfig validation, and the argv round trip the submitters rely on (what is checked is what runs)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError
from hpc_ddp.run.config import AMP_CHOICES, TrainConfig, add_train_arguments, from_namespace


def parse(argv: list[str]) -> TrainConfig:
    parser = build_parser("test", "")
    add_train_arguments(parser)
    return from_namespace(parser.parse_args(argv))


def test_defaults_are_the_articles() -> None:
    cfg = TrainConfig()
    assert (cfg.task, cfg.epochs, cfg.lr, cfg.folder) == ("linear", 10, 0.01, "")
    assert cfg.to_argv() == []
    assert parse([]) == cfg


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"epochs": 0}, r"^--epochs 0: must be at least 1$"),
        ({"batch_size": -2}, r"^--batch-size -2: must be at least 1$"),
        ({"grad_accum": 0}, r"^--grad-accum 0: must be at least 1$"),
        ({"keep": 0}, r"^--keep 0: must be at least 1$"),
        ({"max_steps": -1}, r"^--max-steps -1: must be 0 or more$"),
        ({"save_every_epochs": -1}, r"--save-every-epochs -1: must be 0 or more"),
        ({"save_every_steps": -1}, r"--save-every-steps -1: must be 0 or more"),
        ({"max_requeue": -1}, r"--max-requeue -1: must be 0 or more"),
        ({"clip_grad": -0.5}, r"--clip-grad -0.5: must be 0 or more"),
        ({"log_every_s": -1.0}, r"--log-every-s -1.0: must be 0 or more"),
        ({"lr": 0.0}, r"--lr 0.0: must be a positive number, e.g. --lr 0.01"),
        ({"lr": -1.0}, r"--lr -1.0: must be a positive number"),
        ({"lr": float("nan")}, r"--lr nan: must be a finite number"),
        ({"lr": float("inf")}, r"--lr inf: must be a finite number"),
        ({"clip_grad": float("nan")}, r"--clip-grad nan: must be a finite number"),
        ({"timeout_s": 0.0}, r"--timeout-s 0.0: must be positive"),
        ({"timeout_s": 1e12}, r"--timeout-s 1000000000000.0: must be positive and at most 2592000"),
        ({"timeout_s": float("-inf")}, r"--timeout-s -inf: must be a finite number"),
        ({"num_workers": -2}, r"--num-workers -2: use -1 \(auto\) or a count >= 0"),
        ({"amp": "fp8"}, r"--amp fp8: choose one of none, bf16, fp16"),
        ({"backend": "mpich"}, r"--backend mpich: choose gloo or nccl"),
        (
            {"task": "resnet"},
            r"--task 'resnet': unknown task. Use one of linear, mlp, gpt, cnn, or module.path:function",
        ),
        ({"task": "mytasks:"}, r"--task 'mytasks:': unknown task"),
        ({"task": ":build"}, r"--task ':build': unknown task"),
        ({"overwrite": True}, r"--overwrite only applies with --resume never"),
        ({"lr_schedule": "step"}, r"--lr-schedule step: choose one of constant, linear, cosine"),
        ({"warmup_steps": -1}, r"--warmup-steps -1: must be 0 or more"),
        ({"eval_every_steps": -3}, r"--eval-every-steps -3: must be 0 or more"),
        ({"eval_batch_size": -8}, r"--eval-batch-size -8: must be 0 or more"),
        ({"keep_best": "accuracy"}, r"--keep-best 'accuracy': expected NAME:min or NAME:max"),
        ({"keep_best": "accuracy:up"}, r"--keep-best 'accuracy:up': expected NAME:min or NAME:max"),
        ({"pin_memory": "yes"}, r"--pin-memory yes: choose one of auto, on, off"),
        ({"prefetch_factor": 4, "num_workers": 0}, r"--prefetch-factor 4 needs DataLoader workers"),
    ],
)
def test_validation(changes: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        TrainConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"task": "mlp"},
        {"task": "my.tasks:build"},
        {"epochs": 1},
        {"lr": 1e-5},
        {"clip_grad": 0.0},
        {"log_every_s": 0.0},
        {"num_workers": -1},
        {"num_workers": 0},
        {"amp": "bf16"},
        {"backend": "gloo"},
        {"resume": "never", "overwrite": True},
        {"resume": "/ckpt/step_10.pt"},
        {"max_steps": 0},
        {"timeout_s": 2592000.0},
    ],
)
def test_valid_values(changes: dict[str, object]) -> None:
    TrainConfig(**changes)  # type: ignore[arg-type]


def test_every_field_has_a_flag_and_help() -> None:
    parser = build_parser("test", "")
    add_train_arguments(parser)
    text = parser.format_help()
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in text
        assert f.metadata.get("help")


ROUND_TRIPS = [
    TrainConfig(),
    TrainConfig(task="mlp", epochs=3, batch_size=7, lr=0.1, seed=42, folder="runs/x"),
    TrainConfig(
        task="pkg.mod:build",
        grad_accum=4,
        amp="fp16",
        clip_grad=1.5,
        max_steps=100,
        save_every_epochs=0,
        save_every_steps=25,
        keep=1,
        resume="never",
        overwrite=True,
        deterministic=True,
        max_requeue=0,
        backend="gloo",
        timeout_s=30.5,
        num_workers=0,
        log_every_s=0.0,
    ),
    # Values argparse would mistake for flags or split: a leading dash, spaces, an "=" inside.
    TrainConfig(folder="-runs/odd name=1", resume="--weird.pt", seed=-3),
    TrainConfig(lr=1e-7, timeout_s=1e-3, clip_grad=123456789.123),
]


@pytest.mark.parametrize("cfg", ROUND_TRIPS)
def test_to_argv_round_trip(cfg: TrainConfig) -> None:
    argv = cfg.to_argv()
    assert parse(argv) == cfg
    # One word per flag: a task's command line can be shell-quoted word by word.
    assert all(word.startswith("--") for word in argv)


configs = st.builds(
    TrainConfig,
    task=st.sampled_from(["linear", "mlp", "a.b:c"]),
    epochs=st.integers(1, 10**6),
    batch_size=st.integers(1, 4096),
    lr=st.floats(min_value=1e-12, max_value=1e3, allow_nan=False, allow_infinity=False),
    seed=st.integers(-(2**31), 2**31),
    folder=st.text(min_size=0, max_size=12).filter(lambda s: "\x00" not in s),
    clip_grad=st.floats(min_value=0, max_value=1e6),
    amp=st.sampled_from(AMP_CHOICES),
    timeout_s=st.floats(min_value=1e-3, max_value=1e6),
)


@given(configs)
def test_to_argv_round_trip_property(cfg: TrainConfig) -> None:
    assert parse(cfg.to_argv()) == cfg


def test_with_folder_and_as_dict() -> None:
    cfg = TrainConfig(epochs=2).with_folder("/shared/run")
    assert cfg.folder == "/shared/run" and cfg.epochs == 2
    assert cfg.as_dict()["folder"] == "/shared/run"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "abc"], "argument --epochs: invalid int value: 'abc' (see --help)"),
        (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
        (["--nope"], "unrecognized arguments: --nope (see --help)"),
    ],
)
def test_parser_errors_are_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("test: error: ") and message in err
