"""The command-line parser every hpc_ddp entry point builds on: usage errors are one line, and long options
are never abbreviated. Light on purpose (argparse only): `--help` must answer before torch is imported."""

from __future__ import annotations

import argparse


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
        """For an unrecognized abbreviation of exactly one option: 'did you mean --folder? ...; '."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        for word in message[len(prefix) :].split():
            name = word.split("=", 1)[0]
            if not name.startswith("--"):
                continue
            matches = [o for o in self._option_string_actions if o.startswith(name) and o != name]
            if len(matches) == 1:
                return f"did you mean {matches[0]}? options are never abbreviated; "
        return ""
