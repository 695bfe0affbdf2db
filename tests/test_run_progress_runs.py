"""Progress and TensorBoard in real local runs (1 node x 2 ranks, gloo): the live line under a pseudo-terminal,
plain lines in a file, the records of metrics.jsonl, and TensorBoard's curves across a preemption and a crash
read back with TensorBoard's own reader."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_environ, die_with_test, run_module
from test_launch_local import finish, read_until, start

from hpc_ddp.run.records.metrics import read_records

LOCAL = ("--nodes", "1", "--tasks-per-node", "2", "--task", "slow_tasks:slow", "--batch-size", "8")
PLAIN = re.compile(
    r"^epoch \d+ step \d+/64 loss \d+\.\d{4}( \| [\d,]+ samples/s)? \| (ETA (\d+[smhd])+|ETA \?|done)$"
)


def run_in_pty(
    folder: Path, *args: str, timeout: float = 90, module: str = "hpc_ddp.submit"
) -> tuple[int, str]:
    """`python -m module --folder folder args` with its stdout and stderr on a pseudo-terminal; the bytes it
    showed there."""
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", module, "--folder", str(folder), *args]
    proc = subprocess.Popen(
        cmd,
        env=clean_environ(SLOW_TASK_SLEEP_S="0.02"),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        preexec_fn=die_with_test,
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal's other end is gone
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, out.decode("utf-8", "replace")


@pytest.mark.slow
@pytest.mark.deadline(90)
def test_on_a_terminal_the_local_run_shows_a_live_line_in_place_and_logs_plain_lines(tmp_path: Path) -> None:
    code, shown = run_in_pty(tmp_path, "--local", *LOCAL, "--epochs", "2", "--log-every-s", "0.5")
    assert code == 0, shown
    # The article's lines are all there (a pseudo-terminal turns "\n" into "\r\n").
    text = shown.replace("\r\n", "\n")
    for line in (
        "Process 0 initialized",
        "Epoch 1, Loss: ",
        "Model saved by rank 0",
        "Process group destroyed",
    ):
        assert line in text, shown
    # Rank 0's live line, rewritten in place: one update follows another with no new line between them.
    live = re.findall(r"\r\x1b\[K(epoch \d+ step (\d+)/64 [^\r\n]*)", shown)
    assert len({step for _, step in live}) >= 3, shown
    assert re.search(r"\r\x1b\[Kepoch \d+ step \d+/64 [^\n]*\r\x1b\[Kepoch \d+ step \d+/64", shown), shown
    assert all(PLAIN.match(line) for line, _ in live), live
    # Rank 0's log has plain lines only: its periodic progress lines, no live line.
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "\r" not in log and "\x1b" not in log
    progress = [line for line in log.splitlines() if line.startswith("epoch ")]
    assert progress and all(PLAIN.match(line) for line in progress), log


@pytest.mark.slow
@pytest.mark.deadline(60)
def test_a_task_alone_on_a_terminal_rewrites_its_live_line_and_its_other_lines_erase_it(
    tmp_path: Path,
) -> None:
    code, shown = run_in_pty(
        tmp_path, "--task", "slow_tasks:slow", "--batch-size", "16", "--epochs", "1", module="hpc_ddp.train"
    )
    assert code == 0, shown
    assert re.search(r"\r\x1b\[Kepoch 0 step \d+/32 [^\n]*\r\x1b\[Kepoch 0 step \d+/32", shown), shown
    # The lines that follow the live line start by erasing it: no progress text is left in front of them.
    assert "\r\x1b[KEpoch 0, Loss: " in shown and f"\r\x1b[KModel saved by rank 0 to {tmp_path}" in shown, (
        shown
    )


@pytest.mark.slow
@pytest.mark.deadline(90)
def test_in_a_file_progress_is_plain_lines_and_metrics_jsonl_has_the_records_the_report_needs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "console.txt"
    folder = tmp_path / "run"
    with open(out, "w") as f:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hpc_ddp.submit",
                "--local",
                "--folder",
                str(folder),
                *LOCAL,
                "--epochs",
                "2",
                "--log-every-s",
                "0.2",
                "--save-every-steps",
                "10",
            ],
            env=clean_environ(SLOW_TASK_SLEEP_S="0.02"),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=80,
            preexec_fn=die_with_test,
        )
    shown = out.read_text()
    assert proc.returncode == 0, shown
    assert "\r" not in shown and "\x1b" not in shown
    lines = [line for line in shown.splitlines() if line.startswith("epoch ")]
    assert len(lines) >= 2 and all(PLAIN.match(line) for line in lines), shown

    records = read_records(folder / "metrics.jsonl")
    by = lambda event: [r for r in records if r["event"] == event]  # noqa: E731
    [begin] = by("start")
    assert set(begin) == {
        "event",
        "job",
        "restart",
        "epoch",
        "step",
        "resumed",
        "world_size",
        "startup_s",
        "time",
    }
    assert (begin["restart"], begin["epoch"], begin["step"], begin["resumed"], begin["world_size"]) == (
        0,
        0,
        0,
        False,
        2,
    )
    assert isinstance(begin["job"], str) and begin["job"] and 0 < begin["startup_s"] < 60
    assert records.index(begin) < records.index(by("step")[0])  # right before the first step
    steps = by("step")
    assert len(steps) >= 2
    for r in steps:
        assert {
            "lr",
            "data_s",
            "total_steps",
            "eta_s",
            "loss",
            "samples_per_s",
            "step_time_s",
            "time",
        } <= set(r)
        assert r["lr"] == 0.01 and r["total_steps"] == 64 and r["data_s"] >= 0
        assert r["eta_s"] is None or (isinstance(r["eta_s"], float) and r["eta_s"] >= 0)
    assert any(isinstance(r["eta_s"], float) for r in steps)
    ranks = by("ranks")
    assert [r["step"] for r in ranks] == list(range(5, 65, 5))
    for r in ranks:
        assert set(r) == {"event", "epoch", "step", "step_time_s", "data_s", "time"}
        assert len(r["step_time_s"]) == 2 and all(t > 0 for t in r["step_time_s"])
        assert len(r["data_s"]) == 2 and all(t >= 0 for t in r["data_s"])
    saves = by("save")
    assert [r["step"] for r in saves] == [10, 20, 30, 32, 40, 50, 60, 64]  # every 10 steps, each epoch's end
    assert [r["final"] for r in saves] == [False] * 7 + [True]
    for r in saves:
        assert set(r) == {"event", "epoch", "step", "stall_s", "write_s", "final", "time"}
        assert r["stall_s"] > 0 and r["write_s"] > 0


def test_tensorboard_without_its_package_exits_2_with_the_install_line_on_every_entry_point(
    tmp_path: Path,
) -> None:
    hidden = tmp_path / "hidden" / "tensorboard"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ImportError(\"No module named 'tensorboard' (hidden by the test)\")\n"
    )
    env = clean_environ(PYTHONPATH=os.pathsep.join([str(hidden.parent), str(ROOT / "tests"), str(ROOT)]))
    for argv in (["hpc_ddp.train"], ["hpc_ddp.submit", "--local"], ["hpc_ddp.submit", "--nodes", "1"]):
        proc = run_module(*argv, "--tensorboard", "--folder", str(tmp_path / "run"), env=env, timeout=60)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        [line] = proc.stderr.strip().splitlines()
        assert (
            "--tensorboard needs the tensorboard package" in line
            and "pip install 'hpc-ddp[tensorboard]'" in line
        )
    assert not (tmp_path / "run").exists()  # refused before anything was made


def event_steps(directory: Path) -> list[tuple[str, dict[str, list[int]]]]:
    """Every event file of `directory` in the order written (by name: it starts with the time), each with the
    steps of every scalar tag in file order, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        tags: dict[str, list[int]] = {}
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
        files.append((path.name, tags))
    return files


@pytest.mark.slow
@pytest.mark.deadline(150)
def test_tensorboard_curves_go_on_across_a_preemption_and_a_crash_with_no_step_twice(tmp_path: Path) -> None:
    pytest.importorskip(
        "tensorboard",
        reason="--tensorboard's test needs the tensorboard package (env/setup.sh --test installs it)",
    )
    import tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # The tensorboard this test imports, for the runs too (clean_environ sets PYTHONPATH).
    site = str(Path(tensorboard.__file__).resolve().parent.parent)
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT), site])
    args = (
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--task",
        "progress_tasks:crash_on_restart",
        "--batch-size",
        "8",
        "--epochs",
        "3",
        "--tensorboard",
    )
    # 1st launch: preempted after epoch 0 (the launcher restarts it from that checkpoint); on the restart rank 1
    # crashes 12 steps later, long after the last checkpoint: the launch fails.
    # --max-restarts 0: the crash ends this launch (a retry would resume at once; the next launch does it here).
    proc = start(
        tmp_path, *args, "--max-restarts", "0", SLOW_TASK_SLEEP_S="0.02", CRASH_AT_CALL="12", PYTHONPATH=path
    )
    read_until(proc, "Epoch 0,")
    proc.send_signal(signal.SIGUSR2)
    code, out = finish(proc, timeout=100)
    assert code == 1 and "restarting all ranks (1 of --max-requeue 3)" in out and "crash on restart" in out, (
        out
    )
    # 2nd launch, the same command: it resumes from the preemption's checkpoint and trains those steps again.
    proc = start(tmp_path, *args, SLOW_TASK_SLEEP_S="0.02", PYTHONPATH=path)
    code, out = finish(proc, timeout=100)
    assert code == 0, out

    starts = [r for r in read_records(tmp_path / "metrics.jsonl") if r["event"] == "start"]
    assert [(s["restart"], s["resumed"]) for s in starts] == [(0, False), (1, True), (0, True)]
    resumed_at = starts[2]["step"]
    assert resumed_at == starts[1]["step"] and 32 < resumed_at < 64  # the preemption's checkpoint
    files = event_steps(tmp_path / "tb")
    assert len(files) == 3, files  # one per start
    crashed = files[1][1]["train/loss"]
    assert max(crashed) > resumed_at, crashed  # steps after the checkpoint were written, then trained again
    expected = {
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "time/step_s",
        "time/data_s",
        "time/checkpoint_stall_s",
        "time/checkpoint_write_s",
        "rank_step_time/0",
        "rank_step_time/1",
    }
    for tag in expected:
        steps = [step for _, tags in files for step in tags.get(tag, [])]
        assert steps == sorted(set(steps)), (tag, steps)  # strictly increasing across the files: none twice
    losses = {step for _, tags in files for step in tags["train/loss"]}
    assert set(range(1, resumed_at + 1)) | set(range(max(crashed) + 1, 97)) <= losses
    assert max(losses) == 96
    saved = [step for _, tags in files for step in tags.get("time/checkpoint_stall_s", [])]
    assert saved[0] == 32 and resumed_at in saved and saved[-1] == 96
    # TensorBoard's own view of the folder: every tag there.
    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    board.Reload()
    assert expected <= set(board.Tags()["scalars"])
    assert [e.step for e in board.Scalars("train/loss")][-1] == 96
