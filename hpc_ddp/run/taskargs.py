"""The task's own settings: `[task-args]` in a `--config` file and `--task-arg key=value`, read-only in the task.

    # run.toml
    epochs = 4
    [task-args]
    depth = 12
    name = "wide"

    python -m hpc_ddp.submit --local --config run.toml --task mytask:build --task-arg depth=16

    def build(config):                       # config.task_args: {"depth": 16, "name": "wide"}
        depth = config.task_args["depth"]

Precedence, key by key: `--task-arg` > the file's `[task-args]` table (a key the command line leaves alone keeps
the file's value). A value is read as a TOML value (`depth=12` an integer, `lr=3e-4` a float, `bf16=true` a
boolean, `sizes=[64, 128]` an array, `name="x"` a string); a value that is not valid TOML is the text itself
(`name=wide`: "wide"), and so is a TOML date or time (`day=2024-01-01`: "2024-01-01"); quote it to force a
string (`--task-arg 'n="12"'`). Keys are kept as written (`_` and `-` differ here: they are the task's names),
made of letters, digits, `_` and `-`.

`TaskArgs` is the read-only mapping the task gets: a frozen value (arrays as tuples, tables as TaskArgs) that
TrainConfig holds, hashes and pickles (submitit pickles the config). What leaves the process is plain: `plain()`
for run.json, the checkpoint and the trackers, `argv()` for a task's command line (each value as TOML text, so
the task parses back exactly what was checked), `toml()` for `<folder>/config.toml`. A run resumes only with the
same settings (`differences`), as with the options in hpc_ddp.run.config.MUST_MATCH.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from hpc_ddp.errors import UsageError

OPTION = "--task-arg"
FILE_DEST = "task_args_file"  # the parsed namespace's name of a --config file's [task-args] (configfile.py)
TABLE = "task-args"
KEY = re.compile(r"[A-Za-z0-9_-]+")
HELP = (
    "a setting of the task's own, KEY=VALUE, the value read as TOML (depth=12, lr=3e-4, sizes=[64,128]; text "
    "that is not TOML is a string: name=wide); repeatable; overrides the --config file's [task-args] table key "
    "by key; the task reads config.task_args (recorded in run.json, sent to trackers, checked on resume) (default: none)"
)


class TaskArgs(Mapping[str, Any]):
    """A read-only mapping of the task's settings; hashable and picklable (see the module docstring)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        object.__setattr__(self, "_items", dict((str(k), _frozen(v)) for k, v in pairs))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TaskArgs is read-only: set a task's settings with --task-arg or [task-args]")

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items(), key=lambda kv: kv[0])))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return _plain(self) == _plain(other)
        return NotImplemented

    def __str__(self) -> str:
        return " ".join(f"{k}={toml_value(v)}" for k, v in self._items.items()) or "none"

    def __repr__(self) -> str:
        return f"TaskArgs({self._items!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaskArgs, (self.plain(),))

    def plain(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples as lists, tables as dicts)."""
        return _plain(self)

    def argv(self) -> list[str]:
        """`--task-arg=key=<TOML value>` per key, in order: what a task's command line carries."""
        return [f"{OPTION}={k}={toml_value(v)}" for k, v in self._items.items()]

    def toml(self) -> str:
        """The `[task-args]` table, for <folder>/config.toml (the header alone when there is none)."""
        return "".join([f"[{TABLE}]\n", *(f"{k} = {toml_value(v)}\n" for k, v in self._items.items())])


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value if isinstance(value, TaskArgs) else TaskArgs(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def toml_value(value: Any) -> str:
    """`value` as TOML text that reads back equal (strings as JSON writes them, a TOML basic string too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key_text(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a task setting's value: {value!r}")


def _key_text(key: str) -> str:
    return key if KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _check_key(key: str, where: str) -> str:
    if not KEY.fullmatch(key):
        shown = "an empty key" if not key else f"key {key!r}"
        raise UsageError(
            f"{where}: {shown}: a task setting's name is letters, digits, _ and - (e.g. {OPTION} depth=12)"
        )
    return key


def _check_value(value: Any, key: str, where: str) -> Any:
    """TOML's dates and times have no JSON: refused in a file (quote them), text on the command line."""
    if isinstance(value, (datetime.date, datetime.time)):
        raise UsageError(
            f'{where}: {key} = {value}: a date or time; quote it to make it text ({key} = "{value}")'
        )
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_value(v, f"{key}.{k}", where)
    elif isinstance(value, list):
        for v in value:
            _check_value(v, key, where)
    return value


def toml_parser() -> Any:
    """tomllib (Python 3.11+), or on Python 3.10 tomli, the same parser published apart."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageError(
                "--config needs a TOML parser: Python 3.11+ has tomllib (--task-arg's values too); on Python 3.10 "
                "install tomli (pip install tomli, which the kit's own install does on 3.10)"
            ) from None
    return tomllib


def parse_value(text: str) -> Any:
    """`text` as a TOML value, or the text itself when it is not one (or is a date or time)."""
    toml = toml_parser()
    try:
        value = toml.loads(f"v = {text}")["v"]
        _check_value(value, "v", OPTION)
    except (toml.TOMLDecodeError, UsageError):
        return text
    return value


def parse_pair(text: str) -> tuple[str, Any]:
    """One `--task-arg KEY=VALUE` (UsageError for no '=' or a bad key)."""
    key, eq, value = text.partition("=")
    if not eq:
        raise UsageError(
            f"{OPTION} {text!r}: no '='; a task setting is KEY=VALUE (e.g. {OPTION} {text or 'depth'}=12)"
        )
    return _check_key(key.strip(), f"{OPTION} {text!r}"), parse_value(value.strip())


def from_table(table: Any, path: str) -> TaskArgs:
    """A `--config` file's `[task-args]` table (UsageError when it is not a table, or for a bad key or value)."""
    where = f"--config {path}"
    if not isinstance(table, dict):
        raise UsageError(
            f"{where}: {TABLE} = {json.dumps(table, default=str)}: [{TABLE}] must be a table of the task's "
            f"settings. Fix: a line [{TABLE}] after the options, then one setting a line (depth = 12)"
        )
    for key, value in table.items():
        _check_value(value, _check_key(key, f"{where} [{TABLE}]"), f"{where} [{TABLE}]")
    return TaskArgs(table)


def merge(file: Mapping[str, Any] | None, pairs: Iterable[str] | None) -> TaskArgs:
    """The file's table, then each `--task-arg` over it, key by key."""
    merged = dict(file or {})
    for text in pairs or ():
        key, value = parse_pair(text)
        merged[key] = value
    return TaskArgs(merged)


def differences(saved: Mapping[str, Any], now: TaskArgs) -> list[str]:
    """Each setting where `saved` (a run's recorded task_args) differs from `now`, as "--task-arg depth=12
    (now 16)" or "--task-arg depth=12 (now unset)"; empty when they are the same."""
    before, after = _plain(saved), now.plain()
    found = []
    for key in [*before, *(k for k in after if k not in before)]:
        if key in before and key in after and _same(before[key], after[key]):
            continue
        was = f"{OPTION} {key}={toml_value(before[key])}" if key in before else f"{OPTION} {key} unset"
        is_ = toml_value(after[key]) if key in after else "unset"
        found.append(f"{was} (now {is_})")
    return found


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kinds (12 is not 12.0 nor true here: the task may read them apart)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
