"""What a local run says and where it keeps its run (issue 21): the quick start run twice in a clean folder
(the second run comes back to the first one's folder), another run refused there in one line, and the string
rules of the console (a rank's consequential error, the user's stop, plurals, the command that resumes)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_module

from hpc_ddp import exitcodes
from hpc_ddp.launch.local.console import consequence, stopped_by
from hpc_ddp.launch.local.launcher import stop_words
from hpc_ddp.log import count
from hpc_ddp.submit import resume_command

GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:57990. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error. GLHF! 🏖️  (traceback in runs/x/logs/rank0.log)"
)


@pytest.mark.parametrize(
    ("line", "found"),
    [
        (GLOO, "Connection closed by peer"),
        ("RuntimeError: [../third_party/gloo/...] Connection reset by peer", "Connection reset by peer"),
        (
            "torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error",
            "remote process exited",
        ),
        ("RuntimeError: rank 0 failed (it could not write checkpoints, see its log)", "rank 0 failed"),
        ("RuntimeError: boom from rank 1 (tests/slow_tasks.py:crash)", None),
        ("Epoch 3, Loss: 0.1234", None),
        ("Process group destroyed", None),
    ],
)
def test_a_consequential_error_is_recognised_by_its_words(line: str, found: str | None) -> None:
    assert consequence(line) == found


@pytest.mark.parametrize(
    ("line", "by", "shown"),
    [
        (
            "SIGTERM: stopped by SIGTERM: checkpoint saved, not requeued",
            "interrupted (Ctrl-C)",
            "interrupted (Ctrl-C): checkpoint saved, not requeued",
        ),
        (
            "SIGTERM: every rank stopped at step 7; saving a checkpoint",
            "interrupted (Ctrl-C)",
            "interrupted (Ctrl-C): every rank stopped at step 7; saving a checkpoint",
        ),
        (
            "SIGTERM: stopped by SIGTERM: checkpoint saved, not requeued",
            "stopped by SIGTERM",
            "stopped by SIGTERM: checkpoint saved, not requeued",
        ),
        ("SIGTERM: stopped by SIGTERM: x", "", "SIGTERM: stopped by SIGTERM: x"),  # no stop asked: as written
        ("Epoch 0, Loss: 1.0", "interrupted (Ctrl-C)", "Epoch 0, Loss: 1.0"),
    ],
)
def test_a_stop_is_said_in_the_users_words(line: str, by: str, shown: str) -> None:
    assert stopped_by(line, by) == shown


def test_the_stop_signals_by_name() -> None:
    assert stop_words(signal.SIGINT) == "interrupted (Ctrl-C)"
    assert stop_words(signal.SIGTERM) == "stopped by SIGTERM"
    assert stop_words(signal.SIGHUP) == "the terminal closed (SIGHUP)"
    assert stop_words(0) == ""


@pytest.mark.parametrize(
    ("n", "one", "many", "text"),
    [
        (1, "thread", None, "1 thread"),
        (2, "thread", None, "2 threads"),
        (0, "rank", None, "0 ranks"),
        (1, "process", "processes", "1 process"),
        (4, "process", "processes", "4 processes"),
    ],
)
def test_counts_say_their_noun_in_the_right_number(n: int, one: str, many: str | None, text: str) -> None:
    assert count(n, one, many) == text


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["--local"], "{py} -m hpc_ddp.submit --local"),
        (
            ["--local", "--folder", "my runs/a", "--seed", "3"],
            "{py} -m hpc_ddp.submit --local --folder 'my runs/a' --seed 3",
        ),
        # What would start over instead of resuming is left out: --resume never --overwrite deletes the
        # checkpoints, --resume PATH goes back to PATH.
        (
            ["--local", "--resume", "never", "--overwrite", "--epochs", "5"],
            "{py} -m hpc_ddp.submit --local --epochs 5",
        ),
        (["--local", "--resume=/x/ckpt-00000010.pt"], "{py} -m hpc_ddp.submit --local"),
    ],
)
def test_the_command_that_resumes(argv: list[str], command: str) -> None:
    assert resume_command(argv, "/opt/venv/bin/python", "/home/me") == command.format(
        py="/opt/venv/bin/python"
    )
    # The interpreter of a venv under the working directory, as the user typed it (README's quick start).
    assert resume_command(argv, "/home/me/.venv/bin/python", "/home/me").startswith(".venv/bin/python -m ")


def readme_quick_start() -> list[str]:
    """The console lines README's quick start shows."""
    text = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    return text.split("The first command prints", 1)[1].split("```\n", 1)[1].split("```", 1)[0].splitlines()


def quick_start_console(lines: list[str], readme: list[str] | None = None) -> list[str]:
    """The differences between a quick start's console `lines` and README's (empty when they match): README's
    job id and host stand for any, its "..." for any number of "Epoch N, Loss: X" lines."""
    expected = readme_quick_start() if readme is None else readme
    patterns = []
    for line in expected:
        if line == "...":
            patterns.append(r"(Epoch \d+, Loss: \d+\.\d+\n)*")
            continue
        pattern = re.escape(line)
        pattern = re.sub(r"local\\ job\\ \d+", r"local\\ job\\ \\d+", pattern)
        pattern = pattern.replace(r"initialized\ on\ vm\ ", r"initialized\ on\ \S+\ ")
        patterns.append(pattern + r"\n")
    text = "".join(line + "\n" for line in lines)
    if re.fullmatch("".join(patterns), text):
        return []
    return [
        line for line in lines if not any(re.fullmatch(p.rstrip("*"), line + "\n") for p in patterns)
    ] or ["the lines match README's one by one, but not in its order"]


def test_the_quick_start_console_comparison_sees_an_extra_line() -> None:
    """The comparison is not vacuous: README's own lines match; one warning more, or an epoch less, does not."""
    readme = readme_quick_start()
    run = [line.replace("2704049", "99").replace(" on vm ", " on node7 ") for line in readme]
    run[run.index("...") : run.index("...") + 1] = [f"Epoch {e}, Loss: 1.0000" for e in range(1, 9)]
    assert quick_start_console(run) == []
    warning = "<frozen runpy>:128: RuntimeWarning: 'hpc_ddp.launch.local.forkserver' found in sys.modules"
    assert quick_start_console([run[0], warning, *run[1:]]) == [warning]
    assert quick_start_console(run[:2] + run[3:]) != []


@pytest.mark.slow
@pytest.mark.deadline(
    240
)  # two 2x2 runs of the quick start: 25 s in all alone, 90 s under load 18 (measured)
def test_the_quick_start_twice_trains_then_says_it_is_finished(tmp_path: Path) -> None:
    """README's quick start (`python -m hpc_ddp.submit --local`) in a clean folder, then again: before, each
    run got a new runs/local-<id> folder and trained from scratch; now the second finds the first's folder."""
    first = run_module("hpc_ddp.submit", "--local", cwd=tmp_path, timeout=120)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    # Line by line what README's quick start shows, nothing more (issue 37 item 4: no runpy warning from the
    # fork server, no straggler named in a 7-second run, no scrap of a torch warning): only the job id and the
    # host differ, and README's "..." stands for the epochs between.
    assert quick_start_console(out.splitlines()) == [], out
    folder = tmp_path / "runs" / "linear"
    assert "run folder runs/linear (the default for this task: the same command resumes there)" in out
    assert "2 nodes x 2 processes" in out
    # The article's lines, from rank 0 alone: the other ranks' are in their logs (--all-ranks shows them).
    assert out.count("Process 0 initialized on ") == 1 and "1 thread;" in out and "1 threads" not in out
    assert "[rank " not in out, out
    assert out.count("Process group destroyed") == 1
    epochs = [line.split(",")[0] for line in out.splitlines() if line.startswith("Epoch ")]
    assert epochs == [f"Epoch {e}" for e in range(10)]
    losses = [float(line.split("Loss:")[1]) for line in out.splitlines() if line.startswith("Epoch ")]
    assert losses[-1] < losses[0]
    assert "Parameters identical on all 4 ranks" in out
    assert "Model saved by rank 0 to runs/linear/model.pth" in out
    bare = torch.nn.Linear(10, 1)
    bare.load_state_dict(torch.load(folder / "model.pth", weights_only=True))  # no "module." prefix
    assert sorted(p.name for p in (folder / "logs").iterdir()) == [f"rank{r}.log" for r in range(4)]
    for rank in range(4):
        log = (folder / "logs" / f"rank{rank}.log").read_text()
        assert f"Process {rank} initialized" in log and "Process group destroyed" in log
    # Each rank's derivation: 2 emulated nodes x 2 local ranks.
    assert "(node 1, local rank 1, cpu, gloo" in (folder / "logs" / "rank3.log").read_text()

    again = run_module("hpc_ddp.submit", "--local", cwd=tmp_path, timeout=120)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert f"The run in {Path('runs/linear')} already finished at epoch 10" in out, out
    assert "Traceback" not in out and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["linear"]

    # Another run (another --seed) would mix its checkpoints and records with this one's: one line, exit 2,
    # before any rank starts.
    other = run_module("hpc_ddp.submit", "--local", "--seed", "1", cwd=tmp_path, timeout=60)
    assert other.returncode == exitcodes.USAGE, other.stdout + other.stderr
    assert other.stdout == "" and len(other.stderr.splitlines()) == 1, other.stderr
    assert (
        "run folder runs/linear (the default for --task linear) holds another run, started with --seed 0 "
        in (other.stderr)
    )
    assert "Fix: --folder runs/linear-2 (or any new folder)" in other.stderr
