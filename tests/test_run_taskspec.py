"""`--task module:function` checked at submission by reading the module's source, never running it
(hpc_ddp.run.taskspec), and the one rule for suggesting a real name for a mistyped one (hpc_ddp.cli.nearest):
unit tables on real files (issue 42)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp import cli
from hpc_ddp.errors import UsageError
from hpc_ddp.run import configfile, taskspec
from hpc_ddp.run.config import BUILTIN_TASKS
from hpc_ddp.submit import build_argparser

# Each module that would show it was run: a check that ran it would leave this file behind.
RAN = "ran.txt"
BOOBY = f"open({RAN!r}, 'w').write('ran')\n"

MODULES = {
    "plain.py": BOOBY + "import os\n\ndef build(config):\n    return None\n\nVALUE = 1\n",
    "branches.py": "try:\n    import wandb_missing_here\nexcept ImportError:\n    pass\n"
    "if True:\n    def build(config):\n        pass\nelse:\n    build = None\n",
    "broken.py": "def build(config):\n    return (\n",
    "needs.py": "import os\nimport hpc_ddp_surely_missing_package\n\ndef build(config):\n    pass\n",
    "star.py": "from os.path import *\n",
    "moves.py": "import sys\nsys.path.insert(0, 'lib')\nimport hpc_ddp_surely_missing_package\n\ndef build(config):\n    pass\n",
    "lazy.py": "def __getattr__(name):\n    return lambda config: None\n",
    "pkg/__init__.py": BOOBY + "raise RuntimeError('a package __init__ must not run at submission')\n",
    "pkg/tasks.py": BOOBY + "def build(config):\n    pass\n",
}


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name, text in MODULES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    assert not (tmp_path / RAN).exists()  # nothing was run
    for name in ("plain", "branches", "broken", "needs", "moves", "star", "lazy", "pkg", "pkg.tasks"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("spec", "environment", "message"),
    [
        ("plain:build", True, None),
        ("plain:VALUE", True, None),  # a name it defines (what it is, the rank's import tells)
        ("plain:buidl", True, "--task 'plain:buidl': plain has no function 'buidl'; did you mean build?"),
        (
            "plain:train_model",
            True,
            "plain has no function 'train_model' (read from",
        ),  # nothing close: no hint
        ("pkg.tasks:build", True, None),  # its package's __init__ (which raises) never runs
        ("pkg.tasks:biuld", True, "pkg.tasks has no function 'biuld'; did you mean build?"),
        ("branches:build", True, None),  # defined in an `if`; the import in a `try` is optional
        ("broken:build", True, "--task 'broken:build': broken.py line 2 does not parse: "),
        (
            "needs:build",
            True,
            "needs.py line 2 imports 'hpc_ddp_surely_missing_package', which is not installed",
        ),
        ("needs:build", False, None),
        (
            "moves:build",
            True,
            None,
        ),  # it changes sys.path before its imports: they are the rank's to try  # the tasks' own environment (a container, --setup) may have it
        ("nowhere:build", True, "--task 'nowhere:build': module 'nowhere' not found in"),
        ("nowhere:build", False, None),
        ("pkg.nowhere:build", True, "module 'pkg.nowhere' not found"),
        ("star:anything", True, None),  # names made at run time: the rank's import tells
        ("lazy:anything", True, None),
        ("linear", True, None),  # a built-in
    ],
)
def test_a_task_is_checked_by_reading_its_module(
    here: Path, spec: str, environment: bool, message: str | None
) -> None:
    if message is None:
        taskspec.check(spec, BUILTIN_TASKS, environment)
        return
    with pytest.raises(UsageError) as caught:
        taskspec.check(spec, BUILTIN_TASKS, environment)
    assert message in str(caught.value) and "\n" not in str(caught.value)


OPTIONS = [o for o in build_argparser()._option_string_actions if o.startswith("--")]


@pytest.mark.parametrize(
    ("word", "names", "meant"),
    [
        ("--batchsize", OPTIONS, "--batch-size"),
        ("--lr-shedule", OPTIONS, "--lr-schedule"),
        ("--epoch", OPTIONS, "--epochs"),
        ("--grad-accumulation", OPTIONS, "--grad-accum"),
        ("--weight-decay", OPTIONS, None),  # nothing is close: never --signal-delay-s
        ("--momentum", OPTIONS, None),
        ("buidl", ["build", "linear", "os"], "build"),
        ("warmup", ["warmup-steps", "amp"], "warmup-steps"),  # the one name it abbreviates
    ],
)
def test_a_suggestion_only_when_one_is_close(word: str, names: list[str], meant: str | None) -> None:
    assert cli.nearest(word, names) == meant


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("batchsize", "unknown key 'batchsize'; the nearest option is --batch-size (keys are"),
        ("weight-decay", "unknown key 'weight-decay' (keys are this command's long options"),
    ],
)
def test_a_config_key_gets_a_suggestion_only_when_one_is_close(key: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        configfile.defaults(build_argparser(), {key: 1}, "run.toml")
    assert message in str(caught.value)
