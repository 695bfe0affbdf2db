"""The error types a user can act on.

Every error that a user can fix derives from `UsageError`: the entry points print its message as one line,
with no traceback, and exit with `exitcodes.USAGE`. Anything else is a bug or a crash and keeps its traceback.
Messages follow one shape: what was found, what was expected, and the fix.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from hpc_ddp import exitcodes


class UsageError(Exception):
    """A mistake in flags, environment or files that the user can fix; exit code 2."""


class ClusterConfigError(UsageError, RuntimeError):
    """The launcher's variables (Slurm, torchrun, RANK/WORLD_SIZE...) are missing or inconsistent."""


class CheckpointError(UsageError):
    """A checkpoint cannot be used: wrong model, incompatible config, or nothing valid to resume from."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's bytes are damaged: its checksum differs from the one recorded when it was written, or it
    is torn or unreadable. Only this means "corrupt"; resuming falls back to the previous checkpoint."""


class CheckpointRefused(CheckpointError):
    """A checkpoint that is intact but holds objects a `weights_only` load refuses (it could run code)."""


class RunStopped(Exception):
    """The kit stopped a run on purpose, on every rank at the same step: one line, no traceback, `code`."""

    code = exitcodes.FAILED


class NonFinite(RunStopped):
    """The loss averaged over all ranks, or the weights about to be saved, became NaN or infinite (exit code
    `exitcodes.NONFINITE`); nothing is saved after the last finite step."""

    code = exitcodes.NONFINITE


class SavingFailed(RunStopped):
    """Checkpoints could not be written even after the retries: the run stops before more work is at risk."""


class DiskFull(RunStopped):
    """The run folder's disk (or quota) stayed full for the whole retry window: a failure, never a usage error
    (the same command works once there is space)."""


def fail(prog: str, message: str, code: int = exitcodes.USAGE) -> NoReturn:
    """Print `prog: error: message` as one line on stderr and exit."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_main(prog: str, main: Callable[[], int]) -> NoReturn:
    """Run an entry point: UsageError -> one line and exit 2; Ctrl-C -> exit 130 without a traceback."""
    try:
        code = main()
    except UsageError as e:
        fail(prog, str(e))
    except RunStopped as e:  # the kit stopped on purpose (a disk still full): one line, its own exit code
        fail(prog, str(e), e.code)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    raise SystemExit(code)


def run_task(prog: str, main: Callable[[], int]) -> NoReturn:
    """Run one task of a job (`hpc_ddp.train`, `hpc_ddp.doctor`) and leave with `exitcodes.leave`: the exit
    code is decided here, on every path, and no interpreter teardown can hang the task after it."""
    quiet = False  # a usage error or --help is its own one-line (or help) answer: nothing after it
    try:
        code = main()
    except UsageError as e:
        code, quiet = exitcodes.USAGE, True
        _say(f"{prog}: error: {e}")
    except RunStopped as e:  # one line on every rank, and the exit code says why
        code = e.code
        _say(f"{prog}: error: {e}")
    except KeyboardInterrupt:
        code = exitcodes.INTERRUPTED
        _say(f"{prog}: interrupted")
    except SystemExit as e:  # argparse's --help (0) and usage errors (2); SystemExit("text") means 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        quiet = isinstance(e.code, (int, type(None)))
        if not quiet:
            _say(str(e.code))
    except BaseException:
        code = exitcodes.FAILED
        _say(traceback.format_exc().rstrip("\n"))
    exitcodes.leave(code, say=not quiet)


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
