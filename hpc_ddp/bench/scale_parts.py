"""The scale bench's parts other than the hang (bench/scale_hang.py): each drives the kit's own code for N
simulated ranks and returns its figures. No training, no torch collectives: the control plane alone.

- rendezvous: N clients of the rendezvous store as the kit makes it (hpc_ddp.cluster.group._store: rank 0
  hosts a TCPStore, torch's default backend, the others connect), from a pool of threads, each then adding
  itself to one counter (the store's traffic a join makes); seconds until all have.
- exits and judge: the attempt's exit notes as N ranks leave them (hpc_ddp.ledger.exits.note: N - 1 say a peer
  went, one says the real first cause), read as the supervisor reads them, then judged (hpc_ddp.ledger.judge).
- files: what each rank adds to the run folder per attempt (its exit note's space set aside at start, in its
  node's file of 8 ranks, given back at a clean end; its note after a failure).
- report: `python -m hpc_ddp.report` over a run folder whose records hold N ranks (a "ranks" record every 5
  steps for 1,000 steps, attempts.jsonl's start and end of 2 attempts naming every rank's node).
- slurm: the Slurm commands one look of `submit --wait` runs (hpc_ddp.launch.slurm.follow.look), against a
  fake cluster that answers for a job of N / 8 nodes, counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_ddp import proc
from hpc_ddp.ledger import attempts, exits
from hpc_ddp.ledger.judge import Evidence, judge

CLIENT_THREADS = 64  # threads that connect the simulated ranks' store clients
NODE_RANKS = 8  # simulated ranks per node (8 GPUs)
STEPS = 1000  # steps in the report's records
VANISHED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.1.0.7]:41872"


@dataclass(frozen=True)
class _Env:
    """What hpc_ddp.cluster.group._store reads of a rank's DistEnv."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _more_files(n: int) -> None:
    """Two sockets per simulated client in this one process: raise the soft limit as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, min(hard, 2 * n + 1024))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def rendezvous(n: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """N - 1 clients join rank 0's store, measured in a process of its own (its sockets, its interpreter lock,
    torch's C++ log quiet: each of its warnings asks the resolver for the peer's name, which stalls the store's
    loop where reverse DNS does not answer)."""
    code = "import json, sys; from hpc_ddp.bench.scale_parts import joins; print(json.dumps(joins(int(sys.argv[1]))))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(n)],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
        timeout=timeout_s + 60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def joins(n: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """N - 1 clients join rank 0's store; seconds from the first connect to the last join, and how long the
    store did not answer a client that was already connected (`stalled_s`: not the store's own work)."""
    from hpc_ddp.cluster.group import _store

    _more_files(n)
    timeout = timedelta(seconds=timeout_s)
    server = _store(_Env(0, n, "127.0.0.1", 0), timeout)  # type: ignore[arg-type]
    port = server.port
    probe = _store(_Env(1, n, "127.0.0.1", port), timeout)  # type: ignore[arg-type]

    def join(rank: int) -> Any:
        client = _store(_Env(rank, n, "127.0.0.1", port), timeout)  # type: ignore[arg-type]
        client.add("joined", 1)
        return client

    stalled, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            begun = time.monotonic()
            probe.add("probe", 1)
            took = time.monotonic() - begun
            stalled[0] += took if took > 0.5 else 0.0
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    begun = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        clients = list(pool.map(join, range(1, n)))
    took = time.monotonic() - begun
    done.set()
    watcher.join()
    joined = int(server.add("joined", 0))
    del clients, server
    return {
        "ranks": n,
        "seconds": round(took, 3),
        "stalled_s": round(stalled[0], 2),
        "seconds_less_stalls": round(max(0.0, took - stalled[0]), 3),
        "joined": joined + 1,
        "libuv": _libuv(),
    }


def _libuv() -> bool | None:
    import torch.distributed as dist

    try:
        return bool(dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False).libuvBackend)
    except (AttributeError, RuntimeError):
        return None


def _raise(error: Exception) -> BaseException:
    try:
        raise error
    except Exception as e:
        return e


def notes_and_judge(folder: Path, n: int, first: int | None = None) -> dict[str, Any]:
    """N notes (one first cause, N - 1 a peer went), read and judged as a supervisor does."""
    first = n // 3 if first is None else first
    job = "sim"
    begun = time.monotonic()
    exits.note(folder, job, 0, first, _node(first), _raise(ValueError("batch 17 has a NaN label")))
    for rank in range(n):
        if rank != first:
            exits.note(folder, job, 0, rank, _node(rank), _raise(RuntimeError(VANISHED)))
    wrote = time.monotonic() - begun
    files, size = tree(exits.attempt_folder(folder, job, 0))
    begun = time.monotonic()
    notes = tuple(exits.read(folder, job, 0))
    read = time.monotonic() - begun
    begun = time.monotonic()
    ending = judge(Evidence(code=1, rank_nodes=tuple(_node(r) for r in range(n)), notes=notes))
    judged = time.monotonic() - begun
    return {
        "ranks": n,
        "write_s": round(wrote, 3),
        "read_s": round(read, 3),
        "judge_s": round(judged, 4),
        "named": ending.rank,
        "first": first,
        "note_files": files,
        "note_bytes": size,
    }


def files_per_rank(folder: Path, n: int) -> dict[str, Any]:
    """What N ranks add to the run folder in one attempt: at its start (each rank's note space set aside),
    and after a clean end (given back)."""
    job = "files"
    before = tree(folder)
    for rank in range(n):
        exits.reserve(folder, job, 0, rank, _slot(rank))
    started = tree(folder)
    for rank in range(n):
        exits.release(folder, job, 0, rank, _slot(rank))
    ended = tree(folder)
    return {
        "ranks": n,
        "start_files_per_rank": round((started[0] - before[0]) / n, 3),
        "start_bytes_per_rank": round((started[1] - before[1]) / n),
        "end_files_per_rank": round((ended[0] - before[0]) / n, 3),
    }


def _slot(rank: int) -> exits.Slot:
    """A rank's place on its node, as a rank of the kit gives it to its exit note (hpc_ddp.run.session)."""
    return (rank // NODE_RANKS, rank % NODE_RANKS, NODE_RANKS)


def _node(rank: int) -> str:
    return f"node{rank // NODE_RANKS:05d}"


def tree(root: Path) -> tuple[int, int]:
    """(files, bytes) under `root`: what a run folder gains, counted the same way by every section."""
    files = size = 0
    for where, _, names in os.walk(root):
        for name in names:
            files += 1
            size += os.path.getsize(os.path.join(where, name))
    return files, size


def report(folder: Path, n: int) -> dict[str, Any]:
    """`python -m hpc_ddp.report` over a run folder of N ranks' records: the whole command, as a user runs it."""
    folder.mkdir(parents=True, exist_ok=True)
    _records(folder, n)
    begun = time.monotonic()
    code = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.report", str(folder), "--no-sacct"],
        capture_output=True,
        timeout=600,
        check=False,
    ).returncode
    took = time.monotonic() - begun
    return {
        "ranks": n,
        "seconds": round(took, 2),
        "exit": code,
        "metrics_bytes": (folder / "metrics.jsonl").stat().st_size,
        "attempts_bytes": attempts.path(folder).stat().st_size,
        "html_bytes": (folder / "report.html").stat().st_size,
    }


def _records(folder: Path, n: int) -> None:
    """metrics.jsonl and attempts.jsonl as a run of N ranks writes them: 2 attempts of 500 steps each."""
    t0 = time.time() - 4000.0
    ranks = [_node(r) for r in range(n)]
    nodes = sorted(set(ranks))
    lines = []
    for restart, (lo, hi) in enumerate(((0, 500), (500, STEPS))):
        start = t0 + restart * 2000.0
        attempts.record_start(folder, "1234", restart, nodes, ranks, lo or None, now=start)
        lines.append({"event": "start", "time": start + 30, "job": "1234", "restart": restart, "epoch": 0})
        lines[-1].update(step=lo, resumed=bool(lo), world_size=n, startup_s=30.0)
        for step in range(lo + 1, hi + 1):
            when = start + 30 + (step - lo) * 2.0
            lines.append({"event": "step", "time": when, "epoch": 0, "step": step, "loss": 1.0 / step})
            lines[-1].update(samples_per_s=4096.0, step_time_s=2.0, lr=0.1, data_s=0.01, total_steps=STEPS)
            if step % 5 == 0:
                times = [round(1.9 + (r % 7) * 0.01, 4) for r in range(n)]
                row = {"event": "ranks", "time": when, "epoch": 0, "step": step, "step_time_s": times}
                lines.append({**row, "data_s": [0.01] * n})
        outcome = "failed" if restart == 0 else "completed"
        end = {"event": "end", "job": "1234", "restart": restart, "time": start + 1100, "outcome": outcome}
        end.update(step=hi, checkpoint=hi, rank=n // 3 if not restart else None, node=None, blamed=False)
        end.update(reason="ValueError: x" if not restart else "finished", signature="", decision="")
        attempts.append(folder, {**end, "exclude": []})
    with open(folder / "metrics.jsonl", "w") as f:
        for record in lines:
            f.write(json.dumps(record) + "\n")


class _Cluster:
    """A fake Slurm that answers for one job of `nodes` nodes, running or just failed; counts the calls."""

    def __init__(self, nodes: int, state: str) -> None:
        self.nodes, self.state, self.calls, self.bytes = nodes, state, 0, 0

    def __call__(self, argv: Any, timeout_s: float) -> proc.Output:
        self.calls += 1
        hosts = f"node[00000-{self.nodes - 1:05d}]"
        if argv[0] == "sacct":
            text = f"1234|{self.state}|{'1:0' if self.state == 'FAILED' else '0:0'}|None\n"
        elif argv[0] == "scontrol":
            text = f"JobId=1234 JobState={self.state} Restarts=0 NumNodes={self.nodes} NodeList={hosts}\n"
        else:
            text = ""
        self.bytes += len(text)
        return proc.Output(text)


def slurm_calls(n: int) -> dict[str, Any]:
    """Slurm commands per look of `submit --wait` at a job of N / 8 nodes: while it runs, once it failed."""
    from hpc_ddp.launch.slurm.follow import look
    from hpc_ddp.scheduler.slurm.client import SlurmClient

    found = {"ranks": n}
    for state in ("RUNNING", "FAILED"):
        cluster = _Cluster(max(1, n // NODE_RANKS), state)
        look(SlurmClient(runner=cluster), "1234", None, False)
        found[f"calls_{state.lower()}"] = cluster.calls
    return found
