"""`--config run.toml` (hpc_ddp.run.configfile, issue 37 item 3): keys named as the options, the command line
over the file, the resolved options written back to the run folder and taken back, the same command resumes;
Python 3.10's parser. Bad files, one line each: tests/test_entry_usage_errors.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_environ, die_with_test
from test_launch_local import finish

from hpc_ddp import submit
from hpc_ddp.errors import UsageError
from hpc_ddp.run import configfile
from hpc_ddp.run.config import TrainConfig, from_namespace

RUN = """
task = "mlp"
epochs = 4
batch_size = 16          # _ or -, as the option
lr = 3e-4
hang-timeout-s = 120     # a number where the option takes text
deterministic = true
nodes = 1                # submit's own options too
setup = "module load cuda"
"""


def parsed(tmp_path: Path, *argv: str) -> tuple[TrainConfig, object]:
    (tmp_path / "run.toml").write_text(RUN)
    ns = configfile.parse(submit.build_argparser(), ["--config", str(tmp_path / "run.toml"), *argv])
    return from_namespace(ns), ns


def test_the_file_sets_the_options_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    cfg, ns = parsed(tmp_path)
    assert (cfg.task, cfg.epochs, cfg.batch_size, cfg.lr, cfg.hang_timeout_s) == ("mlp", 4, 16, 3e-4, "120")
    assert cfg.deterministic and ns.nodes == 1 and ns.setup == ["module load cuda"]  # type: ignore[attr-defined]
    assert cfg.seed == 0 and not cfg.tensorboard  # what the file leaves out: the defaults
    cfg, ns = parsed(tmp_path, "--epochs", "8", "--no-deterministic", "--nodes", "2", "--seed=5")
    assert (cfg.epochs, cfg.deterministic, cfg.seed, cfg.batch_size) == (8, False, 5, 16)
    assert ns.nodes == 2  # type: ignore[attr-defined]


def test_the_resolved_options_go_back_through_the_file_unchanged(tmp_path: Path) -> None:
    cfg = TrainConfig(
        task="mytasks:build",
        folder='/shared/runs/"odd" name\\x',
        lr=1e-05,
        seed=-(2**63),
        timeout_s=90.5,
        keep_best="accuracy:max",
        deterministic=True,
        eval_every_steps=7,
    )
    (tmp_path / "config.toml").write_text(configfile.dump(cfg))
    ns = configfile.parse(submit.build_argparser(), ["--config", str(tmp_path / "config.toml")])
    assert from_namespace(ns) == cfg
    configfile.save(tmp_path, cfg)  # what every start that trains writes, with its comment lines
    ns = configfile.parse(submit.build_argparser(), ["--config", str(tmp_path / "config.toml")])
    assert from_namespace(ns) == cfg
    assert len(configfile.dump(cfg).splitlines()) == len(dataclasses.fields(TrainConfig))


def test_python_3_10_reads_toml_with_tomli_or_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tomllib

    (tmp_path / "run.toml").write_text("epochs = 3\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import tomllib raises ModuleNotFoundError, as on 3.10
    monkeypatch.setitem(sys.modules, "tomli", tomllib)  # tomli is the same parser, published apart
    assert configfile.read(str(tmp_path / "run.toml")) == {"epochs": 3}
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(UsageError, match=r"--config needs a TOML parser: .* on Python 3.10 install tomli"):
        configfile.read(str(tmp_path / "run.toml"))


def launch(cwd: Path, *args: str) -> subprocess.Popen[str]:
    """`submit --local ARGS` without a --folder of the test's: the file names it."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp.submit", "--local", *args],
        cwd=cwd,
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.deadline(120)
def test_the_same_command_resumes_and_writes_the_resolved_options(tmp_path: Path) -> None:
    """A run from a file, which names its folder; the folder's config.toml holds its resolved options; the
    same command with --epochs 2 after the file resumes that run and trains the second epoch only."""
    folder = tmp_path / "run"
    (tmp_path / "run.toml").write_text(
        f'folder = "{folder}"\nepochs = 1\nnodes = 1\ntasks-per-node = 1\nbatch-size = 100\n'
    )
    code, out = finish(launch(tmp_path, "--config", "run.toml"), timeout=90)
    assert code == 0, out
    saved = (folder / "config.toml").read_text()
    assert f'folder = "{folder}"' in saved and "epochs = 1" in saved and "batch-size = 100" in saved, saved
    code, out = finish(launch(tmp_path, "--config", "run.toml", "--epochs", "2"), timeout=90)
    assert code == 0, out
    assert "Resuming from " in out and "at epoch 1, step 10" in out, out
    assert "Epoch 1, Loss:" in out and "Epoch 0, Loss:" not in out, out
    assert "epochs = 2" in (folder / "config.toml").read_text()
