"""Where a run's allocation went, in one HTML file: loss, throughput, per-rank step times, evaluations,
attempts, goodput.

    python -m hpc_ddp.report runs/local-12345                  # writes runs/local-12345/report.html
    python -m hpc_ddp.report /shared/runs/exp1 --out exp1.html  # and the PNGs beside it

It reads the run folder's metrics.jsonl and attempts.jsonl (and Slurm's accounting, when sacct answers, for
the queue waits between attempts), on a finished, running or failed run, and prints one line: the path, the
state, the attempts, the steps, the final loss and the goodput. Every plot is inline in the page (it opens
from a laptop without a server); the same plots are written as PNG files beside it.

Goodput = productive training time / allocated time (seconds). Allocated: each attempt's process start to its
end, summed. Productive: its first step to its last kept step, minus checkpoint stalls. Lost: steps trained
after the last checkpoint of an attempt that failed or was preempted, which the next attempt replays. The
checkpoint interval that maximises goodput for the failures seen is Young/Daly's tau = sqrt(2 x C x M): C the
mean checkpoint stall (s), M the mean time between failures (allocated s / failures).

`timeline` computes every number from the records (pure), `sources` reads the files, `plots` draws the PNGs
(matplotlib, an optional extra: pip install 'hpc-ddp[report]'), `page` writes the HTML.
"""

from __future__ import annotations

PROG = "python -m hpc_ddp.report"
