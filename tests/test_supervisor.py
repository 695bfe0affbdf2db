"""The supervisor core and the ledger, without a run: the attempt pipeline, both budgets, records that cannot
be written, the one exit-code table and attempt line, the error signature (hpc_ddp.launch.supervisor,
hpc_ddp.ledger.judge and rules, hpc_ddp.ledger). Plus the local launcher supervising ranks without torch (fake_ranks):
the budgets it applies, a full disk under attempts.jsonl, a usage error shown once."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_environ, die_with_test

from hpc_ddp import exitcodes
from hpc_ddp.launch import supervisor
from hpc_ddp.ledger import attempts, judge, outcomes
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.signature import signature
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore

LOCAL = supervisor.Budgets(max_restarts=3, max_requeue=1, again=outcomes.RESTART)


def end(journal: supervisor.Journal, restart: int, found: Any, budgets: supervisor.Budgets = LOCAL):
    return supervisor.end_attempt(journal, "7", restart, found, budgets, began=0.0, checkpoint=None, now=10.0)


# ----- both budgets, applied by the supervisor ----------------------------------------------------------------


def test_the_supervisor_applies_max_requeue(tmp_path: Path) -> None:
    journal = supervisor.Journal(CheckpointStore(tmp_path, Local()))
    first = end(journal, 0, judge.Evidence(code=exitcodes.PREEMPTED, requeue=True))
    assert (first.attempt.outcome, first.decision.action) == ("preempted", "restart")
    assert first.decision.message.startswith("requeue 1 of --max-requeue 1")
    second = end(journal, 1, judge.Evidence(code=exitcodes.PREEMPTED, requeue=True))
    assert (second.attempt.outcome, second.decision.action) == ("preempted", "stop")
    assert "requeue budget spent (1 of --max-requeue 1), not requeued" in second.decision.message
    assert [a.decision for a in attempts.read(tmp_path)] == ["restart", "stop"]


def test_a_stop_signal_is_never_requeued_and_rank0s_own_decision_stands(tmp_path: Path) -> None:
    journal = supervisor.Journal(CheckpointStore(tmp_path, Local()))
    stopped = end(journal, 0, judge.Evidence(code=exitcodes.PREEMPTED, requeue=False))
    assert (stopped.attempt.outcome, stopped.decision.action) == ("stopped", "stop")
    # --requeue-by scontrol: rank 0 applied --max-requeue and requeued; the supervisor keeps that decision.
    slurm = supervisor.Budgets(max_restarts=3, max_requeue=0, again=outcomes.REQUEUE)
    by_rank0 = end(
        journal, 1, judge.Evidence(code=exitcodes.PREEMPTED, requeue=True, rank0_requeued=True), slurm
    )
    assert (by_rank0.attempt.outcome, by_rank0.decision.action) == ("preempted", "requeue")
    assert by_rank0.ending.decided


def test_failures_spend_max_restarts_and_preemptions_do_not(tmp_path: Path) -> None:
    journal = supervisor.Journal(CheckpointStore(tmp_path, Local()))
    budgets = supervisor.Budgets(max_restarts=1, max_requeue=5, again=outcomes.RESTART)
    assert end(journal, 0, judge.Evidence(code=1, first_rank=1), budgets).decision.action == "restart"
    assert end(journal, 1, judge.Evidence(code=75, requeue=True), budgets).decision.action == "restart"
    last = end(journal, 2, judge.Ending(outcomes.FAILED, "E: other", "E: other"), budgets)
    assert last.decision.action == "stop" and "restart budget spent: 2 failure(s)" in last.decision.message


def test_the_attempt_is_the_one_rank0_started(tmp_path: Path) -> None:
    attempts.record_start(tmp_path, "7", 0, ["n1"], ["n1", "n1"], None, now=1.0)
    closed = end(supervisor.Journal(CheckpointStore(tmp_path, Local())), 0, judge.Evidence(code=0))
    assert (closed.attempt.number, closed.attempt.started, closed.attempt.outcome) == (1, 1.0, "completed")
    assert closed.recorded and attempts.read(tmp_path)[0].decision == "done"


def test_without_a_better_witness_the_rank_that_ended_first_is_named() -> None:
    ending = judge.judge(judge.Evidence(code=exitcodes.USAGE, rank_nodes=("a", "b"), first_rank=1))
    assert (ending.outcome, ending.rank, ending.node) == ("usage", 1, "b")


# ----- records that cannot be written (issue 22 item 5) ------------------------------------------------------


def full_disk(_folder: Path, _record: dict[str, Any]) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_costs_the_record_not_the_decision(tmp_path: Path) -> None:
    journal = supervisor.Journal(CheckpointStore(tmp_path, Local()), write=full_disk)
    budgets = supervisor.Budgets(max_restarts=1, max_requeue=1, again=outcomes.RESTART)
    first = end(journal, 0, judge.Ending(outcomes.FAILED, "E: a", "E: a"), budgets)
    assert first.decision.action == "restart" and not first.recorded
    # The second failure is counted although the first is in no file: the budget is spent.
    second = end(journal, 1, judge.Ending(outcomes.FAILED, "E: b", "E: b"), budgets)
    assert second.decision.action == "stop" and "2 failure(s)" in second.decision.message
    assert second.attempt.number == 2
    assert (
        "2 record(s) could not be written" in journal.lost() and "No space left on device" in journal.lost()
    )
    assert not (tmp_path / attempts.ATTEMPTS).exists()
    journal._write = attempts.append  # the disk has room again: everything is written, in order
    assert journal.flush() and journal.lost() == ""
    assert [(a.restart, a.outcome, a.decision) for a in attempts.read(tmp_path)] == [
        (0, "failed", "restart"),
        (1, "failed", "stop"),
    ]


def test_a_failed_first_append_leaves_no_empty_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(_fd: int, _data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(attempts.os, "write", no_space)
    with pytest.raises(OSError):
        attempts.record_start(tmp_path, "7", 0, [], [], None)
    assert not (tmp_path / attempts.ATTEMPTS).exists()  # before: a 0-byte attempts.jsonl


def test_an_append_to_a_full_device_raises_and_leaves_the_file_alone(tmp_path: Path) -> None:
    attempts.record_start(tmp_path, "7", 0, [], [], None)
    good = (tmp_path / attempts.ATTEMPTS).read_bytes()
    (tmp_path / attempts.ATTEMPTS).rename(tmp_path / "kept.jsonl")
    (tmp_path / attempts.ATTEMPTS).symlink_to("/dev/full")  # a real ENOSPC on every write
    with pytest.raises(OSError) as raised:
        attempts.record_end(tmp_path, Attempt("7", 0, outcome="failed"))
    assert raised.value.errno == errno.ENOSPC
    assert (tmp_path / attempts.ATTEMPTS).is_symlink() and (tmp_path / "kept.jsonl").read_bytes() == good


# ----- one table, one line --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcome, code",
    [
        ("completed", 0),
        ("preempted", 75),
        ("stopped", 75),
        ("hang", 76),
        ("nonfinite", 65),
        ("usage", 2),
        ("failed", 1),
        ("node_fail", 1),
        ("lost", 1),
    ],
)
def test_one_exit_code_per_outcome(outcome: str, code: int) -> None:
    assert outcomes.exit_code(outcome) == code
    assert outcome in outcomes.OUTCOMES


def test_one_attempt_line() -> None:
    failed = Attempt("7", 0, number=1, outcome="failed", node="n2", blamed=True, reason="rank 2 was killed")
    assert attempts.line(failed, "restarting") == (
        "attempt 1 failed on n2 (points at the node): rank 2 was killed; restarting"
    )
    hang = Attempt("7", 1, number=2, outcome="hang", node="n1", reason="hang at step 3: ...")
    assert attempts.line(hang, "not retried") == "attempt 2 hang on n1: not retried"  # its verdict said it
    assert attempts.line(Attempt("7", 2, number=3, outcome="completed"), "finished") == "attempt 3 completed"
    started = Attempt("7", 0, number=1, nodes=("n1", "n2"), resumed_from=40)
    assert attempts.summary(started) == "attempt 1 on n1,n2: resumed from step 40"


# ----- the error signature (issue 22 item 13) -------------------------------------------------------------


@pytest.mark.parametrize(
    "first, second",
    [
        ("cannot open tmp/abc3f9a1x/shard.bin", "cannot open tmp/q7w2e9r4t/shard.bin"),
        ("object at 7f3a2b1c4d5e is gone", "object at 55d0c1e2f3a4 is gone"),
        ("lock held by 3f9a1c", "lock held by a1b2c3"),
        ("file /tmp/tmpk2j3h4l_/x missing", "file /tmp/tmp9zz8yy7x/x missing"),
    ],
)
def test_signatures_mask_made_up_names_and_bare_hex(first: str, second: str) -> None:
    assert signature("OSError", first) == signature("OSError", second)


def test_signatures_keep_the_words_that_name_things() -> None:
    assert signature("E", "conv2d expects fp16") == "E: convNd expects fpN"  # only its numbers are masked
    assert signature("E", "conv2d expects fp16") != signature("E", "linear expects fp16")
    assert signature("E", "deadbeef") == "E: deadbeef"


# ----- the local launcher supervising ranks without torch ---------------------------------------------------

LAUNCH = """
import sys
from pathlib import Path
from hpc_ddp.launch.local import Launcher, LocalJob
job = LocalJob(nodes=1, tasks_per_node=2, folder=Path(sys.argv[1]), train_argv=[], max_requeue=int(sys.argv[2]), checkpoint_storage="local",
               max_restarts=int(sys.argv[3]), job_id="4242", module="fake_ranks", records=True)
sys.exit(Launcher(job).run())
"""
# In a private mount namespace: $1 becomes a tiny tmpfs holding an empty attempts.jsonl, then filled up, so
# that every append to that file fails with ENOSPC while it reads as any file does (nothing leaks out: the
# mount goes away with the namespace).
FULL_DISK = (
    'mount -t tmpfs -o size=64k tmpfs "$1" || exit 99; : > "$1/attempts.jsonl"; '
    'dd if=/dev/zero of="$1/fill" bs=4k 2>/dev/null; shift; exec "$@"'
)


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


def launch(
    folder: Path, what: str, max_requeue: int = 3, max_restarts: int = 0, full: Path | None = None
) -> tuple[int, str, list[str]]:
    starts = folder / "starts.txt"
    cmd = [sys.executable, "-c", LAUNCH, str(folder), str(max_requeue), str(max_restarts)]
    if full is not None:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", FULL_DISK, "sh", str(full), *cmd]
    proc = subprocess.run(
        cmd,
        env=clean_environ(FAKE_RANKS_DO=what, FAKE_RANKS_FOLDER=str(folder), FAKE_RANKS_STARTS=str(starts)),
        capture_output=True,
        text=True,
        timeout=90,
        preexec_fn=die_with_test,
    )
    return proc.returncode, proc.stdout + proc.stderr, starts.read_text().split() if starts.exists() else []


@pytest.mark.deadline(120)
def test_the_local_launcher_applies_max_requeue(tmp_path: Path) -> None:
    """LocalJob.max_requeue was only printed: the ranks' record asking for a requeue restarted them, 4 times."""
    code, out, starts = launch(tmp_path, "preempted", max_requeue=1)
    assert starts == ["0", "1"], out
    assert code == exitcodes.PREEMPTED, out
    assert "preempted: restarting all ranks (1 of --max-requeue 1)" in out
    assert "requeue budget spent (1 of --max-requeue 1), not requeued" in out
    assert [a.decision for a in attempts.read(tmp_path)] == ["restart", "stop"]


@pytest.mark.deadline(120)
@pytest.mark.skipif(not _unshare_works(), reason="needs root and `unshare --mount`")
def test_a_full_disk_under_attempts_jsonl_crashes_no_launcher(tmp_path: Path) -> None:
    """Before: a traceback from the launcher, a 0-byte attempts.jsonl, and no restart."""
    full = tmp_path / "full"
    full.mkdir()
    (tmp_path / attempts.ATTEMPTS).symlink_to(full / attempts.ATTEMPTS)
    code, out, starts = launch(tmp_path, "fail", max_restarts=1, full=full)
    assert "Traceback" not in out, out
    assert code == exitcodes.FAILED, out
    assert starts == ["0", "1"], out  # one restart, then the budget (or the crash loop) stops it
    assert "attempt 2 failed" in out and "could not be written" in out and "No space left on device" in out
    assert (tmp_path / attempts.ATTEMPTS).is_symlink()


@pytest.mark.deadline(120)
def test_a_peer_killed_by_a_signal_is_the_cause_even_when_its_survivor_is_seen_to_end_first(
    tmp_path: Path,
) -> None:
    """Seen in CI: rank 1 SIGKILLed, rank 0's "Connection closed by peer" exit reaped first, and the attempt
    recorded as rank 0's RuntimeError (not blamed on a node) instead of rank 1 killed by SIGKILL."""
    code, out, _ = launch(tmp_path, "peer_killed")
    assert code == exitcodes.FAILED, out
    (only,) = attempts.read(tmp_path)
    assert (only.rank, only.signature, only.blamed) == (1, "signal SIGKILL", True), out
    assert only.nodes == ("127.0.0.1",) and only.started is None  # no start record: where the launcher put it
    assert "rank 1 on node 0 (127.0.0.1)" in out and "killed by SIGKILL; stopped the other ranks" in out, out
    assert "then rank 0 failed too, on the rank that ended first (Connection closed by peer)" in out, out


@pytest.mark.deadline(120)
def test_a_usage_error_is_shown_once(tmp_path: Path) -> None:
    code, out, _ = launch(tmp_path, "usage")
    assert code == exitcodes.USAGE, out
    assert out.count("error: --lr -1: must be positive") == 1, out
