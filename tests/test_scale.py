"""`python -m hpc_ddp.bench scale` tiny (a few hundred simulated ranks, one run read by every test), its pure
helpers, and the watchdog's round at many ranks (who decides, read from the names alone)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_environ

from hpc_ddp.bench import scale
from hpc_ddp.bench.scale_parts import VANISHED
from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import verdict as ledger_verdict
from hpc_ddp.run.watch import watchdog
from hpc_ddp.run.watch.beacon import Beacon

pytestmark = pytest.mark.deadline(240)

SIZES = (32, 128)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny run of every part; its JSON and its printed table."""
    where = tmp_path_factory.mktemp("scale")
    out = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.bench", "scale", "--ranks", ",".join(map(str, SIZES)), "--json",
         str(where / "s.json"), "--folder", str(where)],
        capture_output=True, text=True, env=clean_environ(), timeout=200, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return {**json.loads((where / "s.json").read_text()), "table": out.stdout}


def runs(bench: dict[str, Any], part: str) -> list[dict[str, Any]]:
    found = bench["results"][part]
    assert [r["ranks"] for r in found["runs"]] == list(SIZES)
    return found["runs"]


def test_the_silent_rank_is_named_alone_at_every_size(bench: dict[str, Any]) -> None:
    for r in runs(bench, "hang"):
        assert r["named"] == [r["silent"]] and r["reason"] == "unresponsive", r
        assert r["ranks_left"] == r["ranks"] - 1, r  # every other rank ended
        assert r["report_files"] == r["ranks"] - 1 + 2  # one report each, the claim and the decision


def test_the_judge_names_the_first_cause_among_peers_that_went(bench: dict[str, Any]) -> None:
    for r in runs(bench, "judge"):
        assert r["named"] == r["first"] and r["note_files"] == r["ranks"], r


def test_files_per_rank_and_slurm_calls_per_look_do_not_grow(bench: dict[str, Any]) -> None:
    files = runs(bench, "files")
    # one file per node of 8 ranks (before: one per rank), 32 KB a rank, nothing after a clean end
    assert {
        (r["start_files_per_rank"], r["start_bytes_per_rank"], r["end_files_per_rank"]) for r in files
    } == {(0.125, 32768, 0.0)}
    slurm = runs(bench, "slurm")
    assert {(r["calls_running"], r["calls_failed"]) for r in slurm} == {(1, 2)}
    assert bench["results"]["slurm"]["growth"]["calls_running"] == 0.0


def test_rendezvous_and_report_ran_at_every_size(bench: dict[str, Any]) -> None:
    assert [r["joined"] for r in runs(bench, "rendezvous")] == list(SIZES)
    assert all(r["exit"] == 0 and r["html_bytes"] > 0 for r in runs(bench, "report"))


def test_growth_is_fitted_and_printed_with_each_target(bench: dict[str, Any]) -> None:
    assert 0.8 <= bench["results"]["judge"]["growth"]["note_bytes"] <= 1.2  # a note per rank: linear
    assert "growth N^" in bench["table"]
    assert {t["target"] for t in bench["targets"]} == {t[3] for t in scale.TARGETS}
    assert "target: judge <= 1 s" in bench["table"]


def test_exponent_fits_a_power_law() -> None:
    assert scale.exponent([1, 2, 4], [1.0, 4.0, 16.0]) == 2.0
    assert scale.exponent([10, 100], [3.0, 3.0]) == 0.0
    assert scale.exponent([10, 100], [0.0, None]) is None
    assert scale.exponent([10], [1.0]) is None


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--ranks", "x"], "--ranks x: expected world sizes of 4 or more"),
        (["--ranks", "2"], "--ranks 2: expected"),
        (["--parts", "hang,nope"], "--parts hang,nope: choose from rendezvous"),
        (["--real", "8"], "--real 8: expected NODESxRANKS"),
    ],
)
def test_bad_options_are_one_line_usage_errors(argv: list[str], said: str) -> None:
    with pytest.raises(UsageError, match=said.replace("^", r"\^")):
        scale.parse(argv)


def dog(folder: Path, rank: int, world: int) -> watchdog.Watchdog:
    peers = tuple(("h", 1) for _ in range(world))
    who = watchdog.Identity(rank, world, "h", peers, "job-0")
    return watchdog.Watchdog(Beacon(), who, folder, 1.0, 600.0, list, None, leave=lambda code: None)


def report(where: Path, rank: int, busy: bool = False) -> None:
    ledger_verdict.write_json(where / f"rank-{rank}.json", {"rank": rank, "busy": busy})


def test_a_rank_decides_only_when_no_lower_rank_diagnosed(tmp_path: Path) -> None:
    where = tmp_path / "r0"
    where.mkdir()
    report(where, 0, busy=True)  # a busy rank only answered: it does not decide
    assert not dog(tmp_path, 5, 8)._lower_diagnosed(where)
    report(where, 3)
    assert dog(tmp_path, 5, 8)._lower_diagnosed(where)
    assert not dog(tmp_path, 3, 8)._lower_diagnosed(where)
    # beyond the ranks looked at one by one (LOOK_FIRST), the round's listing: rank 100 found by rank 200
    far = tmp_path / "r1"
    far.mkdir()
    assert not dog(tmp_path, 200, 300)._lower_diagnosed(far)
    report(far, 100)
    assert dog(tmp_path, 200, 300)._lower_diagnosed(far)
    assert not dog(tmp_path, 100, 300)._lower_diagnosed(far) and not dog(tmp_path, 50, 300)._lower_diagnosed(
        far
    )


def test_the_others_read_the_small_decision_not_every_report(tmp_path: Path) -> None:
    where = tmp_path / "r0"
    where.mkdir()
    report(where, 0)
    report(where, 1)
    decider, other = dog(tmp_path, 0, 3), dog(tmp_path, 1, 3)
    reports = decider._collect(where)  # rank 2 never reports: the window closes
    assert reports is not None and {r["rank"] for r in reports} == {0, 1}
    assert other._collect(where) is None  # rank 0 decides
    record, decided = decider._verdict(where, [dict(r, collective=True, phase="x", step=1) for r in reports])
    assert decided and record["culprits"] == [2]
    word = json.loads((where / watchdog.DECIDED).read_text())
    assert "reports" not in word and word["culprits"] == [2]
    seen, decided = other._verdict(where, None)
    assert not decided and seen["line"] == record["line"]
    assert ledger_verdict.read(tmp_path)["reports"]  # hang.json keeps every report, for the supervisor


def test_the_window_grows_with_the_job_and_keeps_the_verdict_within_15_s() -> None:
    assert watchdog.window_s(2) == watchdog.WINDOW_S == 5.0
    assert watchdog.window_s(8192) == 13.0 and watchdog.window_s(8192) + watchdog.TICK_S <= 15.0


def test_a_node_sets_its_ranks_note_space_aside_in_one_file_and_a_full_disk_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpc_ddp.ledger import exits

    slots = [(node, local, 3) for node in range(2) for local in range(3)]
    for rank, slot in enumerate(slots):
        exits.reserve(tmp_path, "7", 0, rank, slot)
    attempt = tmp_path / "exits" / "7-0"
    assert sorted(p.name for p in attempt.iterdir()) == ["node0.space", "node1.space"]
    assert (attempt / "node1.space").stat().st_size == 3 * exits.NOTE_BYTES
    assert all(exits.reserved(tmp_path, "7", 0, rank, slot) for rank, slot in enumerate(slots))
    assert exits.read(tmp_path, "7", 0) == []  # placeholders are no notes

    def full(*_args: object) -> None:  # what a full disk does to a new file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exits, "atomic_write_bytes", full)
    exits.note(tmp_path, "7", 0, 5, "node1", ValueError("bad batch 7"), slots[5])
    exits.note(tmp_path, "7", 0, 4, "node1", RuntimeError(VANISHED), slots[4])
    monkeypatch.undo()
    notes = exits.read(tmp_path, "7", 0)
    assert [(n["rank"], n["type"]) for n in notes] == [(5, "ValueError"), (4, "RuntimeError")]
    assert (attempt / "node1.space").stat().st_size == 3 * exits.NOTE_BYTES  # written in place
    for rank, slot in enumerate(slots):
        exits.release(tmp_path, "7", 0, rank, slot)
    assert sorted(p.name for p in attempt.iterdir()) == ["node1.space"]  # its notes stay, node 0's space went
    assert exits.read(tmp_path, "7", 0) == notes
    for rank, slot in enumerate(slots):
        exits.reserve(tmp_path, "7", 1, rank, slot)
        exits.release(tmp_path, "7", 1, rank, slot)
    assert not (tmp_path / "exits" / "7-1").exists()  # an attempt that left no note leaves nothing
