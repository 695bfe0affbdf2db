"""A sweep's trials as the user wrote them, before any is checked (pure): `--sweep NAME=V1,V2` and `--sweep-file`.

    --sweep lr=0.01,0.02 --sweep seed=3,4        the grid: every combination, 4 trials
    --sweep task-args.depth=4,8                  a setting of the task's own (--task-arg depth=4)
    --sweep-file trials.toml                     a list of trials, each a table of options:

        [[trial]]
        lr = 0.01
        seed = 3
        [trial.task-args]
        depth = 4

Both given: each trial of the file with every combination of the grid. A value is the text the option takes on
the command line (`amp=true,false` for a flag); values are split at commas outside brackets and quotes, so a
task setting may be a TOML array (`task-args.sizes=[64,128],[32]`). What each value means is the run's own
parser's to say (hpc_ddp.launch.sweep.trials); here only the shape of the text is checked.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.run import taskargs

TASK_ARGS = taskargs.TABLE + "."  # task-args.depth: the task's own setting `depth`
FILE_TABLE = "trial"  # [[trial]] in a --sweep-file

Settings = dict[str, str]  # one trial's varied options: name (as the long option, no dashes) -> value text


def split_values(text: str) -> list[str]:
    """`text` split at the commas outside brackets and quotes (`[1,2],"a,b",3` -> three values)."""
    values, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            values.append(text[start:i])
            start = i + 1
    values.append(text[start:])
    return [v.strip() for v in values]


def parse_axis(text: str) -> tuple[str, list[str]]:
    """One `--sweep NAME=V1,V2`: the option's name and its values (UsageError for an empty name or value)."""
    name, sep, rest = text.partition("=")
    name = name.strip().removeprefix("--")
    if not sep or not name:
        raise UsageError(
            f"--sweep {text!r}: expected NAME=V1,V2,... (an option without its dashes and its values). "
            "Fix: e.g. --sweep lr=0.01,0.02"
        )
    values = split_values(rest)
    if any(v == "" for v in values):
        raise UsageError(
            f"--sweep {text!r}: an empty value (nothing between two commas, or at an end); every value of "
            f"{name} must be given. Fix: e.g. --sweep {name}=V1,V2 with no empty item"
        )
    return name, values


def grid(texts: Sequence[str]) -> list[Settings]:
    """Every combination of the `--sweep` options, the first option varying slowest ([{}] without any)."""
    axes: dict[str, list[str]] = {}
    for text in texts:
        name, values = parse_axis(text)
        if name in axes:
            raise UsageError(
                f"--sweep {name}=... is given twice; expected one --sweep per option. Fix: list every value "
                f"in one, --sweep {name}={','.join([*axes[name], *values])}"
            )
        axes[name] = values
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*axes.values())]


def value_text(value: Any) -> str | None:
    """A TOML value of a --sweep-file as the command line writes it (None for a table or a date)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else None
    if isinstance(value, list):
        return taskargs.toml_value(value)
    return None


def _trial(table: Any, number: int, path: str) -> Settings:
    where = f"--sweep-file {path}: trial {number}"
    if not isinstance(table, Mapping) or not table:
        raise UsageError(
            f"{where} is empty or no table; expected option = value lines under [[{FILE_TABLE}]]"
        )
    found: Settings = {}
    for key, value in table.items():
        if key.replace("_", "-") == taskargs.TABLE and isinstance(value, Mapping):
            pairs = [(f"{TASK_ARGS}{k}", v) for k, v in value.items()]
        else:
            pairs = [(str(key).replace("_", "-"), value)]
        for name, v in pairs:
            text = value_text(v)
            if text is None or text == "":
                raise UsageError(
                    f"{where}: {name} = {v!r}: expected a non-empty string, a number, true/false or an array"
                )
            found[name] = text
    return found


def from_file(path: str) -> list[Settings]:
    """The trials of a --sweep-file (UsageError naming the file and the trial when it is not one)."""
    toml = taskargs.toml_parser()
    try:
        with open(path, "rb") as f:
            table = toml.load(f)
    except OSError as e:
        raise UsageError(
            f"--sweep-file {path}: cannot read it ({e.strerror or e}). Fix: a TOML file's path"
        ) from e
    except toml.TOMLDecodeError as e:
        raise UsageError(f"--sweep-file {path}: not valid TOML ({e}). Fix: the line it names") from e
    return from_table(table, path)


def from_table(table: Mapping[str, Any], path: str) -> list[Settings]:
    """The trials of a parsed --sweep-file (pure; see `from_file`)."""
    trials = table.get(FILE_TABLE)
    extra = sorted(set(table) - {FILE_TABLE})
    if not isinstance(trials, list) or not trials or extra:
        found = f"found {', '.join(extra)}" if extra else "found no trial"
        raise UsageError(
            f"--sweep-file {path}: expected a list of trials, each a [[{FILE_TABLE}]] table of options ({found}). "
            f"Fix: [[{FILE_TABLE}]] then lr = 0.01, one table per trial"
        )
    return [_trial(t, i, path) for i, t in enumerate(trials, 1)]


def combine(texts: Sequence[str], file_trials: Sequence[Settings] | None) -> list[Settings]:
    """Every trial: each of the file's (or one empty trial) with each combination of the grid. A name both in
    the file and in --sweep is refused (which would win?)."""
    combos = grid(texts)
    if file_trials is None:
        return combos
    swept = set(combos[0])
    for number, trial in enumerate(file_trials, 1):
        both = sorted(swept & set(trial))
        if both:
            raise UsageError(
                f"{both[0]} is varied by both --sweep and --sweep-file (trial {number}); expected one place. "
                f"Fix: drop --sweep {both[0]}=... or the file's {both[0]}"
            )
    return [{**trial, **combo} for trial in file_trials for combo in combos]
