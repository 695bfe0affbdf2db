"""One element of a sweep's job array: which trial it runs, said to its batch shell as shell words (one line).

    python -m hpc_ddp.launch.sweep.element ARRAY.json          # submit's array (hpc_ddp.launch.sweep.array)
    python -m hpc_ddp.launch.sweep.element -- TRAINING OPTIONS --sweep lr=0.01,0.02 [--sweep-offset K]
                                                                # slurm/ddp.sbatch's (`sbatch --array=0-1 ...`)

The element's index is SLURM_ARRAY_TASK_ID (0 outside an array), plus --sweep-offset: the sweep's trial a
second array of a sweep larger than MaxArraySize starts at. It prints the trial's training options (with its
--folder); or nothing, and why on stderr, when the trial has nothing to run (finished, or failed and not to be
rerun: hpc_ddp.launch.sweep.state). A usage error is one line on stderr, exit 2, as anywhere in the kit.

slurm/ddp.sbatch's form reads the sweep from the training options as `submit --sweep` does (the same trials,
names and checks, --folder the sweep's and required), and records the sweep (sweep.json) from every element.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError, run_main
from hpc_ddp.launch.sweep import options, spec, state, trials
from hpc_ddp.run import configfile
from hpc_ddp.run.config import add_train_arguments, from_namespace
from hpc_ddp.scheduler.slurm import env as slurm_env

PROG = "python -m hpc_ddp.launch.sweep.element"


def index(environ: Mapping[str, str], offset: int = 0) -> int:
    text = slurm_env.array_index(environ) or "0"
    if not text.isdigit():
        raise UsageError(f"array index {text!r} (SLURM_ARRAY_TASK_ID): expected a whole number")
    return int(text) + offset


def from_file(path: Path, environ: Mapping[str, str]) -> list[str]:
    """The element's options from its array's file."""
    try:
        listed = json.loads(path.read_text())["trials"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{path}: cannot read the array's trials ({e}). Fix: submit the sweep again"
        ) from None
    at = index(environ)
    if not 0 <= at < len(listed):
        raise UsageError(
            f"{path}: no trial {at} (the array has {len(listed)}). Fix: --array=0-{len(listed) - 1}"
        )
    return [str(word) for word in listed[at]["argv"]]


def _parser() -> Any:
    parser = trials.raising(build_parser(PROG, __doc__ or ""))
    configfile.add_argument(parser)
    add_train_arguments(parser)
    return parser


def from_sweep(argv: Sequence[str], environ: Mapping[str, str], say: Any = print) -> list[str]:
    """The element's options from slurm/ddp.sbatch's training options and sweep flags ([] : nothing to run)."""
    args, rest = options.split(argv)
    if not args.given:
        raise UsageError("expected --sweep NAME=V1,V2 or --sweep-file FILE among the options")

    def read(words: list[str]) -> tuple[None, Any]:
        return None, from_namespace(configfile.parse(_parser(), words))

    _, cfg = read(list(rest))
    if not cfg.folder:
        raise UsageError(
            "a sweep needs --folder: its trials go in <folder>/<name>. Fix: --folder /shared/runs/x"
        )
    folder = Path(cfg.folder).absolute()
    base = options.without_folder(rest)
    combos = spec.combine(args.axes, spec.from_file(args.file) if args.file is not None else None)
    found = trials.expand(combos, base, folder, _parser(), read)  # type: ignore[arg-type]
    at = index(environ, args.offset)
    if at >= len(found):
        raise UsageError(
            f"array index {at}: the sweep has {len(found)} trial(s). Fix: --array=0-{len(found) - 1}"
        )
    trial = found[at]
    folder.mkdir(parents=True, exist_ok=True)
    state.write_record(folder, found, base)
    now = state.read_state(trial.folder)
    if now.state != state.NEW:
        state.refuse_other_run(trial, trial.cfg)
    decided = state.decide(trial, now, trial.cfg.max_restarts, args.retry_failed)
    say(f"[sweep] element {at}: trial {trial.name}: {decided.why}", file=sys.stderr)
    return trial.cfg.to_argv() if decided.action == state.RUN else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        words = from_sweep(argv[1:], os.environ)
    elif len(argv) == 1:
        words = from_file(Path(argv[0]), os.environ)
    else:
        raise UsageError(f"usage: {PROG} ARRAY.json, or {PROG} -- OPTIONS --sweep ...")
    if words:
        print(shlex.join(words))
    return 0


def cli() -> NoReturn:
    run_main(PROG, main)


if __name__ == "__main__":
    cli()
