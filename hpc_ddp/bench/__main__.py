"""`python -m hpc_ddp.bench`: measure the kit on this machine (the sections: `--help`, hpc_ddp.bench)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import hpc_ddp.bench
from hpc_ddp.bench.runs import MIN_TRIALS, steps_per_epoch
from hpc_ddp.bench.suite import OPTIONAL, PROG, SECTIONS, run
from hpc_ddp.cli import build_parser
from hpc_ddp.errors import UsageError, run_main


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser(PROG, hpc_ddp.bench.__doc__ or "")
    parser.add_argument(
        "sections",
        nargs="*",
        metavar="SECTION",
        help=f"sections to run: {', '.join(SECTIONS)} (default: all of these), {', '.join(OPTIONAL)} (by name only)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=MIN_TRIALS,
        help=f"interleaved trials per figure (default: {MIN_TRIALS}; checkpoint: 10x, watchdog: 2x)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="optimizer steps per throughput run; the first is warm-up (watchdog: steps of "
        "each variant per trial, after a warm-up block) (default: 60)",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks on this machine (default: 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default: 32)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one trial of 4 steps per figure: checks that the bench works (for tests)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every figure and trial as JSON here")
    parser.add_argument(
        "--folder",
        metavar="DIR",
        help="keep every run's folder and log in a new folder under DIR (default: a "
        "temporary folder, removed at the end); a run's checkpoints and model.pth are removed once its "
        "figures are read",
    )
    ns = parser.parse_args(argv)
    sections = list(dict.fromkeys(ns.sections)) or list(SECTIONS)
    unknown = [x for x in sections if x not in SECTIONS + OPTIONAL]
    if unknown:
        raise UsageError(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS + OPTIONAL)}")
    if ns.quick:
        ns.trials, ns.steps = 1, 4
    if ns.trials < 1 or ns.world_size < 1 or ns.batch_size < 1 or ns.steps < 2:
        raise UsageError("--trials, --world-size and --batch-size must be at least 1, and --steps at least 2")
    if ns.json and not Path(ns.json).resolve().parent.is_dir():
        raise UsageError(
            f"--json {ns.json}: folder {Path(ns.json).resolve().parent} does not exist. Fix: "
            "create it or write the JSON elsewhere"
        )
    per_epoch = steps_per_epoch(ns.world_size, ns.batch_size)
    if ns.steps > per_epoch:
        raise UsageError(
            f"--steps {ns.steps}: the mlp task has {per_epoch} steps per epoch at "
            f"{ns.world_size} ranks x batch {ns.batch_size}; the measured window must stay "
            f"inside the first epoch. Fix: --steps {per_epoch} or fewer"
        )
    return ns, sections


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["scale"]:  # its own options (hpc_ddp.bench.scale)
        from hpc_ddp.bench import scale

        return scale.main(args[1:])
    ns, sections = parse(argv)
    return run(
        sections,
        trials=ns.trials,
        steps=ns.steps,
        world_size=ns.world_size,
        batch_size=ns.batch_size,
        quick=ns.quick,
        json_path=ns.json,
        keep_in=ns.folder,
    )


if __name__ == "__main__":
    run_main(PROG, main)
