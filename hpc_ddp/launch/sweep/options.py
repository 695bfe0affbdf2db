"""The sweep's own flags of `python -m hpc_ddp.submit`: declared for --help, and taken out of the command line
before the rest is read as one run's (every trial's command line is that rest plus its values)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_ddp.errors import UsageError

SWEEP, FILE, PARALLEL, RETRY = "--sweep", "--sweep-file", "--sweep-parallel", "--sweep-retry-failed"
OFFSET = "--sweep-offset"  # slurm/ddp.sbatch's: the sweep's trial its array's index 0 is (a split sweep)
TAKES_VALUE = (SWEEP, FILE, PARALLEL, OFFSET)


@dataclass(frozen=True)
class SweepArgs:
    axes: tuple[str, ...] = ()  # each --sweep NAME=V1,V2
    file: str | None = None
    parallel: int | None = None  # trials at a time (None: locally 1, on Slurm all)
    retry_failed: bool = False
    offset: int = 0  # slurm/ddp.sbatch's --sweep-offset

    @property
    def given(self) -> bool:
        return bool(self.axes) or self.file is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweep (docs/sweeps.md)")
    group.add_argument(
        SWEEP,
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="run a trial per value, each a whole run in <folder>/<name=value,...>; repeatable: every "
        "combination (--sweep lr=0.01,0.02 --sweep seed=3,4: 4 trials); task settings as task-args.KEY "
        "(default: none: one run)",
    )
    group.add_argument(
        FILE,
        default=None,
        metavar="FILE",
        help="the trials from a TOML file, a [[trial]] table each (default: none)",
    )
    group.add_argument(
        PARALLEL,
        type=int,
        default=None,
        metavar="P",
        help="trials running at once (Slurm: --array=0-N%%P) (default: one at a time with --local, all on Slurm)",
    )
    group.add_argument(
        RETRY,
        action="store_true",
        help="rerun the trials that failed, whatever their budgets (default: off: reported)",
    )


def split(argv: Sequence[str]) -> tuple[SweepArgs, list[str]]:
    """The sweep's flags of `argv`, and the rest: one run's command line (pure; UsageError for a bad value)."""
    axes: list[str] = []
    found: dict[str, str] = {}
    retry = False
    rest: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, inline = word.partition("=")
        if word == "--":
            rest += words[i:]
            break
        if name in TAKES_VALUE:
            if eq:
                value = inline
            elif i + 1 < len(words):
                i += 1
                value = words[i]
            else:
                raise UsageError(f"{name}: expected a value after it (see --help)")
            if name == SWEEP:
                axes.append(value)
            else:
                found[name] = value
        elif word == RETRY:
            retry = True
        else:
            rest.append(word)
        i += 1
    offset = found.get(OFFSET, "0")
    if not offset.isdigit():
        raise UsageError(
            f"{OFFSET} {offset}: expected the index of the array's first trial in the sweep, 0 or more"
        )
    return SweepArgs(tuple(axes), found.get(FILE), _parallel(found.get(PARALLEL)), retry, int(offset)), rest


def _parallel(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{PARALLEL} {text}: expected a whole number of trials at once, 1 or more")
    return value


def without_folder(argv: Sequence[str]) -> list[str]:
    """`argv` less its --folder (the sweep's; every trial gets its own)."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--folder":
            skip = True
        elif not word.startswith("--folder="):
            kept.append(word)
    return kept
