"""The one merge of attempts.jsonl as a table (hpc_ddp.ledger.attempts.merge, pure): start and end lines into
attempts, and the lines a kill tore or something else wrote, which the supervisors, `submit --wait`, the judge
and the report all read through it (issue 34: it was merged twice, and the ledger's merge raised on a line
without "event" or with a list of nodes of the wrong type, and kept a line without time or restart)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.ledger import attempts, outcomes
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.report.sources import read_run

pytestmark = pytest.mark.unit

START = {
    "event": "start",
    "job": "7",
    "restart": 0,
    "time": 10.0,
    "nodes": ["n1", "n2"],
    "ranks": ["n1", "n2"],
}
END = {
    "event": "end",
    "job": "7",
    "restart": 0,
    "time": 50.0,
    "outcome": "failed",
    "step": 45,
    "checkpoint": 20,
    "rank": 1,
    "node": "n2",
    "blamed": True,
    "reason": "RuntimeError: boom",
    "signature": "RuntimeError: boom",
    "decision": "restart",
    "exclude": ["n2"],
}


def line(base: dict[str, Any], **changed: Any) -> dict[str, Any]:
    """`base` with fields changed; a field given as ... is left out."""
    return {k: v for k, v in {**base, **changed}.items() if v is not ...}


def keys(merged: list[Attempt]) -> list[tuple[str, int, int]]:
    return [(a.job, a.restart, a.number) for a in merged]


# ----- whole records: merged by (job, restart), numbered in the order each first appears ---------------------


def test_a_start_and_its_end_are_one_attempt_with_every_field() -> None:
    (a,) = attempts.merge([START, END])
    assert a == Attempt(
        job="7",
        restart=0,
        number=1,
        started=10.0,
        ended=50.0,
        nodes=("n1", "n2"),
        ranks=("n1", "n2"),
        resumed_from=None,
        outcome="failed",
        step=45,
        checkpoint=20,
        rank=1,
        node="n2",
        blamed=True,
        reason="RuntimeError: boom",
        signature="RuntimeError: boom",
        decision="restart",
        exclude=("n2",),
    )
    assert (a.failed, a.lost_steps) == (True, 25)


@pytest.mark.parametrize(
    "lines, expected",
    [
        ([START], [("7", 0, 1, 10.0, None, outcomes.RUNNING)]),  # still running (or its end never came)
        ([END], [("7", 0, 1, None, 50.0, "failed")]),  # an end without a start: it failed before training
        ([END, START], [("7", 0, 1, 10.0, 50.0, "failed")]),  # order within an attempt does not matter
        ([line(END, outcome=...)], [("7", 0, 1, None, 50.0, outcomes.LOST)]),  # ended, how unknown
        (  # attempts of every job in the folder, numbered in the order each first appears
            [
                START,
                line(START, job="8", time=20.0),
                END,
                line(START, restart=1, time=60.0),
                line(END, job="8", time=70.0, outcome="completed"),
            ],
            [
                ("7", 0, 1, 10.0, 50.0, "failed"),
                ("8", 0, 2, 20.0, 70.0, "completed"),
                ("7", 1, 3, 60.0, None, outcomes.RUNNING),
            ],
        ),
        (  # the same event twice: the later line wins (a lost attempt closed again)
            [START, line(END, outcome="lost"), line(END, time=55.0, outcome="node_fail")],
            [("7", 0, 1, 10.0, 55.0, "node_fail")],
        ),
        ([line(START, restart=1000)], [("7", 1000, 1, 10.0, None, outcomes.RUNNING)]),  # a step in place
        ([line(START, job="123_4")], [("123_4", 0, 1, 10.0, None, outcomes.RUNNING)]),  # an array task
        ([line(START, restart=2.0)], [("7", 2, 1, 10.0, None, outcomes.RUNNING)]),  # an integral float
        ([line(START, time=0)], [("7", 0, 1, 0.0, None, outcomes.RUNNING)]),  # 1970 is a time
        ([], []),
    ],
)
def test_whole_records_merge_by_attempt(lines: list[dict[str, Any]], expected: list[tuple[Any, ...]]) -> None:
    merged = attempts.merge(lines)
    assert [(a.job, a.restart, a.number, a.started, a.ended, a.outcome) for a in merged] == expected


def test_an_end_record_comes_back_as_the_attempt_it_was_written_from() -> None:
    ended = Attempt(
        "7",
        1000,
        number=1,
        ended=50.0,
        outcome=outcomes.NODE_FAIL,
        step=9,
        checkpoint=8,
        node="n2",
        blamed=True,
        reason="node n2 failed",
        signature="node failure",
        decision=outcomes.RESTART,
        exclude=("n2",),
        lost=("n2", "n3"),
        left=("n2",),
        spares_in=("n1",),
    )
    assert attempts.merge([json.loads(json.dumps(attempts.end_record(ended)))]) == [ended]


def test_an_attempt_whose_ranks_never_started_keeps_the_nodes_its_supervisor_placed_it_on() -> None:
    """Before: a rank killed while the step started left no start record, and --wait said "attempt 1 on ?"."""
    killed = Attempt("7", 0, number=1, nodes=("n2", "n3"), ended=5.0, outcome=outcomes.FAILED)
    record = attempts.end_record(killed)
    assert record["nodes"] == ["n2", "n3"]
    assert attempts.merge([record]) == [killed]
    assert attempts.start_line(killed) == "attempt 1 on n2,n3: from the start"
    # a start record says where the ranks ran: the end then repeats nothing, and the start's nodes stand
    started = attempts.merge([line(START), attempts.end_record(replace(killed, started=1.0))])
    assert "nodes" not in attempts.end_record(replace(killed, started=1.0))
    assert started[0].nodes == tuple(START["nodes"])


# ----- torn and foreign lines: skipped whole, never raised on, never numbered ------------------------------

TORN = [
    pytest.param([1, 2], id="a JSON list"),
    pytest.param("start", id="a JSON string"),
    pytest.param(7, id="a JSON number"),
    pytest.param(None, id="JSON null"),
    pytest.param(line(START, event=...), id="no event"),  # the ledger's merge raised KeyError
    pytest.param(line(START, event="step"), id="another event"),
    pytest.param(line(START, event=None), id="event null"),
    pytest.param(line(START, job=...), id="no job"),
    pytest.param(line(START, job=7), id="job a number"),
    pytest.param(line(START, job=None), id="job null"),
    pytest.param(line(START, job=["7"]), id="job a list"),
    pytest.param(line(START, restart=...), id="no restart"),  # the ledger's took it for restart 0
    pytest.param(line(START, restart="1"), id="restart a string"),  # ... and this for restart 1
    pytest.param(line(START, restart=True), id="restart a bool"),
    pytest.param(line(START, restart=1e300), id="restart past MAX_STEP"),
    pytest.param(line(START, time=...), id="no time"),  # the ledger's kept it, without a time
    pytest.param(line(START, time="10"), id="time a string"),
    pytest.param(line(START, time=None), id="time null"),
    pytest.param(line(START, time=1e308), id="time past TIME_MAX"),  # the report's OverflowError once
    pytest.param(line(START, time=-5.0), id="time before 1970"),
    pytest.param(line(START, time=float("inf")), id="time Infinity"),  # json.loads reads Infinity
    pytest.param(line(END, time=float("nan")), id="time NaN"),
]


@pytest.mark.parametrize("torn", TORN)
def test_a_line_that_names_no_attempt_and_time_is_skipped(torn: Any) -> None:
    """Between two whole lines of job 8, the line opens no attempt: job 8's is attempt 1, whole."""
    first, last = line(START, job="8"), line(END, job="8", outcome="completed", decision="done")
    merged = attempts.merge([first, torn, last])
    assert keys(merged) == [("8", 0, 1)]
    assert (merged[0].started, merged[0].ended, merged[0].outcome) == (10.0, 50.0, "completed")


@pytest.mark.parametrize(
    "field, value, read",
    [
        ("nodes", 5, ("nodes", ())),  # the ledger's merge raised TypeError
        ("nodes", "n1", ("nodes", ())),  # ... and read this as ("n", "1")
        ("nodes", None, ("nodes", ())),
        ("ranks", {"n1": 0}, ("ranks", ())),
        ("nodes", ["n1", 5], ("nodes", ("n1", "5"))),  # every entry kept in its place (the node of a rank)
        ("resumed_from", "4", ("resumed_from", None)),
        ("resumed_from", 4.0, ("resumed_from", 4)),
        ("resumed_from", True, ("resumed_from", None)),
    ],
)
def test_a_start_field_of_the_wrong_type_reads_as_missing(
    field: str, value: Any, read: tuple[str, Any]
) -> None:
    (a,) = attempts.merge([line(START, **{field: value})])
    assert (read[0], getattr(a, read[0])) == read
    assert (a.started, a.number) == (10.0, 1)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("outcome", 5, outcomes.LOST),
        ("outcome", "", outcomes.LOST),
        ("outcome", None, outcomes.LOST),
        ("step", "45", None),
        ("step", 1e300, None),  # past MAX_STEP
        ("step", float("inf"), None),
        ("step", True, None),
        ("checkpoint", [20], None),
        ("rank", "1", None),
        ("node", 5, None),
        ("node", "", None),
        ("blamed", "false", False),  # only true blames the node
        ("blamed", 1, False),
        ("reason", ["boom"], ""),
        ("signature", {"a": 1}, ""),
        ("decision", 3, ""),
        ("exclude", 5, ()),  # the ledger's merge raised TypeError
        ("exclude", "n2", ()),
        ("lost", 5, ()),
        ("left", {"n2": 1}, ()),
        ("spares_in", "n1", ()),
    ],
)
def test_an_end_field_of_the_wrong_type_reads_as_missing(field: str, value: Any, expected: Any) -> None:
    (a,) = attempts.merge([START, line(END, **{field: value})])
    assert getattr(a, field) == expected
    assert (a.started, a.ended, a.number) == (10.0, 50.0, 1)


# ----- the file: every reader sees the same attempts ------------------------------------------------------


def test_the_file_read_by_the_ledger_and_the_report_tells_the_same_attempts(tmp_path: Path) -> None:
    """A folder with every kind of torn and foreign line between whole ones, and a last line a kill cut: the
    ledger (the supervisors, --wait, the judge) and the report read the same two attempts."""
    whole = [START, END, line(START, restart=1, time=60.0, resumed_from=20)]
    junk = [json.dumps(p.values[0]).encode() for p in TORN]
    raw = b"\n".join(
        [
            json.dumps(whole[0]).encode(),
            *junk,
            b"not json",
            b"\xff\xfe\x00",
            b"",
            json.dumps(whole[1]).encode(),
        ]
        + [b"{}", json.dumps(whole[2]).encode(), b'{"event": "end", "job": "7", "restart": 1, "ti']
    )
    (tmp_path / attempts.ATTEMPTS).write_bytes(raw)
    merged = attempts.read(tmp_path)
    assert [(a.job, a.restart, a.number, a.outcome, a.resumed_from) for a in merged] == [
        ("7", 0, 1, "failed", None),
        ("7", 1, 2, outcomes.RUNNING, 20),
    ]
    assert merged == attempts.merge(whole)
    assert list(read_run(tmp_path, use_sacct=False).lines) == merged
    assert attempts.read(tmp_path / "none") == []
