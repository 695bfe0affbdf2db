"""The base modules: running a short command (proc), the shared parser (cli), the version re-export."""

from __future__ import annotations

import sys

import pytest

from hpc_ddp import _version, exitcodes, proc
from hpc_ddp.cli import build_parser


def test_a_command_that_runs_gives_its_output() -> None:
    out = proc.run([sys.executable, "-c", "print('hello')"])
    assert out.ok and out.stdout == "hello\n" and out.error == ""


@pytest.mark.parametrize(
    "argv, error",
    [
        (["no-such-command-hpc-ddp"], "no-such-command-hpc-ddp not found on PATH"),
        ([sys.executable, "-c", "import sys; sys.exit(3)"], "exit code 3"),
        ([sys.executable, "-c", "import sys; sys.stderr.write('refused\\n'); sys.exit(1)"], "refused"),
    ],
)
def test_a_command_that_fails_gives_why_instead_of_raising(argv: list[str], error: str) -> None:
    out = proc.run(argv)
    assert not out.ok and out.error == error


def test_a_command_that_hangs_is_given_up_on() -> None:
    out = proc.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert not out.ok and "did not answer within 0.5 s" in out.error


def test_the_package_reexports_the_version() -> None:
    import hpc_ddp

    assert hpc_ddp.__version__ == _version.__version__


def test_the_shared_parser_never_abbreviates(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser("prog", "")
    parser.add_argument("--folder")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--fold", "x"])
    assert e.value.code == exitcodes.USAGE
    assert "did you mean --folder?" in capsys.readouterr().err
