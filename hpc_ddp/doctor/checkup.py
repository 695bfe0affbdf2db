"""Pre-flight check of a distributed launch, run on every rank exactly where training would run.

    python -m hpc_ddp.doctor                                        # alone
    srun -N2 --ntasks-per-node=4 python -m hpc_ddp.doctor --folder /shared/runs/x
    torchrun --nproc-per-node 4 -m hpc_ddp.doctor
    python -m hpc_ddp.submit --local --doctor [--collective]        # 2 emulated nodes x 2 ranks here
    python -m hpc_ddp.submit --doctor --nodes 2 --gpus-per-node 4 ...   # as a Slurm job

Each rank derives what training would (`dist.env.detect`, `dist.placement`) and probes its host
(`doctor.facts`). Rank 0 checks that the master port is free *before* binding it, then hosts a TCPStore; every
rank posts its facts there, and rank 0 names the ranks that did not arrive within --join-timeout-s instead of
hanging. Rank 0 prints one table (what each rank derived) and one PASS / WARN / FAIL line per check
(`doctor.rules`) with its fix; `--collective` adds an all-reduce benchmark (`doctor.collective`). Exit code 1
on every rank when anything FAILed, 0 otherwise, 2 for bad flags. Training options are accepted (and --folder
used), so the launchers can hand the doctor the training's own command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_ddp import exitcodes
from hpc_ddp.cli import build_parser
from hpc_ddp.doctor import rules
from hpc_ddp.doctor.facts import RankFacts
from hpc_ddp.doctor.report import render, render_bench, render_checks
from hpc_ddp.doctor.rules import FAIL, WARN, Check
from hpc_ddp.errors import ClusterConfigError, UsageError
from hpc_ddp.run import configfile
from hpc_ddp.run.config import TrainConfig, add_train_arguments, from_namespace

PROG = "python -m hpc_ddp.doctor"
ACK_WAIT_S = 10.0  # how long rank 0 keeps its store up for the others to read the verdict


def build_argparser() -> argparse.ArgumentParser:
    parser = build_parser(PROG, __doc__ or "")
    group = parser.add_argument_group("doctor")
    group.add_argument(
        "--collective",
        action="store_true",
        help="also benchmark all-reduce over message sizes (bus bandwidth, outlier ranks) (default: off)",
    )
    group.add_argument(
        "--join-timeout-s",
        type=float,
        default=60.0,
        help="seconds to wait for every rank to reach the store (default: 60)",
    )
    configfile.add_argument(parser)
    add_train_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point, also called in-process inside Slurm jobs (`submit --doctor`); returns the exit code."""
    ns = configfile.parse(build_argparser(), sys.argv[1:] if argv is None else argv)
    if not ns.join_timeout_s > 0:
        raise UsageError(f"--join-timeout-s {ns.join_timeout_s}: must be positive, e.g. --join-timeout-s 60")
    return run(from_namespace(ns), os.environ, ns.collective, ns.join_timeout_s)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every step of one doctor run needs to know."""

    env: Any  # dist.env.DistEnv
    cfg: TrainConfig
    folder: Path
    store_host: str  # "rank0", or "agent": torchrun's agent hosts the store
    collective: bool
    timeout_s: float
    log: Any  # log.RankLog


def run(cfg: TrainConfig, environ: Mapping[str, str], collective: bool, join_timeout_s: float) -> int:
    """Derive, probe, meet the other ranks, judge; returns this rank's exit code (the same on every rank)."""
    from hpc_ddp.cluster.env import detect
    from hpc_ddp.doctor.facts import gather, missing_dirs, remove_marker, write_marker
    from hpc_ddp.log import RankLog
    from hpc_ddp.run.folder import default_for_task

    try:
        env = detect(environ)
    except ClusterConfigError as e:  # the doctor's finding, not a usage error: reported like any other FAIL
        reason, _, fix = str(e).partition(" Fix: ")
        print(render_checks([Check(FAIL, "launcher", reason, fix)]), flush=True)
        return exitcodes.FAILED
    # torchrun's agent already hosts a store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): rank 0 joins it as
    # a client like everyone else, and there is no port of ours to check.
    agent = env.launcher == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    job = _Run(
        env,
        cfg,
        Path(cfg.folder) if cfg.folder else default_for_task(env.job_id),
        "agent" if agent else "rank0",
        collective,
        join_timeout_s,
        RankLog(env.rank),
    )
    hosts_store = env.is_main and not agent
    facts = gather(
        env, job.folder, environ, job.store_host, hosts_store and env.master_port != 0, cfg.requeue_by
    )
    nonce, created = uuid.uuid4().hex, missing_dirs(job.folder) if env.is_main else []
    try:
        if env.is_main:
            facts = dataclasses.replace(facts, folder_error=write_marker(job.folder, nonce))
        return _rendezvous(job, facts, nonce, environ)
    finally:
        if env.is_main:
            remove_marker(job.folder, nonce, created)


def _rendezvous(job: _Run, facts: RankFacts, nonce: str, environ: Mapping[str, str]) -> int:
    """Open the store (or say alone why not), then lead (rank 0) or follow (everyone else)."""
    env = job.env
    if env.is_main and job.store_host == "rank0":
        blockers = rules.blocking(facts)
        if blockers:  # hosting the store would fail, or wait for ranks that look for it elsewhere
            others = f"; the other ranks give up after {job.timeout_s:g} s" if env.world_size > 1 else ""
            job.log.info(
                render(
                    env,
                    [facts],
                    rules.solo(facts)
                    + [Check(FAIL, "store", f"not started: rank 0 cannot host it (see above){others}")],
                )
            )
            return exitcodes.FAILED
    try:
        store, where = _open_store(job, environ)
    except _Unreachable as e:
        job.log.info(render(env, [facts], rules.solo(facts) + [Check(FAIL, "store", str(e), e.fix)]))
        return exitcodes.FAILED
    return _lead(job, store, where, facts, nonce) if env.is_main else _follow(job, store, facts)


class _Unreachable(Exception):
    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.fix = fix


def _wait_for_listener(addr: str, port: int, timeout_s: float) -> str:
    """Connect until rank 0 listens: '' or the last error. Ours, not TCPStore's retry loop, which prints a
    C++ stack per failed try and ends in an error that names no rank."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=min(5.0, timeout_s)).close()
            return ""
        except OSError as e:
            error = e.strerror or str(e) or type(e).__name__
        if time.monotonic() >= deadline:
            return error
        time.sleep(0.2)


def _open_store(job: _Run, environ: Mapping[str, str]) -> tuple[Any, str]:
    """(store, 'addr:port'): rank 0 (or torchrun's agent) hosts it; the others connect within the timeout."""
    import torch.distributed as dist

    env = job.env
    keep = timedelta(seconds=2 * job.timeout_s + 120)  # later gets wait out rank 0's collection and benchmark
    where = f"{env.master_addr}:{env.master_port}"
    fix = (
        f"read rank 0's output: it names its own FAIL. If there is none, rank 0 never started, or "
        f"MASTER_ADDR {env.master_addr} leads elsewhere from here (loopback, another host, a firewall)"
    )
    if job.store_host == "agent":
        fix = "torchrun's agent store is gone: did torchrun fail? Check its output"
    try:
        if env.is_main and job.store_host == "rank0":
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=keep,
            )
        else:
            error = _wait_for_listener(env.master_addr, env.master_port, job.timeout_s)
            if error:
                raise _Unreachable(
                    f"rank {env.rank} could not reach the store at {where} within "
                    f"{job.timeout_s:g} s ({error})",
                    fix,
                )
            store = dist.TCPStore(env.master_addr, env.master_port, None, is_master=False, timeout=keep)
    except (RuntimeError, OSError) as e:
        raise _Unreachable(
            f"rank {env.rank} could not open the store at {where} ({str(e).splitlines()[0]})", fix
        ) from None
    # Apart from torch's own keys, and from an earlier torchrun round's (the agent's store outlives a round).
    prefix = f"hpc_ddp/doctor/{env.restart}"
    return dist.PrefixStore(prefix, store), f"{env.master_addr}:{store.port}"


def _collect(store: Any, world_size: int, timeout_s: float) -> tuple[dict[int, RankFacts], float]:
    """Rank 0: every rank's facts that arrive within timeout_s (the missing are named, not waited for)."""
    start, found = time.monotonic(), {}
    waiting = set(range(1, world_size))
    while waiting and time.monotonic() - start < timeout_s:
        for r in [r for r in sorted(waiting) if store.check([f"facts/{r}"])]:
            found[r] = RankFacts.from_json(store.get(f"facts/{r}"))
            waiting.discard(r)
        time.sleep(0.05)
    return found, time.monotonic() - start


def _lead(job: _Run, store: Any, where: str, facts: RankFacts, nonce: str) -> int:
    """Rank 0: hand out the nonce, collect facts, judge, benchmark, print, and release the others."""
    env = job.env
    store.set("nonce", "" if facts.folder_error else nonce)
    others, waited = _collect(store, env.world_size, job.timeout_s)
    present = [facts] + [others[r] for r in sorted(others)]
    results = [rules.store_reached(env.world_size, [f.rank for f in present], where, job.timeout_s, waited)]
    results += rules.evaluate(present)
    go = job.collective and not any(c.status == FAIL for c in results)
    store.set("plan", "collective" if go else "skip")
    bench: list[str] = []
    if go:
        check, bench = _collective(job, store, facts, present)
        results.append(check)
    elif job.collective:
        results.append(Check(WARN, "collective", "skipped: fix the FAILs above first"))
    code = exitcodes.FAILED if any(c.status == FAIL for c in results) else exitcodes.OK
    job.log.info(render(env, present, results, bench))
    store.set("verdict", str(code))
    deadline = time.monotonic() + ACK_WAIT_S  # the store dies with rank 0: let the others read the verdict
    while store.add("acks", 0) < len(present) - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return code


def _collective(
    job: _Run, store: Any, facts: RankFacts, present: Sequence[RankFacts]
) -> tuple[Check, list[str]]:
    """Rank 0: run the benchmark with everyone, gather their times through the store, judge them."""
    from hpc_ddp.doctor import collective

    world = job.env.world_size
    runs = {0: _benchmark(job, store)}
    runs.update({r: json.loads(store.get(f"bench/{r}")) for r in range(1, world)})
    broken = {r: one["error"] for r, one in runs.items() if one.get("error")}
    if broken:
        first = min(broken)
        return Check(
            FAIL,
            "collective",
            f"the all-reduce failed on rank {rules.ranks_text(list(broken))} (rank {first}: {broken[first]})",
            "read those ranks' output",
        ), []
    times = {r: {int(size): t for size, t in one["times"].items()} for r, one in runs.items()}
    correct = {r: one["correct"] for r, one in runs.items()}
    check = collective.verdict(times, correct, {f.rank: f.host for f in present}, world)
    return check, render_bench(times, world, runs[0]["backend"])


def _follow(job: _Run, store: Any, facts: RankFacts) -> int:
    """Every other rank: check the folder against rank 0's marker, post facts, benchmark if told, obey."""
    from hpc_ddp.doctor.facts import read_marker, write_probe

    rank = job.env.rank
    try:
        nonce = store.get("nonce").decode()
        facts = dataclasses.replace(
            facts,
            folder_error=write_probe(job.folder, rank, nonce or uuid.uuid4().hex),
            folder_marker=read_marker(job.folder, nonce) if nonce else "rank 0 could not write it",
        )
        store.set(f"facts/{rank}", facts.to_json())
        if store.get("plan").decode() == "collective":
            store.set(f"bench/{rank}", json.dumps(_benchmark(job, store)))
        code = int(store.get("verdict").decode())
        store.add("acks", 1)
    except (RuntimeError, OSError) as e:  # rank 0 died or was killed, and its store with it
        job.log.info(f"doctor: FAIL: lost rank 0's store ({str(e).splitlines()[0]}); see rank 0's output")
        return exitcodes.FAILED
    if code != exitcodes.OK:  # silent otherwise: under srun, all ranks' lines share one output
        job.log.info("doctor: FAIL (rank 0 prints the table)")
    return code


def _benchmark(job: _Run, store: Any) -> dict[str, Any]:
    """Join a process group through the doctor's store and time all-reduces, placed as training would be."""
    import torch.distributed as dist

    from hpc_ddp.cluster import group, placement
    from hpc_ddp.doctor import collective

    env = job.env
    backend = job.cfg.backend
    try:
        device, _ = placement.place(env.local_rank, env.local_world_size, os.environ)
        # A process group of its own would bind a second store on MASTER_PORT, which the doctor's store holds:
        # it joins through the doctor's store (under a prefix of its own) instead, with training's backend
        # rule, timeout, hang watch and teardown. The benchmark itself runs under the hang watch too.
        with group.process_group(
            env, device, job.cfg.backend or None, job.timeout_s, store=dist.PrefixStore("pg", store)
        ) as backend:
            with group.hang_watch(job.timeout_s):
                times, correct = collective.run(device, env.rank, env.world_size)
    except (RuntimeError, ValueError) as e:  # a peer died mid-benchmark, NCCL refused: a finding, not a crash
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return {"times": {}, "correct": False, "backend": backend, "error": first}
    return {"times": {str(s): t for s, t in times.items()}, "correct": correct, "backend": backend}
