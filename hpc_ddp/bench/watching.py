"""The watchdog section: what the hang watch costs a training step, measured with it and without it.

    python -m hpc_ddp.bench.watching --world-size 2 --steps 60 --trials 10 --out result.json --folder DIR

One job of --world-size ranks on this machine (gloo, CPU, started with `torch.multiprocessing.spawn`, each
rank placed and pinned as the kit places it) holds two Trainers of the `mlp` task side by side, from the same
seed, one per variant:

  - `with`: the kit as it trains: a `Beacon`, the end-of-backward mark (an autograd callback; DDP keeps its
    built-in C++ all-reduce), the straggler check's rows in the step's packet every 5 steps (more than one
    rank), and a running `Watchdog` with --hang-timeout-s auto.
  - `without`: a `NullBeacon` (it records nothing; its rank is unwatched: no mark, no straggler check),
    no watchdog.

Both train through the kit's own loop, `Trainer.run()`, in blocks of 10 steps (two straggler windows) that
alternate between the variants, A B B A A B ...: each block resumes the loop where that Trainer's last block
ended, as a requeued run resumes mid-epoch. Blocks a few tenths of a second long keep a busy neighbour on a
shared machine from favouring either variant, which whole runs of seconds did not. A trial is --steps steps
of each variant; its figure for each is global samples/s over the wall-clock time of its blocks on rank 0.
One block of 3 steps of each comes first and is not counted (step 1: DDP builds its buckets). The per-step
time split's few additions are in both variants; the watchdog thread ticks once a second through both
variants' blocks (a tick costs microseconds). Each trial also gives rank 0's CPU time per step in each
variant (its whole process, every thread), which a busy neighbour disturbs much less than the throughput.
Rank 0 writes every trial's figures and the load average after each to `--out`. `watchdog_section` runs this
as one measured command of the bench.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.bench.runs import TASK, Runner, Settings, median, progress, ratios, run_cmd

VARIANTS = ("with", "without")
WARMUP_STEPS = 3
BLOCK_STEPS = 10  # two straggler windows


def watchdog_section(s: Settings) -> dict[str, Any]:
    """Both variants in one job of `s.world_size` ranks, interleaved; their samples/s and the median ratio."""
    runner = Runner(s)
    folder = runner.folder("watchdog")
    folder.mkdir(parents=True)
    out, log = folder / "result.json", folder / "output.log"
    trials = s.watch_trials
    progress(
        f"watchdog: {trials} trial(s) of the mlp task with and without the hang watch, interleaved, in "
        f"one {s.world_size}-rank job (log: {log})"
    )
    run_cmd(
        [
            sys.executable,
            "-m",
            "hpc_ddp.bench.watching",
            "--world-size",
            str(s.world_size),
            "--steps",
            str(s.steps),
            "--batch-size",
            str(s.batch_size),
            "--trials",
            str(trials),
            "--out",
            str(out),
            "--folder",
            str(folder / "runs"),
        ],
        log,
    )
    result = json.loads(out.read_text())
    rates = {v: [float(x) for x in result[v]] for v in VARIANTS}
    cpu = {v: [float(x) for x in result["cpu_ms_per_step"][v]] for v in VARIANTS}
    for trial, (a, b, load) in enumerate(zip(rates["with"], rates["without"], result["loads"], strict=True)):
        progress(
            f"trial {trial + 1}/{trials} watchdog: with {a:,.0f}, without {b:,.0f} samples/s, "
            f"{a / b if b else float('nan'):.3f}x; rank 0 CPU {cpu['with'][trial]:.1f} vs "
            f"{cpu['without'][trial]:.1f} ms/step (load {load:.1f})"
        )
    return {
        "ranks": s.world_size,
        "with_samples_per_s": median(rates["with"]),
        "without_samples_per_s": median(rates["without"]),
        "with_vs_without": median(ratios(rates["with"], rates["without"])),
        "trials": rates,
        "with_cpu_ms_per_step": median(cpu["with"]),
        "without_cpu_ms_per_step": median(cpu["without"]),
        "cpu_with_vs_without": median(ratios(cpu["with"], cpu["without"])),
        "cpu_trials": cpu,
        "measured": "global samples/s on rank 0 over the wall-clock time of each variant's blocks of "
        f"{BLOCK_STEPS} steps of Trainer.run(), the two variants' blocks alternating A B B A "
        "... in one job; --steps steps of each per trial, after one uncounted warm-up block "
        "each",
        "with": "Beacon, the end-of-backward mark, the straggler rows in the step's packet every 5 steps, a "
        "running Watchdog (--hang-timeout-s auto)",
        "without": "NullBeacon, no mark, no straggler check, no watchdog",
        "cpu": "rank 0's process CPU time (every thread) per step in each variant's blocks: steadier "
        "than throughput on a busy machine; a ratio above 1 is CPU the hang watch adds",
    }


# ----- the job: one process per rank ---------------------------------------------------------------------
def blocks(steps: int) -> list[int]:
    """A trial's `steps` steps per variant as the blocks that alternate with the other variant's (pure)."""
    return [BLOCK_STEPS] * (steps // BLOCK_STEPS) + ([steps % BLOCK_STEPS] if steps % BLOCK_STEPS else [])


def _trainers(env: Any, work: Path, args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Both variants' Trainers (each closed by `stack`), the same seed, model and data; the `with` one's
    Watchdog runs until `stack` closes, as the kit's session runs it (run/session.py)."""
    import torch

    from hpc_ddp.log import RankLog
    from hpc_ddp.run.checkpoint import store
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.loop.trainer import Trainer
    from hpc_ddp.run.tasks import build
    from hpc_ddp.run.watch.beacon import Beacon, NullBeacon
    from hpc_ddp.run.watch.watchdog import Identity, Watchdog

    quiet = RankLog(env.rank, stack.enter_context(open(os.devnull, "w")))  # an "Epoch" line per block
    trainers = {}
    for variant in VARIANTS:
        folder = work / variant
        folder.mkdir(parents=True, exist_ok=True)
        cfg = TrainConfig(
            task=TASK, batch_size=args.batch_size, epochs=10_000, save_every_epochs=0, folder=str(folder)
        )
        torch.manual_seed(cfg.seed)
        watched = variant == "with"
        # A NullBeacon's rank is unwatched: no end-of-backward mark, no straggler check (hpc_ddp.run.loop.clock).
        beacon = Beacon() if watched else NullBeacon()
        trainer = stack.enter_context(
            Trainer(
                cfg,
                env,
                torch.device("cpu"),
                build(cfg),
                quiet,
                store.of_run(folder, cfg.checkpoint_storage),
                beacon=beacon,
            )
        )
        if watched:
            who = Identity(env.rank, env.world_size, socket.gethostname(), tuple(trainer.peers), "bench")
            step_times = trainer.metrics.step_times  # the list the Recorder appends to
            stack.enter_context(
                Watchdog(
                    trainer.beacon,
                    who,
                    folder,
                    cfg.hang_setting(),
                    cfg.timeout_s,
                    lambda times=step_times: times[-100:],
                    RankLog(env.rank).info,
                )
            )
        trainers[variant] = trainer
    return trainers


def _block(trainer: Any, steps: int) -> tuple[float, float]:
    """`steps` more steps of `trainer.run()`, the loop as it trains (resumed where the last block ended, as a
    requeued run resumes); returns their wall-clock seconds and this process's CPU seconds (all threads)."""
    trainer.cfg = dataclasses.replace(trainer.cfg, max_steps=trainer.pos.step + steps)
    start, cpu = time.monotonic(), time.process_time()
    trainer.run()
    return time.monotonic() - start, time.process_time() - cpu


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One rank: join the group, build both variants, a warm-up block of each, then the trials."""
    from hpc_ddp.cluster import placement
    from hpc_ddp.cluster.env import DistEnv
    from hpc_ddp.cluster.group import process_group
    from hpc_ddp.run.config import TrainConfig

    device, _ = placement.place(rank, args.world_size, {}, cuda_count=0)
    env = DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=args.world_size,
        local_world_size=args.world_size,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=port,
        job_id=None,
        launcher="single",
    )
    samples = args.steps * args.batch_size * args.world_size  # per variant per trial
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}  # per step
    loads: list[float] = []
    turn = 0
    with process_group(env, device, "gloo", TrainConfig().timeout_s), contextlib.ExitStack() as stack:
        trainers = _trainers(env, Path(args.folder), args, stack)
        for variant in VARIANTS:  # step 1 (DDP builds its buckets) and the allocator's warm-up: not counted
            _block(trainers[variant], WARMUP_STEPS)
        for trial in range(args.trials):
            seconds, cpu = dict.fromkeys(VARIANTS, 0.0), dict.fromkeys(VARIANTS, 0.0)
            for steps in blocks(args.steps):
                for variant in VARIANTS if turn % 2 == 0 else VARIANTS[::-1]:  # A B B A A B ...
                    wall, used = _block(trainers[variant], steps)
                    seconds[variant] += wall
                    cpu[variant] += used
                turn += 1
            for variant in VARIANTS:
                rates[variant].append(samples / seconds[variant])
                cpu_ms[variant].append(1000 * cpu[variant] / args.steps)
            loads.append(os.getloadavg()[0])
            if rank == 0:
                progress(
                    f"trial {trial + 1}/{args.trials}: with {rates['with'][-1]:,.0f}, without "
                    f"{rates['without'][-1]:,.0f} samples/s (load {loads[-1]:.1f})"
                )
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    **rates,
                    "cpu_ms_per_step": cpu_ms,
                    "loads": loads,
                    "steps": args.steps,
                    "world_size": args.world_size,
                    "batch_size": args.batch_size,
                }
            )
            + "\n"
        )


def main(argv: list[str] | None = None) -> int:
    from hpc_ddp.bench.hand import free_port

    parser = argparse.ArgumentParser(
        prog="python -m hpc_ddp.bench.watching",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks on this machine (default: 2)")
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="optimizer steps of each variant per trial, at least 1 (default: 60)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default: 32)")
    parser.add_argument("--trials", type=int, default=10, help="trials (default: 10)")
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON result here")
    parser.add_argument("--folder", required=True, help="the two Trainers' run folders go here")
    args = parser.parse_args(argv)
    if min(args.steps, args.world_size, args.batch_size, args.trials) < 1:
        parser.error("--steps, --world-size, --batch-size and --trials must be at least 1")
    import torch.multiprocessing as mp

    started = time.monotonic()
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world_size, join=True)
    print(f"done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
