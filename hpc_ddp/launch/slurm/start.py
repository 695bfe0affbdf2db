"""`python -m hpc_ddp.launch.slurm.start -m MODULE [args]`: run MODULE as `python -m` would, with the preemption
signals (SIGUSR1, SIGUSR2, SIGTERM) blocked from this module's first instruction.

Why: Slurm's warning signal (`--signal=USR2@120`, `scancel --signal=USR2`) can reach a task while it starts,
before its handler exists (0.15-0.3 s of imports and unpickling). Their default action ends the process: the
task died "killed by SIGUSR2", its node was blamed, and two in a row stopped the job as a crash loop. Blocked,
a signal waits in the kernel, survives exec and unpickling, and is delivered to the kit's handler the moment
`hpc_ddp.run.loop.preemption.install` unblocks it (TaskEntry and `python -m hpc_ddp.train` call it first): a
preemption signal is never a crash.

The job `submit` builds runs its tasks as `python -u -m hpc_ddp.launch.slurm.start -u -m submitit.core._submit
<folder>` (submitit's `python` parameter). Only the interpreter's own start comes before this, and importing
hpc_ddp and hpc_ddp.launch, which import nothing.
"""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM))

import runpy  # noqa: E402  (after the block, on purpose)
import sys  # noqa: E402

USAGE = "usage: python -m hpc_ddp.launch.slurm.start [-u] -m MODULE [args...]"


def main(argv: list[str]) -> int:
    args = list(argv)
    while args and args[0] == "-u":  # the interpreter running this one is unbuffered already
        args.pop(0)
    if len(args) < 2 or args[0] != "-m":
        print(f"{USAGE}\npython -m hpc_ddp.launch.slurm.start: error: found {argv!r}", file=sys.stderr)
        return 2
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
