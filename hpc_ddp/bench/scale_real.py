"""The scale bench's real part (`--real NODESxRANKS`): a real local run of NODES x RANKS ranks (the `mlp` task,
gloo, the local launcher: `submit --local`), and a second one in which one rank is SIGSTOPped after its first
steps, which the hang verdict must name within its limit plus 60 s, leaving nothing running.

Timings on a shared 2-core machine are loaded by whatever else runs there: they prove the path works at that
size; on a cluster's node they measure it (docs/scale.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from hpc_ddp import exitcodes
from hpc_ddp.bench.runs import TASK, child_env
from hpc_ddp.errors import UsageError

LIMIT_S = 10  # the stopped run's --hang-timeout-s
GRACE_S = 60.0  # the verdict within the limit plus this
START_TIMEOUT_S = 600.0


def shape(text: str) -> tuple[int, int]:
    """'8x16' -> (8, 16) (UsageError otherwise)."""
    try:
        nodes, ranks = (int(x) for x in text.lower().split("x"))
    except ValueError:
        nodes = ranks = 0
    if nodes < 1 or ranks < 1 or nodes * ranks < 2:
        raise UsageError(f"--real {text}: expected NODESxRANKS of 2 ranks or more, e.g. --real 8x16")
    return nodes, ranks


def _cmd(folder: Path, nodes: int, ranks: int, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hpc_ddp.submit",
        "--local",
        "--nodes",
        str(nodes),
        "--tasks-per-node",
        str(ranks),
        "--task",
        TASK,
        "--batch-size",
        "2",
        "--max-steps",
        str(steps),
        "--save-every-epochs",
        "0",
        "--log-every-s",
        "0",
        "--max-restarts",
        "0",
        "--folder",
        str(folder),
        *extra,
    ]


def _first_step(folder: Path) -> float | None:
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("event") == "step":
            return float(record["time"])
    return None


def real(work: Path, nodes: int, ranks: int) -> dict[str, Any]:
    return {
        "run": _run(work / "real-run", nodes, ranks),
        "stopped": _stopped(work / "real-stop", nodes, ranks),
    }


def _run(folder: Path, nodes: int, ranks: int) -> dict[str, Any]:
    """A run of a few steps: its exit code, command start to the first step, and the whole command."""
    begun = time.time()
    with open(f"{folder}.log", "wb") as log:
        proc = subprocess.Popen(
            _cmd(folder, nodes, ranks, 5), stdout=log, stderr=subprocess.STDOUT, env=child_env(),
            start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # our own session: the launcher and its ranks
                proc.wait()
    first = _first_step(folder)
    return {
        "ranks": nodes * ranks,
        "exit": code,
        "first_step_s": None if first is None else round(first - begun, 1),
        "total_s": round(time.time() - begun, 1),
    }


def _ranks(launcher: int) -> dict[int, psutil.Process]:
    """The launcher's ranks by rank (a forked rank's process name says its rank)."""
    found = {}
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            name = child.name()
        except psutil.Error:
            continue
        if name.startswith("hpc_ddp rank "):
            found[int(name.split()[-1])] = child
    return found


def _stopped(folder: Path, nodes: int, ranks: int) -> dict[str, Any]:
    """A long run, one rank SIGSTOPped after the first step: who the verdict names, and when."""
    n = nodes * ranks
    victim = n // 2
    log = open(f"{folder}.log", "wb")  # noqa: SIM115 - closed below, on every path
    proc = subprocess.Popen(
        _cmd(folder, nodes, ranks, 100000, "--hang-timeout-s", str(LIMIT_S)),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(),
        start_new_session=True,
    )
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _first_step(folder) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        started = list(psutil.Process(proc.pid).children(recursive=True))
        target = _ranks(proc.pid).get(victim)
        if target is None:
            return {"ranks": n, "error": f"rank {victim} not found (exit {proc.poll()})"}
        target.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            code: int | None = proc.wait(timeout=LIMIT_S + GRACE_S + 120)
        except subprocess.TimeoutExpired:
            code = None  # no verdict ended it: the group is killed below, and the figures say so
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: the launcher and its ranks
            proc.wait()
        log.close()
    left = [p.pid for p in started if _alive(p)]
    verdict = json.loads((folder / "hang.json").read_text()) if (folder / "hang.json").exists() else {}
    return {
        "ranks": n,
        "stopped": victim,
        "named": verdict.get("culprits"),
        "exit": code,
        "hang_exit": code == exitcodes.HANG,
        "verdict_after_stop_s": round(took, 1),
        "within": took <= LIMIT_S + GRACE_S,
        "left_running": left,
    }


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
