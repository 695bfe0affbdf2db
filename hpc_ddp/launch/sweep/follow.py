"""`submit --sweep ... --wait`: follow every trial of a sweep's job arrays until each element has ended.

One poll asks Slurm twice for the whole sweep, whatever its size: one `squeue -r` for every element still queued
or running, one `sacct` for every element's runs (both by array id, which names all its elements). Following N
trials costs the cluster what following one job costs. Each change of an element's state is one line; at the
end, a table of every trial (hpc_ddp.launch.sweep.summary) from its own folder's records (what its supervisor
judged: the ledger, never a second judgement here), and the exit code of its most serious outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.launch.sweep import state, summary
from hpc_ddp.launch.sweep.trials import Trial

if TYPE_CHECKING:
    from hpc_ddp.scheduler.slurm.client import SlurmClient

POLL_S = 10.0
GONE_POLLS = (
    2  # an element neither queued nor accounted for this many polls in a row is over (accounting lags)
)


def arrays(ids: Sequence[str]) -> list[str]:
    """The job ids to ask about: each array's once (ARRAY_INDEX -> ARRAY), a plain job's as it is."""
    return list(dict.fromkeys(job.split("_")[0] for job in ids))


def follow(
    folder: Path,
    decisions: Sequence[state.TrialPlan],
    submitted: Sequence[tuple[Trial, str]],
    client: SlurmClient | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
    settle: Callable[[Trial, str], tuple[bool, list[str]]] | None = None,
) -> int:
    """Follow `submitted` (trial, element id) to their ends; then the table of every trial of `decisions`, and
    the exit code of the most serious (see the module docstring). `settle(trial, element)`: an element seen
    ended or pending again whose batch shell died (its node lost) is closed and acted on as a single job's
    `--wait` does (hpc_ddp.launch.slurm.lost.settle_open): requeued, it is followed again."""
    if client is None:
        from hpc_ddp.scheduler.slurm.client import SlurmClient

        client = SlurmClient()
    watched = {job: trial for trial, job in submitted}
    asked = arrays(list(watched))
    said: dict[str, str] = {}
    gone: dict[str, int] = {}
    say(
        f"[sweep] following {len(watched)} trial(s) in {folder} (Ctrl-C stops following; the jobs keep running)"
    )
    while True:
        queued = client.queue_elements(asked)
        accounted = client.histories(asked)
        if queued is None:  # squeue did not answer: nothing to conclude this time
            sleep(poll_s)
            continue
        for job, trial in watched.items():
            if job in queued:
                word = queued[job][0].state
                gone.pop(job, None)
            else:
                runs = (accounted or {}).get(job)
                word = runs.runs[-1].state if runs is not None and runs.runs else "ENDED"
                gone[job] = gone.get(job, 0) + 1
            if settle is not None and (job not in queued or queued[job][0].kind.waiting):
                again, lines = settle(trial, job)
                for line in lines:
                    say(f"[sweep] trial {trial.name} (job {job}): {line}")
                if again:  # requeued: it runs again, followed as before
                    gone.pop(job, None)
                    word = "REQUEUED"
            if said.get(job) != word:
                said[job] = word
                say(f"[sweep] trial {trial.name} (job {job}): {word}")
        if len(gone) == len(watched) and all(n >= GONE_POLLS for n in gone.values()):
            break
        sleep(poll_s)
    return report(decisions, say)


def report(decisions: Sequence[state.TrialPlan], say: Callable[[str], None]) -> int:
    """The table of every trial, from its folder as it is now; the exit code of the most serious."""
    rows, codes = [], []
    for d in decisions:
        now = state.read_state(d.trial.folder)
        rows.append(summary.row(d.trial.name, now, summary.read_losses(d.trial.folder)))
        codes.append(summary.exit_code(now))
    say(summary.table(rows))
    return summary.most_serious(codes)
