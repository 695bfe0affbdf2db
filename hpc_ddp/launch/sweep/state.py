"""Where each trial of a sweep stands, and which to (re)run: the same command again runs only what did not finish.

A trial's state is read from its own folder, as a single run's is (pure but for reading it):

    new         no folder, or nothing recorded in it yet              run it
    finished    an attempt ended the run (decision "done")            never again
    unfinished  stopped, preempted, or its job may still run          resume it (on Slurm: unless still queued)
    failed      its last attempt stopped it with a failure            rerun while a restart may cure it and the
                                                                      failures stay within --max-restarts;
                                                                      else reported (--sweep-retry-failed: rerun)

A trial folder that holds another run (other MUST_MATCH options) is refused as a single run's folder is
(hpc_ddp.launch.rerun): the sweep's options changed under it.

The sweep's own record, `<sweep folder>/sweep.json`, lists every trial it has ever had (a value added later
appends its trials), with the command's options: what the report and `--wait` read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.launch.sweep.trials import Trial
from hpc_ddp.ledger import attempts as attempt_records
from hpc_ddp.ledger import decision, outcomes
from hpc_ddp.ledger.files import atomic_write_bytes
from hpc_ddp.run import folder as run_folder
from hpc_ddp.run.config import TrainConfig, differences
from hpc_ddp.run.records import record

RECORD = run_folder.SWEEP_RECORD
NEW, FINISHED, UNFINISHED, FAILED = "new", "finished", "unfinished", "failed"
RUN, SKIP, REPORT = "run", "skip", "report"


@dataclass(frozen=True)
class TrialState:
    state: str
    attempts: int = 0
    failures: int = 0  # attempts that ended in a failure (FAILURES), every job of the folder
    outcome: str = ""  # the last attempt's
    cause: str = ""  # the first failure's reason, as its supervisor said it
    step: int | None = None
    history: tuple[
        attempt_records.Attempt, ...
    ] = ()  # every attempt of the folder, in order: the ledger's input


@dataclass(frozen=True)
class TrialPlan:
    """What the sweep does with one trial now: run it (new, or resumed from its checkpoint), skip it (finished),
    or report it (failed past its budget). Not an attempt's decision: inside a trial, what follows each attempt
    is the ledger's one decision (hpc_ddp.ledger.decision), as for any run."""

    trial: Trial
    state: TrialState
    action: str  # RUN, SKIP or REPORT
    why: str


def state_of(history: Sequence[attempt_records.Attempt], started: bool) -> TrialState:
    """A trial's state from its folder's attempts (pure; `started`: the folder holds a run record)."""
    if not history:
        return TrialState(UNFINISHED if started else NEW)
    last = history[-1]
    failed = [a for a in history if a.failed or a.outcome == outcomes.NONFINITE]
    cause = failed[0].reason if failed else ""
    common = dict(
        attempts=len(history),
        failures=len(failed),
        outcome=last.outcome,
        cause=cause,
        step=last.step,
        history=tuple(history),
    )
    if any(a.decision == outcomes.DONE for a in history):
        return TrialState(FINISHED, **common)  # type: ignore[arg-type]
    stopped = last.decision == outcomes.STOP
    if stopped and (last.failed or last.outcome in (outcomes.NONFINITE, outcomes.USAGE)):
        return TrialState(FAILED, **common)  # type: ignore[arg-type]
    return TrialState(UNFINISHED, **common)  # type: ignore[arg-type]


def read_state(folder: Path) -> TrialState:
    if not folder.is_dir():
        return TrialState(NEW)
    return state_of(attempt_records.read(folder), record.read_config(folder) is not None)


def decide(trial: Trial, state: TrialState, max_restarts: int, retry_failed: bool) -> TrialPlan:
    """What the sweep does with `trial` now (pure)."""
    if state.state == FINISHED:
        return TrialPlan(trial, state, SKIP, "finished")
    if state.state == NEW:
        return TrialPlan(trial, state, RUN, "new")
    if state.state == UNFINISHED:
        return TrialPlan(trial, state, RUN, "resumes from its latest checkpoint")
    if retry_failed:
        return TrialPlan(trial, state, RUN, "failed; rerun (--sweep-retry-failed)")
    # The ledger's one decision on every attempt of the folder, as any run's supervisor asks it: a failure that
    # another start may cure, within --max-restarts, and not a crash loop.
    budgets = decision.Budgets(max_restarts, 0, outcomes.REQUEUE)
    if (
        state.history
        and decision.decide(state.history[:-1], state.history[-1], budgets).action != outcomes.STOP
    ):
        return TrialPlan(
            trial, state, RUN, f"failed ({state.outcome}); rerun within --max-restarts {max_restarts}"
        )
    return TrialPlan(
        trial,
        state,
        REPORT,
        f"failed ({state.outcome}{': ' + state.cause if state.cause else ''}); not rerun (add "
        "--sweep-retry-failed to run it again)",
    )


def refuse_other_run(trial: Trial, cfg: TrainConfig) -> None:
    """A trial folder that holds another run is refused, as a single run's (see the module docstring)."""
    saved = record.read_config(trial.folder)
    diffs = differences(saved, cfg) if saved is not None else []
    if diffs:
        raise UsageError(
            f"trial folder {trial.folder} holds another run, started with {', '.join(diffs)}; a sweep resumes "
            "each trial in its folder, which needs the same values. Fix: a new --folder for this sweep, or the "
            "earlier values to resume that one"
        )


def plan(trials: Sequence[Trial], states: Sequence[TrialState], retry_failed: bool) -> list[TrialPlan]:
    """Each trial's decision, within its own --max-restarts (pure)."""
    return [decide(t, s, t.cfg.max_restarts, retry_failed) for t, s in zip(trials, states, strict=True)]


def read_record(folder: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def merged(old: dict[str, Any], trials: Sequence[Trial], base: Sequence[str]) -> dict[str, Any]:
    """The sweep's record with `trials` added: those it had first, in their order, then the new ones (pure)."""
    known = [t for t in old.get("trials", []) if isinstance(t, dict) and isinstance(t.get("name"), str)]
    names = {t["name"] for t in known}
    added = [{"name": t.name, "values": t.settings} for t in trials if t.name not in names]
    return {"version": 1, "command": list(base), "trials": known + added}


def write_record(folder: Path, trials: Sequence[Trial], base: Sequence[str]) -> None:
    text = json.dumps(merged(read_record(folder), trials, base), indent=1) + "\n"
    atomic_write_bytes(folder / RECORD, text.encode())
