"""The batch shell's two steps around `srun`: `begin` before it, `end` after it. Both kit jobs run them
(`slurm/ddp.sbatch`, and the job `submit` builds, as submitit's setup and teardown lines):

    python -m hpc_ddp.launch.slurm.batch begin -- <training options>
    srun ... python -m hpc_ddp.train <training options>
    python -m hpc_ddp.launch.slurm.batch end --status $? -- <training options>

Why the batch shell: it is the one process of the job that outlives every task, so the decision about an
attempt runs even when every task died (a node lost, a rank SIGKILLed, a hang verdict). The kit's jobs run with
`--no-kill` (hpc_ddp.scheduler.slurm.request), so it outlives the loss of any node but its own: Slurm removes the
failed node, srun ends the step. `end` reads what the attempt left (the ranks' exit notes, hang.json,
preempted.json, srun's "task N: Killed" and "Node failure on node2" lines, srun's refusal of an option,
Slurm's view of the job and its nodes, whether the run folder can be written), judges the first cause
(hpc_ddp.ledger.judge, through hpc_ddp.launch.supervisor), decides once (hpc_ddp.ledger.decision, with the
allocation's facts: the spares, the usable nodes left, --min-nodes), appends the attempt's end to
attempts.jsonl, and acts:

- finished: exit 0. A preemption the ranks agreed to requeue: `scontrol requeue` (the tasks run with
  HPC_DDP_BATCH set, so they leave the requeue to this shell).
- a failure within --max-restarts, not a crash loop: requeue from the latest checkpoint. When the failure
  points at a node, the requeued job excludes every node blamed so far. Slurm 22.05 refuses ExcNodeList on a
  running job, so: `scontrol requeuehold` (the job pends, held), `scontrol update ExcNodeList=...`,
  `scontrol release`, with SIGTERM blocked meanwhile (the requeue ends this very shell). If the job no longer
  fits on the partition's usable nodes, it stops instead of pending forever; with --min-nodes M, it goes on
  with the usable nodes left while there are at least M (the same update lowers its node and task counts:
  a smaller world size, which the tasks' sharded checkpoint reshards, --allow-resize); with --wait-for-nodes
  it is requeued all the same, to pend until enough nodes are back.
- otherwise: stop, with the first error's traceback once and the attempts so far. Its exit ends the job;
  one Slurm requeued itself meanwhile is cancelled.

This is the one place a job's attempt is decided while it runs; a restart in the allocation (--spare-nodes: a
new srun on the nodes left, hpc_ddp.launch.slurm.inplace) is one more action of `end`, on the same decision.

    job          the job, read once from the environment and the tasks' options (`Job`), and batch.json
    batch_begin  `begin`: the folder's checks, the attempts left open, the first step's nodes
    batch_end    `end`: what the step left, the allocation's facts, and the action on the decision
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from hpc_ddp.cli import build_parser
from hpc_ddp.errors import run_main
from hpc_ddp.launch.slurm.batch_begin import after_this_job as after_this_job
from hpc_ddp.launch.slurm.batch_begin import begin as begin
from hpc_ddp.launch.slurm.batch_begin import taken_over as taken_over
from hpc_ddp.launch.slurm.batch_end import end as end
from hpc_ddp.launch.slurm.batch_end import slurm_requeued as slurm_requeued
from hpc_ddp.launch.slurm.job import PROG
from hpc_ddp.launch.slurm.job import job_size as job_size
from hpc_ddp.scheduler.slurm.client import SlurmClient


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is the tasks' training options, parsed by the training parser (job.Job.read).
    own, train = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    parser = build_parser(PROG, __doc__ or "")
    parser.add_argument("step", choices=("begin", "end"), help="before srun (begin) or after it (end)")
    parser.add_argument("--status", type=int, default=0, help="srun's exit status (end)")
    parser.add_argument("--log", default="", help='a file that holds srun\'s own lines ("task N: Killed")')
    parser.epilog = "then: -- <training options of the tasks>"
    ns = parser.parse_args(own)
    client = SlurmClient()
    if ns.step == "begin":
        return begin(train, ns.log, environ, client)
    return end(train, ns.status, ns.log, environ, client)


def cli() -> NoReturn:
    run_main(PROG, main)


if __name__ == "__main__":
    cli()
