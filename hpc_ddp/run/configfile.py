"""`--config run.toml`: a command's options from a TOML file, the command line over it.

    # run.toml: every key is one of the command's long options, without its dashes
    task = "gpt"
    epochs = 4
    batch-size = 64
    lr = 3e-4
    deterministic = true

    [task-args]      # the task's own settings, after the options: config.task_args (hpc_ddp.run.taskargs)
    depth = 12

    python -m hpc_ddp.submit --local --config run.toml --epochs 8    # the command line wins: 8 epochs

Precedence: command-line options > the file > the defaults. The file's values become the parser's defaults, so
everything argparse and TrainConfig check is checked the same way, and the same command (file included)
resumes the run as any other. A key the command does not take is refused in one line naming the key and the
nearest option; a value of the wrong kind names the key, the value and what the option takes. `_` and `-` are
the same in a key (`batch_size` is `batch-size`). A flag set true in the file is turned off with `--no-FLAG`.

The file is read once, where the command is run: the tasks of a job get the resolved options as flags
(TrainConfig.to_argv), never the file. Every start that trains writes the resolved training options to
`<folder>/config.toml` (`dump`), a file `--config` takes back.

TOML is read by the standard library's tomllib (Python 3.11+); on Python 3.10 by tomli, the same parser
published apart (a dependency of the kit on 3.10 only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp import cli
from hpc_ddp.errors import UsageError
from hpc_ddp.run import taskargs

OPTION = "--config"
HELP = (
    "read options from this TOML file, keys named as the long options (batch-size = 64), and the task's own "
    "settings in a [task-args] table after them (depth = 12: config.task_args, see --task-arg); options on the "
    "command line override it, --task-arg key by key (default: none)"
)


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The --config option itself (read by `parse`, before the others)."""
    parser.add_argument(OPTION, metavar="FILE", default=None, help=HELP)


def _toml() -> Any:
    return taskargs.toml_parser()


def read(path: str) -> dict[str, Any]:
    """The file's table (UsageError naming the file when it cannot be read or parsed)."""
    toml = _toml()
    try:
        with open(path, "rb") as f:
            return dict(toml.load(f))
    except OSError as e:
        raise UsageError(
            f"--config {path}: cannot read it ({e.strerror or e}). Fix: the path of a TOML file"
        ) from e
    except toml.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML ({e}). Fix: the line it names") from e


def config_path(argv: Sequence[str]) -> str | None:
    """The --config FILE in `argv` (the last one given), or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == OPTION and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(OPTION + "="):
            found = arg[len(OPTION) + 1 :]
    return found


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's long options by name (no dashes), those a file may set."""
    named = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        for option in action.option_strings:
            if (
                option.startswith("--")
                and not option.startswith("--no-")
                and option not in ("--help", OPTION)
            ):
                named[option[2:]] = action
    return named


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return "true or false"
    if isinstance(action, argparse._AppendAction):
        return "a list of strings"
    return {int: "an integer", float: "a number"}.get(action.type, "a string")  # type: ignore[call-overload]


def _value(key: str, value: Any, action: argparse.Action, path: str) -> Any:
    """`value` as the option takes it, or UsageError naming the key, the value and the kind wanted."""
    kind = _kind(action)
    converted: Any = None
    if kind == "true or false":
        converted = value if isinstance(value, bool) else None
    elif kind == "a list of strings":
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(v, str) for v in items):
            converted = list(items)
    elif isinstance(value, bool):
        converted = None
    elif kind == "an integer":
        converted = value if isinstance(value, int) else None
    elif kind == "a number":
        converted = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    elif isinstance(value, (str, int, float)):
        converted = str(value)  # --hang-timeout-s 120, --time 90: numbers where the option takes text
    if converted is None:
        raise UsageError(f"--config {path}: {key} = {json.dumps(value, default=str)}: --{key} takes {kind}")
    if action.choices is not None and converted not in action.choices:
        raise UsageError(
            f"--config {path}: {key} = {json.dumps(value)}: choose one of {', '.join(map(str, action.choices))}"
        )
    return converted


def defaults(parser: argparse.ArgumentParser, table: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The parser's defaults the file sets, by destination (UsageError for an unknown key or a bad value)."""
    options = _options(parser)
    found: dict[str, Any] = {}
    for raw, value in table.items():
        key = raw.replace("_", "-")
        if key == taskargs.TABLE and taskargs.OPTION[2:] in options:  # the task's own settings
            found[taskargs.FILE_DEST] = taskargs.from_table(value, path)
            continue
        if key == taskargs.OPTION[2:] and taskargs.OPTION[2:] in options:
            raise UsageError(
                f"--config {path}: {raw} = ...: the task's settings go in a [{taskargs.TABLE}] table (after the "
                "options: a line [task-args], then depth = 12)"
            )
        if isinstance(value, dict):
            raise UsageError(f"--config {path}: [{raw}] is a table; every option is a key at the top level")
        action = options.get(key)
        if action is None:
            if key == OPTION[2:]:
                raise UsageError(
                    f"--config {path}: config = ...: a file cannot name another; merge them into one"
                )
            meant = cli.nearest(key, options)  # only when one is close: a far one misleads
            hint = f"; the nearest option is --{meant}" if meant else ""
            raise UsageError(
                f"--config {path}: unknown key {raw!r}{hint} (keys are this command's long options without "
                "the dashes: see --help)"
            )
        found[action.dest] = _value(key, value, action, path)
    return found


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse `argv` with the --config file's values as the defaults (see the module docstring)."""
    path = config_path(argv)
    if path is not None:
        parser.set_defaults(**defaults(parser, read(path), path))
    return parser.parse_args(list(argv))


def dump(config: Any) -> str:
    """The TOML of a frozen dataclass of options (TrainConfig): every field, defaults included, in field order,
    keys named as the options. Strings as JSON writes them, which is a TOML basic string too."""
    lines = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "task_args":  # a table: after every top-level key
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        lines.append(f"{f.name.replace('_', '-')} = {text}")
    task_args = getattr(config, "task_args", None)
    return "\n".join(lines) + "\n" + (task_args.toml() if task_args is not None else "")


def save(folder: Path, config: Any) -> None:
    """`<folder>/config.toml`: the resolved training options of this start (rank 0, where run.json goes)."""
    from hpc_ddp.run.folder import CONFIG_FILE, atomic_write_bytes

    head = (
        "# The training options of the run in this folder, resolved (defaults included), as of its last start.\n"
        f"# Every entry point takes them back: --config {folder / CONFIG_FILE} (options on the command line "
        "override these).\n"
    )
    atomic_write_bytes(folder / CONFIG_FILE, (head + dump(config)).encode())
