"""What the parts of the training options share (hpc_ddp.run.config.TrainConfig is their union): a field's
flag, and the checks each part runs on its own fields, every failure a UsageError of one line that names the
flag, the value found and what it must be. No torch: `--help` and the submitters' checks import this."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from hpc_ddp.errors import UsageError


def flag(name: str) -> str:
    """The flag of field `name`: underscores become dashes."""
    return name.replace("_", "-")


def finite(options: Any) -> None:
    """nan and inf pass every comparison below the wrong way: each float field is a finite number first."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{flag(f.name)} {value}: must be a finite number (default: {f.default})")


def at_least(options: Any, least: int, names: Iterable[str]) -> None:
    """Each field of `names` is `least` (0 or 1) or more."""
    for name in names:
        value = getattr(options, name)
        if value < least:
            raise UsageError(f"--{flag(name)} {value}: must be {'at least 1' if least else '0 or more'}")


def choice(name: str, value: str, choices: Iterable[str]) -> None:
    """Field `name` is one of `choices`."""
    if value not in choices:
        raise UsageError(f"--{flag(name)} {value}: choose one of {', '.join(choices)}")
