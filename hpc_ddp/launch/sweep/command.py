"""`python -m hpc_ddp.submit ... --sweep NAME=V1,V2 [--sweep-file F]`: read, check, plan and start a sweep.

Everything is checked before anything starts or queues: the sweep's flags (hpc_ddp.launch.sweep.options), the
command as one run, every trial as the run it is (hpc_ddp.launch.sweep.trials), and every trial folder that
already holds a run (hpc_ddp.launch.sweep.state). Then one line per trial says what happens to it, the sweep's
record is written, and the trials to run start: here (hpc_ddp.launch.sweep.local) or as one Slurm job array.

The sweep's folder is --folder, else the default run folder of the command with `-sweep` after it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_ddp.errors import UsageError
from hpc_ddp.launch import options
from hpc_ddp.launch.sweep import spec, state, summary, trials
from hpc_ddp.launch.sweep.options import SweepArgs, without_folder
from hpc_ddp.launch.sweep.summary import most_serious
from hpc_ddp.run import configfile, taskspec
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import BUILTIN_TASKS


def sweep_folder(launch: options.LaunchOptions, cfg: trials.TrainConfig) -> Path:
    if cfg.folder:
        return Path(cfg.folder)
    if launch.slurm is not None:
        single = run_folder.default_for_submission(launch.slurm.job_name, cfg.task)
    else:
        single = run_folder.default_for_local_run(cfg.task)
    return single.with_name(single.name + "-sweep")


def prepare(
    args: SweepArgs, argv: Sequence[str], new_parser: Callable[[], argparse.ArgumentParser]
) -> tuple[options.LaunchOptions, Path, list[state.TrialPlan]]:
    """Every check, then the decision for each trial (UsageError at the first that is wrong)."""

    def read(words: list[str]) -> tuple[options.LaunchOptions, trials.TrainConfig]:
        return options.read(configfile.parse(trials.raising(new_parser()), words))

    launch, cfg = read(list(argv))
    if not launch.trains:
        raise UsageError(
            "--sweep trains: a sweep of --doctor runs checks nothing new. Fix: drop --doctor or --sweep"
        )
    folder = sweep_folder(launch, cfg)
    if launch.slurm is not None:
        folder = (
            folder.absolute()
        )  # the array's tasks run elsewhere: the same command resumes here from anywhere
    base = without_folder(argv)
    combos = spec.combine(args.axes, spec.from_file(args.file) if args.file is not None else None)
    found = trials.expand(combos, base, folder, new_parser(), read)
    for task in dict.fromkeys(t.cfg.task for t in found):  # as a single run's: its source read, never run
        taskspec.check(task, BUILTIN_TASKS, environment=_same_environment(launch))
    states = [state.read_state(t.folder) for t in found]
    for trial, now in zip(found, states, strict=True):
        if now.state != state.NEW:
            state.refuse_other_run(trial, trial.cfg)
    return launch, folder, state.plan(found, states, args.retry_failed)


def _same_environment(launch: options.LaunchOptions) -> bool:
    runtime = launch.slurm.request.runtime if launch.slurm is not None else None
    return runtime is None or not (runtime.python or runtime.setup or runtime.container)


def run(args: SweepArgs, argv: Sequence[str], new_parser: Callable[[], argparse.ArgumentParser]) -> int:
    """The sweep (see the module docstring); the exit code of its most serious trial."""
    launch, folder, decisions = prepare(args, argv, new_parser)
    for d in decisions:
        print(f"[sweep] trial {d.trial.name}: {d.why}", flush=True)
    to_run = [d.trial for d in decisions if d.action == state.RUN]
    reported = [summary.exit_code(d.state) for d in decisions if d.action == state.REPORT]
    if launch.local is None:
        from hpc_ddp.launch.sweep import array

        submitted, code = array.submit(launch, folder, decisions, args, without_folder(argv))
        if launch.slurm is None or not launch.slurm.wait or launch.slurm.print_sbatch:
            return most_serious([code, *reported])
        from hpc_ddp.launch.sweep import follow

        # Every trial's table, the ones submitted now followed to their ends first.
        if not submitted:
            return follow.report(decisions, print)
        return follow.follow(folder, decisions, submitted, settle=_settler(launch))
    run_folder.prepare(folder)
    state.write_record(folder, [d.trial for d in decisions], without_folder(argv))
    print(
        f"[sweep] {len(decisions)} trial(s) in {folder}: {len(to_run)} to run"
        f"{f', {args.parallel or 1} at a time' if to_run else ''}",
        flush=True,
    )
    from hpc_ddp.launch.sweep import local

    codes = local.run(to_run, args.parallel or 1, lambda line: print(line, flush=True))
    return most_serious([*codes.values(), *reported])


def _settler(launch: options.LaunchOptions) -> Callable[[trials.Trial, str], tuple[bool, list[str]]]:
    """For --wait: an element whose batch shell died, closed and acted on with its own trial's rules, as a single
    job's --wait does (hpc_ddp.launch.slurm.lost.settle_open)."""
    from hpc_ddp.launch import supervisor
    from hpc_ddp.launch.slurm import lost, submitter
    from hpc_ddp.ledger import outcomes
    from hpc_ddp.run.checkpoint.store import of_run

    client = submitter._client()

    def settle(trial: trials.Trial, job: str) -> tuple[bool, list[str]]:
        checkpoints = of_run(trial.folder, trial.cfg.checkpoint_storage)
        policy = submitter.policy(trial.cfg, launch.shape, checkpoints)
        settled, trouble = lost.settle_open(supervisor.Journal(checkpoints), client, job, policy)
        lines = [line for done in settled for line in (done.closed.line, *done.said)]
        again = bool(settled) and settled[-1].closed.decision.action == outcomes.REQUEUE
        return again, lines + ([trouble] if trouble else [])

    return settle
