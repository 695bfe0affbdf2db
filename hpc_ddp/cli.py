"""The command-line parser every hpc_ddp entry point builds on: usage errors are one line, and long options
are never abbreviated. Light on purpose (argparse only): `--help` must answer before torch is imported."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable

# How alike a mistyped name and a real one must be to be suggested (difflib's ratio: 2 x matching characters /
# both lengths): --batchsize -> --batch-size (0.95), grad-accumulation -> grad-accum (0.74); weight-decay is
# nothing like --signal-delay-s (0.54), and a suggestion that far off misleads more than it helps.
CUTOFF = 0.7


def nearest(word: str, names: Iterable[str]) -> str | None:
    """The real name `word` most likely meant (pure): the closest by difflib above CUTOFF, else the one name it
    abbreviates (`warmup` -> `warmup-steps`); None when nothing is close."""
    names = list(names)
    close = difflib.get_close_matches(word, names, n=1, cutoff=CUTOFF)
    if close:
        return close[0]
    longer = [n for n in names if n.startswith(word) and n != word]
    return longer[0] if len(longer) == 1 else None


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser whose usage errors exit 2 with one line naming the flag.

    Long options are never abbreviated: argparse's default would take `--fold x` as `--folder x`, and a
    prefix that is unique today becomes ambiguous, or means another option, when a flag is added.
    """
    return _Parser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> argparse.NoReturn:  # type: ignore[name-defined]
        # argparse prints the whole usage block first; one line with the fix is easier to read in a job log.
        self.exit(2, f"{self.prog}: error: {message} ({self._did_you_mean(message)}see --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """For an unrecognized option: the real one it abbreviates ('did you mean --folder? options are never
        abbreviated; '), or the one it is a typo of ('did you mean --batch-size? '), when one is close."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        for word in message[len(prefix) :].split():
            name = word.split("=", 1)[0]
            if not name.startswith("--"):
                continue
            matches = [o for o in options if o.startswith(name) and o != name]
            if len(matches) == 1:
                return f"did you mean {matches[0]}? options are never abbreviated; "
            meant = nearest(name, options)
            if meant is not None:
                return f"did you mean {meant}? "
        return ""
