"""Sweeps (issue 44), the pure core: --sweep and --sweep-file read into trials, each checked as the run it is and
named; where each trial stands and what the same command again does with it; the sweep's record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hpc_ddp import exitcodes
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.sweep import command, spec, state
from hpc_ddp.launch.sweep.options import SweepArgs, split, without_folder
from hpc_ddp.ledger import outcomes
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.submit import build_argparser

BASE = ["--local", "--nodes", "2", "--tasks-per-node", "1", "--epochs", "1"]


def prepare(tmp_path: Path, *axes: str, file: str | None = None, retry: bool = False, base: list[str] = BASE):
    args = SweepArgs(tuple(axes), file, None, retry)
    return command.prepare(args, [*base, "--folder", str(tmp_path / "sweep")], build_argparser)


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("1,2,3", ["1", "2", "3"]),
        ("[64,128],[32]", ["[64,128]", "[32]"]),
        ('"a,b",c', ['"a,b"', "c"]),
        (" 0.1 , 0.2 ", ["0.1", "0.2"]),
        ("x", ["x"]),
    ],
)
def test_values_split_at_commas_outside_brackets_and_quotes(text: str, values: list[str]) -> None:
    assert spec.split_values(text) == values


def test_the_grid_is_every_combination_the_first_option_slowest() -> None:
    assert spec.grid(["lr=0.1,0.2", "seed=3,4"]) == [
        {"lr": "0.1", "seed": "3"},
        {"lr": "0.1", "seed": "4"},
        {"lr": "0.2", "seed": "3"},
        {"lr": "0.2", "seed": "4"},
    ]
    assert spec.grid([]) == [{}]


def test_a_sweep_file_is_a_list_of_trial_tables_crossed_with_the_grid() -> None:
    table = {
        "trial": [{"lr": 0.01, "amp": "bf16", "task-args": {"depth": 4}}, {"lr": 0.02, "deterministic": True}]
    }
    trials = spec.from_table(table, "t.toml")
    assert trials == [
        {"lr": "0.01", "amp": "bf16", "task-args.depth": "4"},
        {"lr": "0.02", "deterministic": "true"},
    ]
    assert spec.combine(["seed=1,2"], trials)[:2] == [{**trials[0], "seed": "1"}, {**trials[0], "seed": "2"}]


@pytest.mark.parametrize(
    ("axes", "table", "says"),
    [
        (["lr"], None, "--sweep 'lr': expected NAME=V1,V2"),
        (["=1,2"], None, "expected NAME=V1,V2"),
        (["lr="], None, "an empty value"),
        (["lr=0.1,,0.2"], None, "an empty value"),
        (["lr=0.1,"], None, "an empty value"),
        (
            ["lr=0.1", "lr=0.2"],
            None,
            "--sweep lr=... is given twice; expected one --sweep per option. Fix: list",
        ),
        ([], {"trial": []}, "expected a list of trials, each a [[trial]] table of options (found no trial)"),
        ([], {"trials": [{"lr": 1}]}, "(found trials)"),
        ([], {"trial": [{}]}, "trial 1 is empty or no table"),
        ([], {"trial": [{"lr": {"a": 1}}]}, "trial 1: lr = {'a': 1}: expected a non-empty string"),
        ([], {"trial": [{"name": ""}]}, "trial 1: name = '': expected a non-empty string"),
        (["lr=1"], {"trial": [{"lr": 2}]}, "lr is varied by both --sweep and --sweep-file (trial 1)"),
    ],
)
def test_a_malformed_sweep_is_one_line(axes: list[str], table: dict | None, says: str) -> None:
    with pytest.raises(UsageError) as e:
        spec.combine(axes, spec.from_table(table, "t.toml") if table is not None else None)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("axes", "says"),
    [
        (["lx=0.1"], "--sweep lx=...: no option --lx"),
        (["batch-sise=1,2"], "no option --batch-sise; did you mean batch-size?"),
        (
            ["nodes=1,2"],
            "--nodes cannot vary within one sweep (it shapes the job, and one job array has one shape",
        ),
        (["partition=a,b"], "--partition cannot vary within one sweep"),
        (["local=true"], "--local cannot vary within one sweep"),
        (
            ["folder=a,b"],
            "--folder cannot vary within one sweep (every trial's folder is <sweep folder>/<its name>)",
        ),
        (["spare-nodes=0,1"], "--spare-nodes cannot vary within one sweep (the allocation"),
        (["task-arg=a=1"], "set task settings as task-args.KEY=V1,V2"),
        (["lr=abc"], "--sweep trial lr=abc: argument --lr: invalid float value: 'abc'"),
        (["batch-size=8,0"], "--sweep trial batch-size=0: --batch-size 0: must be at least 1"),
        (["amp=none,maybe"], "--sweep trial amp=maybe: argument --amp: invalid choice: 'maybe'"),
        (
            ["deterministic=yes"],
            "--sweep deterministic=yes: --deterministic is a flag; expected true or false",
        ),
        (
            ["lr=0.01,1e-2"],
            "--sweep trial lr=1e-2: the same run as trial lr=0.01; expected every trial to differ",
        ),
        (["lr=0.01,0.01"], "the same run as trial lr=0.01"),
        (["task-args.k,=1"], "--sweep trial task-args.k,=1"),
    ],
)
def test_a_trial_the_run_refuses_is_refused_by_the_sweep_in_one_line(
    tmp_path: Path, axes: list[str], says: str
) -> None:
    with pytest.raises(UsageError) as e:
        prepare(tmp_path, *axes)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "sweep").exists()  # nothing written, nothing started


def test_trials_are_named_by_their_resolved_values_keys_sorted(tmp_path: Path) -> None:
    _, folder, decisions = prepare(tmp_path, "seed=4,3", "lr=2e-2", "task-args.depth=8", "deterministic=true")
    names = [d.trial.name for d in decisions]
    assert names == ["depth=8,deterministic=true,lr=0.02,seed=4", "depth=8,deterministic=true,lr=0.02,seed=3"]
    trial = decisions[0].trial
    assert trial.folder == folder / names[0] and trial.cfg.folder == str(trial.folder)
    assert trial.cfg.lr == 0.02 and trial.cfg.seed == 4 and trial.cfg.task_args["depth"] == 8
    assert trial.argv[-1] == f"--folder={trial.folder}" and "--folder" not in trial.argv[:-1]
    assert all(d.action == state.RUN and d.state.state == state.NEW for d in decisions)


def test_a_name_that_is_no_safe_file_name_is_made_one(tmp_path: Path) -> None:
    _, _, decisions = prepare(tmp_path, "task-args.sizes=[64, 128]", "task-args.name=a/b")
    assert decisions[0].trial.name == "name=a_b,sizes=_64,_128_"
    _, _, long = prepare(tmp_path, "task-args.name=" + "x" * 300)
    assert len(long[0].trial.name) == 200


def attempt(outcome: str, decision: str, reason: str = "", restart: int = 0, job: str = "1") -> Attempt:
    return Attempt(job, restart, outcome=outcome, decision=decision, reason=reason, ended=1.0, step=7)


@pytest.mark.parametrize(
    ("history", "started", "expected"),
    [
        ([], False, state.NEW),
        ([], True, state.UNFINISHED),
        ([attempt(outcomes.COMPLETED, outcomes.DONE)], True, state.FINISHED),
        ([attempt(outcomes.PREEMPTED, outcomes.REQUEUE)], True, state.UNFINISHED),
        ([attempt(outcomes.PREEMPTED, outcomes.STOP)], True, state.UNFINISHED),
        ([attempt(outcomes.STOPPED, outcomes.STOP)], True, state.UNFINISHED),
        ([attempt(outcomes.RUNNING, "")], True, state.UNFINISHED),
        ([attempt(outcomes.FAILED, outcomes.RESTART)], True, state.UNFINISHED),
        ([attempt(outcomes.FAILED, outcomes.STOP)], True, state.FAILED),
        ([attempt(outcomes.NONFINITE, outcomes.STOP)], True, state.FAILED),
        ([attempt(outcomes.USAGE, outcomes.STOP)], True, state.FAILED),
        (
            [
                attempt(outcomes.FAILED, outcomes.RESTART),
                attempt(outcomes.COMPLETED, outcomes.DONE, restart=1),
            ],
            True,
            state.FINISHED,
        ),
    ],
)
def test_a_trials_state_is_read_from_its_attempts(
    history: list[Attempt], started: bool, expected: str
) -> None:
    assert state.state_of(history, started).state == expected


def test_a_failed_trial_names_its_first_cause_and_counts_its_failures() -> None:
    history = [
        attempt(outcomes.NODE_FAIL, outcomes.RESTART, "node n2 failed"),
        attempt(outcomes.FAILED, outcomes.STOP, "rank 1: ValueError", restart=1),
    ]
    found = state.state_of(history, True)
    assert (found.state, found.failures, found.attempts, found.cause) == (
        state.FAILED,
        2,
        2,
        "node n2 failed",
    )


def failed(*attempts: Attempt) -> state.TrialState:
    """A failed trial's state, read from its folder's attempts as the sweep reads it (state_of)."""
    found = state.state_of(list(attempts), True)
    assert found.state == state.FAILED
    return found


ERROR = "rank 0: ValueError: bad batch"  # the same error twice, no newer checkpoint between: a crash loop


def with_signature(a: Attempt, signature: str) -> Attempt:
    return dataclasses.replace(a, signature=signature)


@pytest.mark.parametrize(
    ("now", "max_restarts", "retry", "action", "why"),
    [
        (state.TrialState(state.NEW), 0, False, state.RUN, "new"),
        (state.TrialState(state.FINISHED), 0, True, state.SKIP, "finished"),
        (state.TrialState(state.UNFINISHED), 0, False, state.RUN, "resumes from its latest checkpoint"),
        (
            failed(attempt(outcomes.NODE_FAIL, outcomes.STOP)),
            1,
            False,
            state.RUN,
            "rerun within --max-restarts 1",
        ),
        (
            failed(
                attempt(outcomes.FAILED, outcomes.RESTART, "boom"),
                attempt(outcomes.FAILED, outcomes.STOP, "bang", restart=1),
            ),
            1,
            False,
            state.REPORT,
            "failed (failed: boom)",
        ),
        (failed(attempt(outcomes.NONFINITE, outcomes.STOP)), 3, False, state.REPORT, "--sweep-retry-failed"),
        (failed(attempt(outcomes.USAGE, outcomes.STOP)), 3, False, state.REPORT, "not rerun"),
        (
            # Within --max-restarts 5, but the same error twice with no newer checkpoint: the ledger's crash
            # loop, which no other start cures (the rule the sweep once restated did not know it).
            failed(
                with_signature(attempt(outcomes.FAILED, outcomes.RESTART, ERROR), ERROR),
                with_signature(attempt(outcomes.FAILED, outcomes.STOP, ERROR, restart=1), ERROR),
            ),
            5,
            False,
            state.REPORT,
            "not rerun",
        ),
        (
            failed(*(attempt(outcomes.NONFINITE, outcomes.STOP, restart=k) for k in range(9))),
            0,
            True,
            state.RUN,
            "(--sweep-retry-failed)",
        ),
    ],
)
def test_what_the_same_command_again_does_with_a_trial(
    tmp_path: Path, now: state.TrialState, max_restarts: int, retry: bool, action: str, why: str
) -> None:
    _, _, decisions = prepare(tmp_path, "lr=0.1")
    decided = state.decide(decisions[0].trial, now, max_restarts, retry)
    assert decided.action == action and why in decided.why


def test_a_trial_folder_holding_another_run_is_refused(tmp_path: Path) -> None:
    _, folder, decisions = prepare(tmp_path, "lr=0.1")
    trial = decisions[0].trial
    trial.folder.mkdir(parents=True)
    saved = {**trial.cfg.as_dict(), "seed": 7}
    (trial.folder / "run.json").write_text(json.dumps({"config": saved}))
    with pytest.raises(
        UsageError, match=r"trial folder .*lr=0.1 holds another run, started with --seed 7 \(now 0\)"
    ):
        prepare(tmp_path, "lr=0.1")
    (trial.folder / "run.json").write_text(json.dumps({"config": trial.cfg.as_dict()}))
    assert prepare(tmp_path, "lr=0.1")[2][0].state.state == state.UNFINISHED  # the same run: resumed


def test_the_record_keeps_every_trial_it_had_and_appends_new_ones(tmp_path: Path) -> None:
    _, folder, first = prepare(tmp_path, "lr=0.1,0.2")
    folder.mkdir(parents=True)
    state.write_record(folder, [d.trial for d in first], BASE)
    _, _, second = prepare(tmp_path, "lr=0.3,0.1")
    state.write_record(folder, [d.trial for d in second], BASE)
    recorded = state.read_record(folder)
    assert [t["name"] for t in recorded["trials"]] == ["lr=0.1", "lr=0.2", "lr=0.3"]
    assert recorded["trials"][2]["values"] == {"lr": "0.3"} and recorded["command"] == BASE


def test_the_sweeps_flags_come_out_of_the_command_line() -> None:
    args, rest = split(
        [
            "--local",
            "--sweep",
            "lr=1,2",
            "--sweep=seed=3",
            "--sweep-parallel",
            "2",
            "--sweep-retry-failed",
            "--sweep-file=t.toml",
            "--epochs",
            "1",
            "--",
            "--sweep",
            "x",
        ]
    )
    assert args == SweepArgs(("lr=1,2", "seed=3"), "t.toml", 2, True)
    assert rest == ["--local", "--epochs", "1", "--", "--sweep", "x"]
    assert without_folder(["--folder", "a", "--x", "--folder=b", "--y"]) == ["--x", "--y"]
    for bad in (["--sweep-parallel", "0"], ["--sweep-parallel", "x"], ["--sweep"]):
        with pytest.raises(UsageError):
            split(bad)


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([], exitcodes.OK),
        ([0, 0], exitcodes.OK),
        ([0, exitcodes.PREEMPTED], exitcodes.PREEMPTED),
        ([exitcodes.NONFINITE, exitcodes.PREEMPTED, 0], exitcodes.NONFINITE),
        ([exitcodes.HANG, exitcodes.FAILED], exitcodes.FAILED),
        ([137, 0], exitcodes.FAILED),
        ([exitcodes.USAGE, exitcodes.FAILED], exitcodes.USAGE),
    ],
)
def test_a_sweep_exits_with_its_most_serious_trials_code(codes: list[int], expected: int) -> None:
    assert command.most_serious(codes) == expected


def test_a_doctor_sweep_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--sweep trains"):
        prepare(tmp_path, "lr=0.1", base=[*BASE, "--doctor"])
