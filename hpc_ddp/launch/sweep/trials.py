"""A sweep's trials, each checked by the run's own parser and config, and named (pure but for --config files).

Every trial is a whole run: its command line is the sweep's, less the sweep's own flags, with the trial's values
after it (argparse: the last one wins) and `--folder <sweep folder>/<trial name>`. That command line is read by
exactly the code that reads a single run's (`read`: hpc_ddp.submit's parser, then hpc_ddp.launch.options), so a
value a single run would refuse is refused for the trial, in the same words, with the trial named.

Only training options vary (and the task's own settings, `task-args.KEY`): the job's shape and its Slurm request
are one sbatch header for the whole array, and the folder is the sweep's to name (FIXED says why for each).

A trial's name is its varied values, keys sorted, as the run resolved them (`lr=1e-2` and `lr=0.01` are the same
trial, named `lr=0.01`): readable, and stable whatever the order of the --sweep flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import cli
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.options import LaunchOptions
from hpc_ddp.launch.sweep.spec import TASK_ARGS, Settings
from hpc_ddp.run import taskargs
from hpc_ddp.run.config import TrainConfig

# Training options a trial cannot set, and why (an option of the job, not of the run, is refused by `_argv` too).
FIXED = {
    "folder": "every trial's folder is <sweep folder>/<its name>",
    "overwrite": "a sweep reruns only what did not finish; --overwrite goes on the whole command",
    "resume": "a trial resumes from its own folder",
    "spare_nodes": "the allocation (nodes + spares) is one for the whole job array",
}
NAME_CHARS = re.compile(r"[^A-Za-z0-9._+:@%=,-]")
NAME_MAX = 200  # a file name is at most 255 bytes: room for a suffix

Read = Callable[[list[str]], tuple[LaunchOptions, TrainConfig]]


@dataclass(frozen=True)
class Trial:
    """One trial: its name (its folder's), what it varies, and the whole run's command line."""

    name: str
    values: tuple[tuple[str, str], ...]  # (option, value as given), sorted by option
    argv: tuple[str, ...]  # the run's options (hpc_ddp.submit's), --folder the trial's own
    folder: Path
    cfg: TrainConfig  # the trial's training options, as the run reads them (folder included)

    @property
    def settings(self) -> dict[str, str]:
        return dict(self.values)


def _train_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig)}


def _argv(name: str, text: str, actions: dict[str, argparse.Action]) -> list[str]:
    """The command-line words that set option `name` to `text` (UsageError for an option that cannot vary)."""
    if name.startswith(TASK_ARGS):
        return [taskargs.OPTION, f"{name[len(TASK_ARGS) :]}={text}"]
    action = actions.get(name)
    if action is None:
        meant = cli.nearest(name, actions)
        hint = f"; did you mean {meant}?" if meant else ""
        raise UsageError(
            f"--sweep {name}=...: no option --{name}{hint} (expected a training option without its dashes, or "
            f"{TASK_ARGS}KEY for a setting of the task's own). Fix: see --help for the options"
        )
    if action.dest not in _train_fields() or action.dest in FIXED or action.dest == "task_args":
        why = FIXED.get(action.dest) or (
            f"set task settings as {TASK_ARGS}KEY=V1,V2"
            if action.dest == "task_args"
            else "it shapes the job, and one job array has one shape and one sbatch header"
        )
        raise UsageError(
            f"--sweep {name}=...: --{name} cannot vary within one sweep ({why}). Fix: give it once on the "
            f"command line, or run one sweep per value (each its own --folder)"
        )
    if isinstance(action, argparse.BooleanOptionalAction):
        flag = {"true": f"--{name}", "false": f"--no-{name}"}.get(text.lower())
        if flag is None:
            raise UsageError(f"--sweep {name}={text}: --{name} is a flag; expected true or false")
        return [flag]
    return [f"--{name}={text}"]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    named = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        for option in action.option_strings:
            if option.startswith("--") and not option.startswith("--no-"):
                named[option[2:]] = action
    return named


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    return taskargs.toml_value(value)


def name_of(settings: Settings, cfg: TrainConfig, actions: dict[str, argparse.Action]) -> str:
    """The trial's folder name: `key=value` of each varied option, sorted, values as resolved."""
    parts = []
    for name in settings:
        if name.startswith(TASK_ARGS):
            key = name[len(TASK_ARGS) :]
            value = cfg.task_args.get(key)
            label = name if key in actions else key  # the task's `depth`, unless an option has that name too
        else:
            value, label = getattr(cfg, actions[name].dest), name
        parts.append(f"{label}={_shown(value)}")
    text = NAME_CHARS.sub("_", ",".join(sorted(parts))) or "trial"
    if len(text) > NAME_MAX:  # still unique: the cut is followed by a checksum of the whole
        text = f"{text[: NAME_MAX - 9]}-{zlib.crc32(text.encode()):08x}"
    return text


def expand(
    combos: Sequence[Settings], base: Sequence[str], folder: Path, parser: argparse.ArgumentParser, read: Read
) -> list[Trial]:
    """The trials of `combos` (hpc_ddp.launch.sweep.spec), each read by `read` as a run of `base` + its values
    (UsageError at the first that is wrong, naming it; a duplicate trial too). `folder` is the sweep's."""
    actions = _options(parser)
    trials: list[Trial] = []
    seen: dict[tuple[str, ...], str] = {}
    for settings in combos:
        words = [w for name, text in settings.items() for w in _argv(name, text, actions)]
        label = " ".join(f"{k}={v}" for k, v in settings.items())
        try:
            _, cfg = read([*base, *words])
        except UsageError as e:
            raise UsageError(f"--sweep trial {label}: {e}") from None
        name = name_of(settings, cfg, actions)
        resolved = tuple(cfg.with_folder("").to_argv())
        if resolved in seen or name in {t.name for t in trials}:
            raise UsageError(
                f"--sweep trial {label}: the same run as trial {seen.get(resolved, name)}; expected every trial "
                "to differ. Fix: drop the duplicate value (1e-2 and 0.01 are one value)"
            )
        seen[resolved] = name
        argv = (*base, *words, f"--folder={folder / name}")
        trial_cfg = cfg.with_folder(str(folder / name))
        trials.append(Trial(name, tuple(sorted(settings.items())), argv, folder / name, trial_cfg))
    return trials


def raising(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, its errors raised as UsageError instead of exiting: a trial's refusal names the trial."""

    def error(message: str) -> Any:
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser
