"""`submit --local --sweep ...`: the trials on this machine, one after another or `--sweep-parallel P` at a time.

Each trial is its own `python -m hpc_ddp.submit --local` (its command line: hpc_ddp.launch.sweep.trials), so it
is supervised, restarted and resumed exactly as that run alone would be. Trials running at once never share a
port: the sweep gives each launcher a fake job id whose rendezvous port no other trial of it has and that is free
now ($HPC_DDP_LOCAL_JOB_ID), nor a folder (each its own), nor a lock.

With one trial at a time, its launcher talks to this console; with more, each trial's console goes to
`<trial folder>/launcher.log` and the sweep says one line per trial that starts or ends.

Ctrl-C or SIGTERM: every running trial gets SIGINT (it saves at the next agreed step and exits, as a single run
does; a second Ctrl-C reaches them from the terminal at once), no further trial starts, and the sweep waits for
them all: no process outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hpc_ddp import exitcodes
from hpc_ddp.cluster.env import port_for_job
from hpc_ddp.launch.sweep.trials import Trial
from hpc_ddp.scheduler.local import fresh_job_id
from hpc_ddp.variables import LOCAL_JOB_ID

LOG = "launcher.log"
POLL_S = 0.2
STOP_WAIT_S = 120.0  # after SIGINT, a trial's own launcher kills its ranks within its grace (30 s default)


def job_ids(count: int, fresh: Callable[[], str] = fresh_job_id) -> list[str]:
    """`count` fake job ids whose rendezvous ports all differ (each free when drawn)."""
    ids: list[str] = []
    ports: set[int] = set()
    while len(ids) < count:
        job = fresh()
        if port_for_job(job) not in ports:
            ids.append(job)
            ports.add(port_for_job(job))
    return ids


@dataclass
class _Running:
    trial: Trial
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None


def _start(trial: Trial, job_id: str, quiet: bool) -> _Running:
    env = {**os.environ, LOCAL_JOB_ID: job_id}
    log = None
    if quiet:
        Path(trial.folder).mkdir(parents=True, exist_ok=True)
        log = open(Path(trial.folder) / LOG, "ab")  # noqa: SIM115 (closed when the trial ends)
    command = [sys.executable, "-m", "hpc_ddp.submit", *trial.argv]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
    return _Running(trial, process, log)


def run(trials: Sequence[Trial], parallel: int, say: Callable[[str], None]) -> dict[str, int]:
    """Run `trials`, `parallel` at a time: each trial's exit code by name (see the module docstring)."""
    pending = list(trials)
    ids = iter(job_ids(len(pending)))
    running: list[_Running] = []
    codes: dict[str, int] = {}
    quiet = parallel > 1
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
    try:
        while pending or running:
            while pending and len(running) < parallel:
                trial = pending.pop(0)
                if quiet:
                    say(f"[sweep] trial {trial.name}: started (its console: {Path(trial.folder) / LOG})")
                running.append(_start(trial, next(ids), quiet))
            for r in [r for r in running if r.process.poll() is not None]:
                running.remove(r)
                codes[r.trial.name] = _close(r)
                say(f"[sweep] trial {r.trial.name}: {meaning(codes[r.trial.name])}")
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        say(f"[sweep] stopping: {len(running)} running trial(s) save and exit; {len(pending)} not started")
        _stop(running, codes)
        raise
    finally:
        _stop(running, codes)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return codes


def _stop(running: list[_Running], codes: dict[str, int]) -> None:
    """SIGINT to every running trial, then wait for each (killed if it outstays STOP_WAIT_S)."""
    for r in running:
        if r.process.poll() is None:
            r.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    for r in list(running):
        try:
            r.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()
        codes[r.trial.name] = _close(r)
        running.remove(r)


def _close(r: _Running) -> int:
    if r.log is not None:
        r.log.close()
    return r.process.returncode


def meaning(code: int) -> str:
    return f"exit {code} ({exitcodes.MEANING.get(code, 'failed')})"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
