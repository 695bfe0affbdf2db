"""`submit --wait` without a cluster: the polling rule, the message rules as tables, and whole sequences
followed on a fake cluster (tests/fake_slurm.py) with a fake clock: the accounting lag, requeues, a cancel
after a requeue, another job's records in the folder, a long job's command count (issues 18 and 23)."""

from __future__ import annotations

import io
import json
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import die_with_test
from fake_slurm import FakeClock, FakeSlurm
from plugin_scheduler import calls, client, through_the_plugin  # noqa: F401 (an autouse fixture)

from hpc_ddp.launch import options
from hpc_ddp.launch.slurm import follow, outcome, submitter
from hpc_ddp.launch.slurm.follow import Look
from hpc_ddp.ledger import attempts
from hpc_ddp.run.checkpoint.storage import Local
from hpc_ddp.run.checkpoint.store import CheckpointStore
from hpc_ddp.scheduler.slurm import request
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.scheduler.slurm.parse import JobHistory, JobInfo
from hpc_ddp.scheduler.slurm.states import JobState
from hpc_ddp.submit import build_argparser

# ----- the rules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steady_s, delay_s", [(0, 2.0), (20, 2.0), (45, 4.5), (100, 10.0), (300, 30.0), (36000, 30.0)]
)
def test_looks_space_out_with_the_jobs_steadiness(steady_s: float, delay_s: float) -> None:
    assert follow.poll_delay(steady_s) == delay_s


def look(state: str, restarts: int = 0, reason: str = "") -> Look:
    return Look(JobState(state), restarts, reason, over=False)


@pytest.mark.parametrize(
    "before, now, lines",
    [
        (None, look("PENDING", reason="None"), []),
        (None, look("PENDING", reason="Resources"), ["job 7 pending: Resources"]),
        # Issue 23: accounting still says PENDING while the controller already had it RUNNING: no requeue.
        (look("RUNNING"), look("PENDING", reason="None"), []),
        (look("RUNNING"), look("REQUEUED", 1), ["job 7 was requeued; waiting for it to start again"]),
        # Issue 23: "was requeued" again when REQUEUED turned PENDING: one requeue, one line.
        (look("REQUEUED", 1), look("PENDING", 1), []),
        (look("PENDING", 1), look("RUNNING", 1), []),
        (look("RUNNING"), look("RUNNING", 1), ["job 7 was requeued; it runs again"]),  # between two looks
        (
            look("RUNNING", 1),
            look("PENDING", 2, "BeginTime"),
            ["job 7 was requeued; waiting for it to start again"],
        ),
        (look("PENDING", reason="Resources"), look("PENDING", reason="Resources"), []),
        (
            look("PENDING", reason="Resources"),
            look("PENDING", reason="Priority"),
            ["job 7 pending: Priority"],
        ),
        (None, look("PENDING", reason="BeginTime"), ["job 7 pending: BeginTime"]),  # --begin: the user's
        (
            None,
            look("PENDING", reason="PartitionConfig"),
            [f"job 7 pending: {request.pending_hint('PartitionConfig')}"],
        ),
    ],
)
def test_what_a_new_look_says(before: Look | None, now: Look, lines: list[str]) -> None:
    assert follow.news("7", before, now) == lines


def history(*states: str) -> JobHistory:
    return JobHistory(tuple(JobState(s) for s in states))


def controller(state: str, restarts: int = 0, exit_code: str = "0:0") -> JobInfo:
    return JobInfo({"JobState": state, "Restarts": str(restarts), "ExitCode": exit_code, "Reason": "None"})


@pytest.mark.parametrize(
    "sacct, ctl, state, restarts, over",
    [
        (history("RUNNING"), None, "RUNNING", 0, False),
        (None, controller("RUNNING"), "RUNNING", 0, False),  # a fresh job, or no accounting
        (None, None, None, 0, False),
        # accounting says the run ended; the controller decides
        (history("CANCELLED"), controller("COMPLETING"), "COMPLETING", 0, False),  # processes still saving
        (history("CANCELLED"), controller("CANCELLED", exit_code="0:15"), "CANCELLED", 0, True),
        (history("NODE_FAIL"), controller("PENDING", 1), "PENDING", 1, False),  # Slurm requeued it
        (history("PREEMPTED"), controller("PREEMPTED"), "PREEMPTED", 0, True),  # PreemptMode=CANCEL
        (history("COMPLETED"), JobInfo(gone=True), "COMPLETED", 0, True),  # ended long ago
        (history("REQUEUED", "CANCELLED"), controller("CANCELLED", 1), "CANCELLED", 1, True),
        # the controller is a run ahead of accounting: its word
        (history("NODE_FAIL"), controller("FAILED", 1, "1:0"), "FAILED", 1, True),
    ],
)
def test_over_only_on_the_controllers_word(
    sacct: JobHistory | None, ctl: JobInfo | None, state: str | None, restarts: int, over: bool
) -> None:
    seen = follow.verdict(sacct, ctl)
    if state is None:
        assert seen is None
        return
    assert seen is not None and (seen.state.state, seen.restarts, seen.over) == (state, restarts, over)


# ----- sequences on the fake cluster -----------------------------------------------------------------------


class Run:
    """`--wait` on job 7 of a fake cluster, on a fake clock; the test schedules what happens and when."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "submitit").mkdir(parents=True)
        self.fake, self.clock = FakeSlurm(), FakeClock()
        self.job = self.fake.submit("7")
        self.times: list[tuple[float, tuple[str, ...]]] = []
        self.fake.on_call = lambda call: self.times.append((self.clock.t - 1000.0, call))

    def at(self, t: float, action: object) -> None:
        self.clock.at(t, action)  # type: ignore[arg-type]

    def attempt(self, event: str, restart: int, **fields: object) -> None:
        record = {"event": event, "job": "7", "restart": restart, "time": self.clock.t, **fields}
        with open(self.folder / "attempts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def metrics(self, **record: object) -> None:
        with open(self.folder / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, text: str) -> None:
        with open(outcome.log_path(self.folder, "7"), "a") as f:
            f.write(text)

    def follow(self) -> tuple[int, str]:
        out = io.StringIO()
        clock = follow.Clock(self.clock.now, self.clock.sleep)
        code = follow.follow(
            "7", CheckpointStore(self.folder, Local()), 4, 0.0, client(self.fake), out=out, clock=clock
        )
        return code, out.getvalue()

    def looks(self) -> list[float]:
        """When accounting was asked."""
        return [t for t, call in self.times if call[0] == "sacct"]


def test_a_job_accounting_lags_behind_is_never_called_requeued(tmp_path: Path) -> None:
    """Measured: sacct has no record for a moment, then says PENDING while scontrol says RUNNING."""
    run = Run(tmp_path)
    run.job.accounted, run.job.state = False, "RUNNING"
    run.at(3, lambda: setattr(run.job, "accounted", True))  # its record: still PENDING
    run.at(8, lambda: run.fake.start("7"))
    run.at(20, lambda: run.fake.end("7", "COMPLETED"))
    code, out = run.follow()
    assert code == 0 and "requeued" not in out, out
    assert out.splitlines() == [f"[submit] job 7 completed; run folder {tmp_path}"]


def test_one_requeue_is_told_once(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.fake.start("7")

    def requeued_without_its_next_record() -> None:  # measured: the PENDING record comes ~3 s later
        run.fake.requeue("7")
        run.job.records.pop()

    run.at(10, requeued_without_its_next_record)
    run.at(14, lambda: run.job.records.append(["PENDING", "0:0", "BeginTime"]))
    run.at(30, lambda: run.fake.start("7"))
    run.at(50, lambda: run.fake.end("7", "COMPLETED"))
    code, out = run.follow()
    assert code == 0 and out.count("was requeued") == 1, out
    assert "[submit] job 7 was requeued; waiting for it to start again" in out
    assert "pending: BeginTime" not in out  # the requeue's own pause, told by the line above


def test_a_cancel_while_pending_after_a_requeue_is_reported_at_once(tmp_path: Path) -> None:
    """Issue 23: the attempts record said "requeue", so --wait waited 90 s more, silent, for a requeue."""
    run = Run(tmp_path)
    run.fake.start("7")
    run.attempt("start", 0, nodes=["node1", "node2"])

    def preempted() -> None:
        run.attempt("end", 0, outcome="preempted", decision="requeue", reason="preempted")
        run.fake.requeue("7")

    run.at(30, preempted)
    run.at(50, lambda: SlurmClient(run.fake).cancel("7"))
    code, out = run.follow()
    assert code == 1, out
    assert out.splitlines()[-1] == "[submit] job 7 was cancelled (exit code 0)"
    assert run.clock.t - 1000 - 50 <= follow.POLL_MIN_S + follow.TICK_S + follow.SETTLE_S


def test_a_job_cancelled_before_accounting_records_its_next_run_is_reported(tmp_path: Path) -> None:
    """The batch step's stop cancels a job Slurm had just requeued: accounting's last record stays REQUEUED
    (no next run is ever recorded), and only the controller says CANCELLED."""
    run = Run(tmp_path)
    run.fake.start("7")

    def requeued_then_cancelled() -> None:
        run.fake.requeue("7")
        run.job.records.pop()  # the next run's record is not written yet, and never will be
        run.job.state = "CANCELLED"

    run.at(10, requeued_then_cancelled)
    code, out = run.follow()
    assert code == 1, out
    assert "was cancelled" in out.splitlines()[-1], out
    assert run.clock.t - 1000 - 10 <= 60, out  # not after the 5 minutes of silence


def test_a_job_is_over_only_once_its_processes_are_gone(tmp_path: Path) -> None:
    """scancel: accounting says CANCELLED at once while the tasks still save (KillWait); the controller
    says COMPLETING until the last process is gone, and only then does --wait report."""
    run = Run(tmp_path)
    run.fake.start("7")

    def cancelled() -> None:
        run.fake.end("7", "CANCELLED")
        run.job.state = "COMPLETING"

    run.at(10, cancelled)
    run.at(17, lambda: setattr(run.job, "state", "CANCELLED"))
    run.at(16, lambda: run.log("SIGTERM: stopped by SIGTERM: checkpoint saved, not requeued\n"))
    code, out = run.follow()
    assert "checkpoint saved, not requeued" in out and run.clock.t - 1000 >= 17
    assert out.splitlines()[-1].startswith("[submit] job 7 was cancelled")
    assert run.fake.count("squeue") == 0


def test_a_job_completing_for_5_minutes_is_reported_as_accounting_has_it(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.fake.start("7")

    def cancelled_but_a_node_never_lets_go() -> None:
        run.fake.end("7", "CANCELLED")
        run.job.state = "COMPLETING"

    run.at(10, cancelled_but_a_node_never_lets_go)
    code, out = run.follow()
    assert out.splitlines()[-1] == "[submit] job 7 was cancelled (exit code 0)"
    assert follow.COMPLETING_S < run.clock.t - 1000 - 10 <= follow.COMPLETING_S + follow.POLL_MAX_S + 2


def test_only_this_jobs_records_are_shown(tmp_path: Path) -> None:
    """Issue 23: a resubmitted finished folder (job 5's records first), or a job refused by the folder lock
    while job 5 writes there, showed job 5's start and end as its own."""
    run = Run(tmp_path)
    run.metrics(event="start", job="5", restart=0, epoch=0, step=0, resumed=False, world_size=4, startup_s=1)
    run.metrics(event="end", epoch=3, step=30)
    run.fake.start("7")
    run.at(
        4,
        lambda: run.metrics(event="start", job="7", restart=0, epoch=3, step=30, resumed=True, world_size=4),
    )
    run.at(
        6,
        lambda: run.metrics(event="start", job="5", restart=1, epoch=3, step=30, resumed=True, world_size=4),
    )
    run.at(8, lambda: run.metrics(event="end", epoch=9, step=99))  # job 5's
    run.at(20, lambda: run.fake.end("7", "COMPLETED"))
    code, out = run.follow()
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("[run]")] == [
        "[run] start 0 of job 7: resumed at epoch 3, step 30; 4 ranks, 0.0 s from process start to the first step"
    ]


def test_a_long_job_costs_one_accounting_query_per_look_spaced_up_to_30_s(tmp_path: Path) -> None:
    """Pending 1 min, an attempt of 30 min, a preemption and requeue, a second attempt of 30 min. Today's
    --wait asked sacct every 2 s (~1,800 times here), plus squeue while pending and scontrol at the end."""
    run = Run(tmp_path)
    run.job.records[0][2] = "Resources"

    def attempt_starts(restart: int) -> None:
        run.fake.start("7")
        run.attempt("start", restart, nodes=["node1", "node2"])
        run.metrics(
            event="start", job="7", restart=restart, epoch=0, step=0, resumed=bool(restart), world_size=4
        )

    def attempt_ends(decision: str) -> None:
        run.metrics(event="end", epoch=0, step=1)
        run.attempt("end", 0 if decision == "requeue" else 1, outcome="x", decision=decision)
        if decision == "requeue":
            run.fake.requeue("7")
        else:
            run.fake.end("7", "COMPLETED")
            run.job.state = "COMPLETING"

    run.at(60, lambda: attempt_starts(0))
    for t in range(61, 3600, 10):  # training: the log and metrics.jsonl grow all the time
        run.at(t, lambda: (run.log("Epoch 0, Loss: 1.0\n"), run.metrics(event="step", step=1)))
    run.at(1800, lambda: attempt_ends("requeue"))
    run.at(1815, lambda: attempt_starts(1))
    run.at(3600, lambda: attempt_ends("done"))
    run.at(3603, lambda: setattr(run.job, "state", "COMPLETED"))
    code, out = run.follow()
    assert code == 0 and out.count("was requeued") == 1, out
    looks = run.looks()
    gaps = [b - a for a, b in zip(looks, looks[1:], strict=False)]
    assert len(looks) <= 210, len(looks)  # measured: 202 (2 s polls would be 1,800)
    assert min(gaps) >= follow.POLL_MIN_S and max(gaps) <= follow.POLL_MAX_S + follow.TICK_S
    assert run.fake.count("squeue") == 0 and run.fake.count("scontrol") <= 3
    # Each change the files show is looked at within POLL_MIN_S: the requeue, the second start, the end.
    for t in (1800, 1815, 3600):
        assert min(x for x in looks if x >= t) - t <= follow.POLL_MIN_S + follow.TICK_S
    assert run.clock.t - 1000 - 3603 <= follow.POLL_MIN_S + follow.TICK_S + follow.SETTLE_S


def test_silence_from_slurm_ends_following_after_5_minutes(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.fake.accounting, run.job.known = False, False
    code, out = run.follow()
    assert code == 1
    assert out.splitlines() == [
        "[submit] cannot get the state of job 7 from sacct or scontrol for 5 minutes; stopped following. "
        "Check: sacct -j 7"
    ]
    assert follow.SILENCE_S < run.clock.t - 1000 <= follow.SILENCE_S + follow.POLL_MAX_S + follow.TICK_S


# ----- the final word ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, error",
    [
        ("Traceback (most recent call last):", True),
        ("python -m hpc_ddp.train: error: --epochs -1: must be at least 1", True),
        (
            "slurmstepd: error: *** JOB 5 ON node1 CANCELLED AT 2026-12-03T10:00:00 DUE TO TIME LIMIT ***",
            False,
        ),
        ("slurmstepd-node1: error: *** STEP 18.0 ON node1 CANCELLED AT 2026-12-03T09:59:57 ***", False),
        ("srun: error: node2: task 1: Exited with exit code 3", False),
        ("Epoch 0, Loss: 1.0", False),
    ],
)
def test_which_lines_are_a_ranks_own_error(line: str, error: bool) -> None:
    assert outcome.rank_error(line) is error


def test_a_time_limit_before_the_first_checkpoint_blames_no_rank(tmp_path: Path) -> None:
    """Issue 23: slurmstepd's "CANCELLED ... DUE TO TIME LIMIT" line made it "rank 0 failed", and rank 0's
    log tail, already shown by --wait, came again."""
    sub = tmp_path / "submitit"
    sub.mkdir()
    (sub / "7_0_log.out").write_text(
        "Epoch 0, Loss: 1.0\nslurmstepd: error: *** JOB 7 ON node1 CANCELLED AT 2026-12-03T10:00:00 DUE TO "
        "TIME LIMIT ***\n"
    )
    out = io.StringIO()
    assert (
        outcome.report("7", CheckpointStore(tmp_path, Local()), 4, JobState("TIMEOUT", 0, 15), 0.0, out) == 1
    )
    assert out.getvalue().splitlines() == [
        "[submit] job 7 hit its time limit (exit code 0, signal 15) before the ranks saved a checkpoint: nothing "
        "to resume from. Fix: a longer --time, or a larger --signal-delay-s (the ranks save when the signal "
        "comes, that many seconds before the limit)"
    ]
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-00000040.pt").write_bytes(b"x")
    (tmp_path / "checkpoints" / "latest").write_text("ckpt-00000040.pt\n")
    out = io.StringIO()
    outcome.report("7", CheckpointStore(tmp_path, Local()), 4, JobState("TIMEOUT", 0, 15), 0.0, out)
    assert "run the same command to resume from the latest checkpoint (step 40)" in out.getvalue()


def test_rank_0s_last_lines_are_not_shown_twice(tmp_path: Path) -> None:
    sub = tmp_path / "submitit"
    sub.mkdir()
    (sub / "7_0_log.out").write_text("Epoch 0, Loss: 1.0\npython -m hpc_ddp.train: error: no such task\n")
    out = io.StringIO()
    assert outcome.report("7", CheckpointStore(tmp_path, Local()), 4, JobState("FAILED", 2), 0.0, out) == 2
    assert out.getvalue().splitlines() == [
        "[submit] job 7 ended FAILED (exit code 2)",
        f"[submit] rank 0 failed; its log is shown above ({sub / '7_0_log.out'})",
    ]


# ----- what --wait prints around the job ----------------------------------------------------------------


def test_commands_to_copy_quote_paths_and_ctrl_c_says_how_to_follow_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: `tail -F` with a path with spaces, unquoted; Ctrl-C said nothing about following again."""
    folder = tmp_path / "my runs" / "a b"
    ns = build_argparser().parse_args(["--nodes", "2", "--folder", str(folder), "--wait"])
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(submitter, "_submit", lambda *args: "42")
    fake = FakeSlurm()

    def interrupted(call: tuple[str, ...]) -> None:
        raise KeyboardInterrupt

    fake.on_call = interrupted
    printed = io.StringIO()
    monkeypatch.setattr("sys.stdout", printed)
    code = submitter.submit(*options.read(ns), SlurmClient(fake))
    assert code == 130
    log = folder / "submitit" / "42_0_log.out"
    assert printed.getvalue().splitlines()[-4:] == [
        "Stopped following job 42; it keeps running (scancel 42 to stop it). To follow it again:",
        f"  rank 0 log:  {log}  (rank N: 42_N_log.out)",
        f"  follow it:   tail -F {shlex.quote(str(log))}",
        "  state:       sacct -j 42    cancel: scancel 42",
    ]
    assert shlex.split(f"tail -F {shlex.quote(str(log))}")[-1] == str(log)


def test_the_batch_shells_sigterm_line_comes_once_the_tasks_have_ended(tmp_path: Path) -> None:
    """Issue 23: it said "the tasks save a checkpoint and stop; waiting for them" after they had exited:
    bash runs the trap only once the foreground srun returns."""
    srun = tmp_path / "srun"
    srun.write_text(
        f"#!/bin/bash\ntouch {tmp_path}/started\nwhile [[ ! -e {tmp_path}/go ]]; do sleep 0.02; done\n"
        "echo 'tasks exited'\n"
    )
    srun.chmod(0o755)
    script = f'{request.TRAP}\n{srun}\necho "status=$?"\n'
    proc = subprocess.Popen(
        ["bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_test,
    )
    while not (tmp_path / "started").exists():
        assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    (tmp_path / "go").touch()
    out, _ = proc.communicate(timeout=60)
    assert out.splitlines() == [
        "tasks exited",
        "[hpc_ddp] the batch shell got SIGTERM (scancel, a requeue or the time limit); it ends once the attempt "
        "is recorded",
        "status=0",  # srun's, for the `end` step
    ]


def test_an_attempt_a_time_limit_left_open_is_closed_when_the_job_is_over(tmp_path: Path) -> None:
    """Issue 23: a time limit before the first checkpoint: Slurm SIGKILLed the batch shell before its `end`
    step, and the attempt stayed open in attempts.jsonl until the next job in the folder. `--wait` closes it
    once the job is over, with Slurm's word; another job's open attempt is left to that job."""
    run = Run(tmp_path)
    run.fake.start("7")
    run.attempt("start", 0, nodes=["node1", "node2"], ranks=["node1"] * 2 + ["node2"] * 2)
    with open(tmp_path / "attempts.jsonl", "a") as f:  # job 8's, still running elsewhere in this folder
        f.write(
            json.dumps({"event": "start", "job": "8", "restart": 0, "nodes": ["node3"], "time": 1.0}) + "\n"
        )
    run.at(20, lambda: run.fake.end("7", "TIMEOUT", "0:15"))
    code, out = run.follow()
    assert code == 1 and "hit its time limit" in out.splitlines()[-1], out
    by_job = {a.job: a for a in attempts.read(tmp_path)}
    closed = by_job["7"]
    assert (closed.outcome, closed.decision) == ("stopped", "stop"), closed
    assert "its time limit ended it before its batch shell could record the attempt" in closed.reason
    assert by_job["8"].ended is None


# ----- issue 33: the final word is the kit's record; a job pending on nodes that are gone -------------------


def test_the_final_word_is_the_recorded_decision_not_what_the_ranks_did_after_the_cause(
    tmp_path: Path,
) -> None:
    """Issue 33 item 1: a node failed; the survivors got SIGTERM and saved (preempted.json); the batch shell
    recorded the node failure and stopped the job. `--wait` returned 75 ("saved a checkpoint first"): the
    record says a node failure stopped it, so 1, and the advice is a command that resumes."""
    (tmp_path / "submitit").mkdir()
    (tmp_path / "preempted.json").write_text("{}")
    for event, fields in (
        ("start", {"nodes": ["node1", "node2"]}),
        (
            "end",
            {
                "outcome": "node_fail",
                "node": "node2",
                "blamed": True,
                "decision": "stop",
                "reason": "node node2 failed (Slurm took it away)",
            },
        ),
    ):
        attempts.append(tmp_path, {"event": event, "job": "7", "restart": 0, "time": 5.0, **fields})
    out = io.StringIO()
    code = outcome.report(
        "7",
        CheckpointStore(tmp_path, Local()),
        4,
        JobState("FAILED", 1),
        0.0,
        out,
        shown=True,
        resume="python -m x",
    )
    assert code == 1
    assert out.getvalue().splitlines() == [
        "[submit] job 7 stopped after 1 attempt(s): a node failed (on node2): node node2 failed (Slurm took it "
        "away); its first error and every attempt are shown above",
        f"[submit] once the cause is fixed, run the same command to resume from the start (no checkpoint yet) "
        f"in {tmp_path}: python -m x",
    ]
    out = io.StringIO()  # nothing showed them (the log could not be followed): listed here, not claimed
    outcome.report("7", CheckpointStore(tmp_path, Local()), 4, JobState("FAILED", 1), 0.0, out)
    assert (
        "shown above" not in out.getvalue()
        and "attempt 1 on node1,node2: from the start; node_fail" in out.getvalue()
    )


def test_a_job_slurm_requeued_onto_nodes_that_are_gone_is_stopped_by_wait_with_its_cause_kept(
    tmp_path: Path,
) -> None:
    """Issue 33 item 1, without --no-kill (a user's own script): Slurm requeued the job for node2's failure and
    no batch shell was left; with node3 drained it pends "Nodes required for job are DOWN, DRAINED..."
    forever. `--wait` records the node failure, cancels the job, and says so; the record keeps the cause."""
    from hpc_ddp.launch import supervisor
    from hpc_ddp.launch.slurm import lost

    run = Run(tmp_path)
    run.fake.nodes.update({"node2": "down*", "node3": "drain"})
    run.fake.start("7")
    run.attempt("start", 0, nodes=["node1", "node2"], ranks=["node1", "node2"])

    def node_failed() -> None:
        run.fake.end("7", "NODE_FAIL")
        run.fake.requeue("7")
        run.job.reason = (
            "Nodes_required_for_job_are_DOWN,_DRAINED_or_reserved_for_jobs_in_higher_priority_partitions"
        )

    run.at(20, node_failed)
    out = io.StringIO()
    policy = lost.Policy(supervisor.Budgets(3, 3, "requeue"), 2, tasks_per_node=2)
    clock = follow.Clock(run.clock.now, run.clock.sleep)
    code = follow.follow(
        "7", CheckpointStore(tmp_path, Local()), 4, 0.0, client(run.fake), out, clock, policy
    )
    text = out.getvalue()
    assert code == 1, text
    (closed,) = attempts.read(tmp_path)
    assert (closed.outcome, closed.node, closed.decision) == ("node_fail", "node2", "stop")
    assert "cannot requeue: the job needs 2 node(s) and only 1 usable one(s) remain" in text
    assert "[submit] cancelled job 7: Slurm had requeued it, and it stops here" in text
    assert "cancelled before its batch shell" not in text and run.fake.count("scancel", "7") == 1
    assert text.splitlines()[-2].startswith(
        "[submit] job 7 stopped after 1 attempt(s): a node failed (on node2)"
    )
    assert calls() == ["usable", "cancel"]  # the follower's facts and action, through the plugin's scheduler


def test_a_job_waiting_for_nodes_is_said_every_minute(tmp_path: Path) -> None:
    from hpc_ddp.launch import supervisor
    from hpc_ddp.launch.slurm import lost

    run = Run(tmp_path)
    run.fake.requeue("7")
    run.job.reason = run.job.records[-1][2] = "ReqNodeNotAvail,_UnavailableNodes:node2"
    run.at(200, lambda: run.fake.start("7"))
    run.at(210, lambda: run.fake.end("7", "COMPLETED"))
    out = io.StringIO()
    policy = lost.Policy(supervisor.Budgets(3, 3, "requeue"), 2, wait=True)
    code = follow.follow(
        "7",
        CheckpointStore(tmp_path, Local()),
        4,
        0.0,
        client(run.fake),
        out,
        follow.Clock(run.clock.now, run.clock.sleep),
        policy,
    )
    assert code == 0
    told = [line for line in out.getvalue().splitlines() if "--wait-for-nodes" in line]
    assert len(told) in (3, 4), out.getvalue()  # at 0, 60, 120, 180 s
    assert told[0].startswith("[submit] job 7 waits for nodes (ReqNodeNotAvail")


# ----- issue 33: the same command, again -------------------------------------------------------------------


def test_the_same_submit_command_comes_back_to_the_same_folder_and_its_advice_resumes_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33 item 6: without --folder each submission made a new runs/<job name>-<timestamp>, so the advice
    "run the same command to resume" started from scratch. The folder is now the command's own, and the
    advice names it."""
    import hpc_ddp.submit as entry

    monkeypatch.chdir(tmp_path)
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(
        submitter, "submit", lambda launch, cfg, resume="": seen.append((cfg.folder, resume)) or 0
    )
    argv = ["--nodes", "2", "--task", "slow_tasks:slow", "--wait"]
    assert entry.main(argv) == 0 and entry.main(argv) == 0
    folder = str(tmp_path / "runs" / "hpc_ddp-slow_tasks-slow")
    ns = build_argparser().parse_args(argv)
    assert submitter.default_folder(*options.read(ns)) == Path(folder)
    (_, resume), again = seen
    assert again == seen[0] and shlex.split(resume)[-2:] == ["--folder", folder]
    assert shlex.split(resume)[1:-2] == ["-m", "hpc_ddp.submit", *argv]


def test_a_submission_into_a_folder_whose_job_is_still_queued_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33 item 7: a rerun while the first job waited for its requeue took its folder over, and the two
    jobs took turns on it. Refused at submission, before anything is submitted."""
    from hpc_ddp.errors import UsageError

    folder = tmp_path / "run"
    folder.mkdir()
    attempts.append(folder, {"event": "start", "job": "75", "restart": 0, "time": 1.0, "nodes": ["node1"]})
    attempts.append(
        folder,
        {
            "event": "end",
            "job": "75",
            "restart": 0,
            "time": 2.0,
            "outcome": "preempted",
            "decision": "requeue",
        },
    )
    fake = FakeSlurm()
    fake.submit("75", state="PENDING", restarts=1, reason="BeginTime")
    ns = build_argparser().parse_args(["--nodes", "2", "--folder", str(folder)])
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(submitter, "_submit", lambda *args: pytest.fail("submitted"))
    with pytest.raises(
        UsageError, match=r"belongs to job 75, still PENDING \(BeginTime\): it resumes there by itself"
    ):
        submitter.submit(*options.read(ns), SlurmClient(fake))
    fake.jobs["75"].state = "CANCELLED"  # over: the folder is free, and the next job resumes its run
    monkeypatch.setattr(submitter, "_submit", lambda *args: "76")
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert submitter.submit(*options.read(ns), SlurmClient(fake)) == 0
