"""Sweeps on Slurm (issue 44), without a cluster: the split by MaxArraySize, an element's id and port, each
element's trial, the array's script, and `--wait` asking Slurm twice per poll for a whole sweep (a scripted
cluster). The real arrays: tests/test_sweep_slurm.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hpc_ddp import exitcodes, proc
from hpc_ddp.cluster.env import detect, port_for_job, slurm_job_id
from hpc_ddp.errors import UsageError
from hpc_ddp.launch.slurm import submitter
from hpc_ddp.launch.sweep import array, command, element, follow, state, summary
from hpc_ddp.launch.sweep.options import SweepArgs
from hpc_ddp.ledger import attempts
from hpc_ddp.scheduler.slurm import submit as slurm_submit
from hpc_ddp.scheduler.slurm.client import SlurmClient
from hpc_ddp.submit import build_argparser

BASE = ["--nodes", "2", "--tasks-per-node", "1", "--epochs", "1"]


def prepare(folder: Path, *axes: str, extra: Sequence[str] = ()):
    args = SweepArgs(tuple(axes))
    return command.prepare(args, [*BASE, *extra, "--folder", str(folder)], build_argparser)


@pytest.mark.parametrize(
    ("count", "cap", "expected"),
    [
        (3, 1001, [(0, 3)]),
        (1001, 1001, [(0, 1001)]),
        (1002, 1001, [(0, 1001), (1001, 1)]),
        (5, 2, [(0, 2), (2, 2), (4, 1)]),
        (0, 10, []),
        (2, 0, [(0, 1), (1, 1)]),
    ],
)
def test_a_sweep_larger_than_max_array_size_is_split_each_index_below_it(count, cap, expected) -> None:
    assert array.chunks(count, cap) == expected


@pytest.mark.parametrize(
    ("environ", "job"),
    [
        ({"SLURM_JOB_ID": "127", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "4"}, "123_4"),
        ({"SLURM_JOB_ID": "127"}, "127"),
        ({"SLURM_JOBID": "127"}, "127"),
        ({"SLURM_JOB_ID": "127", "SLURM_ARRAY_JOB_ID": "123"}, "127"),
        ({"SLURM_JOB_ID": "127", "SLURM_ARRAY_JOB_ID": "x", "SLURM_ARRAY_TASK_ID": "4"}, "127"),
        ({}, None),
    ],
)
def test_an_array_elements_id_is_array_underscore_index(environ: dict[str, str], job: str | None) -> None:
    assert slurm_job_id(environ) == job


def test_an_elements_records_name_it_by_index_and_its_port_is_its_own_job_ids() -> None:
    """123_4's port by the ARRAY_INDEX rule would be 127's: another running job's on the same node."""
    environ = {
        "SLURM_JOB_ID": "130",
        "SLURM_ARRAY_JOB_ID": "123",
        "SLURM_ARRAY_TASK_ID": "4",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURMD_NODENAME": "node1",
    }
    env = detect(environ, host="node1")
    assert env.job_id == "123_4" and env.master_port == port_for_job("130") != port_for_job("127")


def client(answers: dict[str, str], calls: list[tuple[str, ...]]) -> SlurmClient:
    def runner(argv: Sequence[str], timeout_s: float) -> proc.Output:
        calls.append(tuple(argv))
        return proc.Output(answers.get(argv[0], ""))

    return SlurmClient(runner=runner)


def test_max_array_size_is_read_from_scontrol_show_config() -> None:
    calls: list[tuple[str, ...]] = []
    text = "Configuration data as of ...\nMaxArraySize            = 1001\nMaxJobCount             = 10000\n"
    assert client({"scontrol": text}, calls).max_array_size() == 1001
    assert calls == [("scontrol", "show", "config")]
    assert client({"scontrol": "MaxJobCount = 1\n"}, []).max_array_size() is None


def split_cluster(arrays: list[tuple[str, int, int]]) -> type:
    """A cluster whose MaxArraySize is 2, that queues nothing and keeps each array it is handed in `arrays`
    (the sbatch script submitit writes for it, its size, P); array k's id is 100 + k."""

    class Cluster:
        def max_array_size(self) -> int:
            return 2

        def queued(self, jobs: Sequence[str]) -> dict:
            return {}

        def submit_array(
            self, job: slurm_submit.Submission, calls: list, parallel: int, after: str | None = None
        ) -> list[str]:
            number = str(100 + len(arrays))
            arrays.append((job.array_script(len(calls), parallel, after), len(calls), parallel))
            return [f"{number}_{i}" for i in range(len(calls))]

    return Cluster


def test_a_split_sweep_is_several_arrays_each_file_its_trials_from_its_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch, folder, decisions = prepare(tmp_path / "sweep", "lr=0.1,0.2,0.3", "seed=1,2")
    arrays: list[tuple[str, int, int]] = []
    monkeypatch.setattr(slurm_submit, "check_submit_host", lambda: None)
    monkeypatch.setattr(submitter, "_client", split_cluster(arrays))
    done, code = array.submit(
        launch, folder, decisions, SweepArgs(("lr=0.1,0.2,0.3", "seed=1,2"), parallel=2), BASE
    )
    assert code == exitcodes.OK and len(done) == 6
    assert [job for _, job in done] == ["100_0", "100_1", "101_0", "101_1", "102_0", "102_1"]
    assert [(n, p) for _, n, p in arrays] == [(2, 2)] * 3
    # --sweep-parallel 2 over three arrays: Slurm's %2 holds within each, so each waits for the one before.
    waits = [[line for line in script.splitlines() if "--dependency" in line] for script, _, _ in arrays]
    assert waits == [[], ["#SBATCH --dependency=afterany:100"], ["#SBATCH --dependency=afterany:101"]]
    files = sorted((folder / array.ARRAYS).iterdir(), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    assert [json.loads(f.read_text())["offset"] for f in files] == [0, 2, 4]
    # each array's script reads its own file
    assert [script.split("sweep.element ")[1].split(")")[0] for script, _, _ in arrays] == [
        str(f) for f in files
    ]
    third = json.loads(files[1].read_text())["trials"][1]
    assert third["name"] == "lr=0.2,seed=2" and f"--folder={folder / 'lr=0.2,seed=2'}" in third["argv"]
    # An element picks its trial by its index in its array's file.
    argv = element.from_file(files[1], {"SLURM_ARRAY_TASK_ID": "1"})
    assert argv == third["argv"] and "--lr=0.2" in argv and "--seed=2" in argv
    with pytest.raises(UsageError, match="no trial 2 \\(the array has 2\\)"):
        element.from_file(files[1], {"SLURM_ARRAY_TASK_ID": "2"})
    assert (folder / "lr=0.2,seed=2" / "submitit").resolve() == (folder / "submitit").resolve()
    recorded = state.read_record(folder)
    assert len(recorded["trials"]) == 6


def test_the_arrays_script_selects_each_elements_trial_before_the_steps(tmp_path: Path, capsys) -> None:
    launch, folder, decisions = prepare(tmp_path / "sweep", "lr=0.1,0.2,0.3", extra=["--print-sbatch"])
    done, code = array.submit(launch, folder, decisions, SweepArgs(("lr=0.1,0.2,0.3",), parallel=2), BASE)
    out, err = capsys.readouterr()
    assert (done, code) == ([], exitcodes.OK) and not folder.exists()  # shown, nothing submitted or written
    assert "#SBATCH --array=0-2%2" in out and "#SBATCH --output=" in out and "%A_%a_0_log.out" in out
    lines = out.splitlines()
    select = next(i for i, line in enumerate(lines) if "hpc_ddp.launch.sweep.element" in line)
    begin = next(i for i, line in enumerate(lines) if "hpc_ddp.launch.slurm.batch begin" in line)
    assert select < begin and lines[select + 1].startswith('eval "set -- $opts"')
    assert '/"${element}_0_log.out" -- "$@"' in lines[begin]
    assert 'end --status "$status" -- "$@"' in out
    assert "# element 2: python -m hpc_ddp.train" in err and "--lr=0.3" in err


def test_ddp_sbatchs_element_reads_the_sweep_from_its_options(tmp_path: Path) -> None:
    folder = tmp_path / "sweep"
    argv = ["--epochs", "1", "--folder", str(folder), "--sweep", "lr=0.1,0.2", "--sweep", "seed=1,2"]
    said: list[str] = []
    picked = element.from_sweep(
        [*argv, "--sweep-offset", "1"], {"SLURM_ARRAY_TASK_ID": "2"}, lambda m, **k: said.append(m)
    )
    assert picked == ["--epochs=1", "--lr=0.2", "--seed=2", f"--folder={folder / 'lr=0.2,seed=2'}"]
    assert said == ["[sweep] element 3: trial lr=0.2,seed=2: new"]
    assert [t["name"] for t in state.read_record(folder)["trials"]] == [
        "lr=0.1,seed=1",
        "lr=0.1,seed=2",
        "lr=0.2,seed=1",
        "lr=0.2,seed=2",
    ]
    with pytest.raises(UsageError, match="array index 4: the sweep has 4 trial"):
        element.from_sweep(argv, {"SLURM_ARRAY_TASK_ID": "4"}, lambda m, **k: None)
    with pytest.raises(UsageError, match="a sweep needs --folder"):
        element.from_sweep(argv[:2] + argv[4:], {}, lambda m, **k: None)
    # A finished trial's element runs nothing.
    done = folder / "lr=0.1,seed=1"
    done.mkdir()
    attempts.append(
        done,
        {"event": "end", "job": "9_0", "restart": 0, "time": 1.0, "outcome": "completed", "decision": "done"},
    )
    assert element.from_sweep(argv, {"SLURM_ARRAY_TASK_ID": "0"}, lambda m, **k: said.append(m)) == []
    assert said[-1] == "[sweep] element 0: trial lr=0.1,seed=1: finished"


def scripted(polls: list[dict[str, str]], calls: list[tuple[str, ...]]) -> SlurmClient:
    """A cluster whose elements are in the given states poll after poll (RUNNING, PENDING: queued; an ended
    word: only in accounting), the last poll's states thereafter."""
    asked = {"squeue": 0, "sacct": 0}

    def runner(argv: Sequence[str], timeout_s: float) -> proc.Output:
        calls.append(tuple(argv))
        now = polls[min(asked[argv[0]], len(polls) - 1)]
        asked[argv[0]] += 1
        if argv[0] == "squeue":
            return proc.Output(
                "".join(f"{j}|{s}|None\n" for j, s in now.items() if s in ("PENDING", "RUNNING"))
            )
        return proc.Output("".join(f"{j}|{s}|0:0|None\n" for j, s in now.items()))

    return SlurmClient(runner=runner)


@pytest.mark.parametrize("trials", [4, 64, 512])
def test_following_a_sweep_asks_slurm_twice_per_poll_whatever_its_size(tmp_path: Path, trials: int) -> None:
    _, folder, decisions = prepare(tmp_path / "sweep", f"seed={','.join(map(str, range(trials)))}")
    submitted = [(d.trial, f"7_{i}") for i, d in enumerate(decisions)]
    polls = [
        {f"7_{i}": "PENDING" for i in range(trials)},
        {f"7_{i}": "RUNNING" if i == 0 else "PENDING" for i in range(trials)},
        {f"7_{i}": "COMPLETED" for i in range(trials)},
    ]
    calls: list[tuple[str, ...]] = []
    lines: list[str] = []
    sleeps: list[float] = []
    code = follow.follow(
        folder, decisions, submitted, scripted(polls, calls), lines.append, sleeps.append, 5.0
    )
    polled = len(sleeps) + 1
    assert [c[0] for c in calls] == ["squeue", "sacct"] * polled and polled == 2 + follow.GONE_POLLS
    assert all(c[-1] == "7" for c in calls)  # the array's id once, not one per element
    changes = [line for line in lines if "(job 7_" in line]
    assert len(changes) == 2 * trials + 1  # PENDING and COMPLETED for each, RUNNING for one
    assert "[sweep] trial seed=0 (job 7_0): RUNNING" in lines
    assert lines[-1].splitlines()[0].split() == [
        "trial",
        "state",
        "steps",
        "final",
        "loss",
        "best",
        "loss",
        "attempts",
        "first",
        "cause",
    ]
    assert code == exitcodes.FAILED  # Slurm said COMPLETED, but no trial recorded a finished run


def test_an_element_whose_batch_shell_died_is_settled_and_followed_again_once_requeued(
    tmp_path: Path,
) -> None:
    """--wait's `settle` (hpc_ddp.launch.slurm.lost.settle_open on the real path) is asked about an element only
    once Slurm no longer runs it (ended, or pending again), never about a running one; one it requeued is
    followed again to its end (the real story: tests/test_sweep_slurm.py)."""
    _, folder, decisions = prepare(tmp_path / "sweep", "seed=0,1")
    submitted = [(d.trial, f"7_{i}") for i, d in enumerate(decisions)]
    polls = [
        {"7_0": "RUNNING", "7_1": "PENDING"},
        {"7_0": "FAILED", "7_1": "PENDING"},  # its batch shell's node lost: no record of its end
        {"7_0": "PENDING", "7_1": "PENDING"},  # requeued by the settle
        {"7_0": "COMPLETED", "7_1": "COMPLETED"},
    ]
    asked: list[tuple[str, str]] = []
    calls: list[tuple[str, ...]] = []

    def settle(trial: object, job: str) -> tuple[bool, list[str]]:
        now = polls[min(sum(c[0] == "squeue" for c in calls), len(polls)) - 1][job]  # this poll's state
        asked.append((job, now))
        return (
            (True, ["attempt 1 node_fail on node1: requeued"])
            if (job, now) == ("7_0", "FAILED")
            else (False, [])
        )

    lines: list[str] = []
    follow.follow(
        folder, decisions, submitted, scripted(polls, calls), lines.append, lambda s: None, 5.0, settle
    )
    assert ("7_0", "RUNNING") not in asked  # a running element is never asked about
    assert ("7_0", "FAILED") in asked and ("7_1", "PENDING") in asked
    assert "[sweep] trial seed=0 (job 7_0): attempt 1 node_fail on node1: requeued" in lines
    said = [line for line in lines if "(job 7_0): " in line]
    assert said.index("[sweep] trial seed=0 (job 7_0): REQUEUED") < said.index(
        "[sweep] trial seed=0 (job 7_0): COMPLETED"
    ), said


def test_the_table_and_exit_code_come_from_each_trials_records(tmp_path: Path) -> None:
    _, folder, decisions = prepare(tmp_path / "sweep", "seed=1,2,3")
    ends = [
        ("completed", "done", ""),
        ("nonfinite", "stop", "loss is nan at step 3"),
        ("preempted", "stop", ""),
    ]
    for d, (outcome, decision, reason) in zip(decisions, ends, strict=True):
        d.trial.folder.mkdir(parents=True)
        attempts.append(
            d.trial.folder,
            {
                "event": "end",
                "job": "7_0",
                "restart": 0,
                "time": 1.0,
                "outcome": outcome,
                "decision": decision,
                "reason": reason,
                "step": 3,
            },
        )
        (d.trial.folder / "metrics.jsonl").write_text(
            '{"event": "step", "step": 1, "loss": 2.0}\n{"event": "step", "step": 2, "loss": 1.0}\n'
            '{"event": "step", "step": 3, "loss": 1.5}\n{"event": "step", "st'
        )
    lines: list[str] = []
    code = follow.report(decisions, lines.append)
    assert code == exitcodes.NONFINITE
    rows = [line.split("  ") for line in lines[0].splitlines()[1:]]
    table = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert table[0] == ["seed=1", "finished", "3", "1.5", "1", "1", "-"]
    assert table[1] == ["seed=2", "failed (nonfinite)", "3", "1.5", "1", "1", "loss is nan at step 3"]
    assert table[2][:2] == ["seed=3", "unfinished (preempted)"]
    assert summary.exit_code(state.TrialState(state.NEW)) == exitcodes.FAILED


def test_the_benchs_following_figure_is_two_slurm_calls_per_poll() -> None:
    from hpc_ddp.bench import sweeping

    assert sweeping.polls(512) == {"polls": 2 + follow.GONE_POLLS, "calls_per_poll": 2.0}


def test_a_trial_whose_job_is_still_queued_is_not_submitted_again_but_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    launch, folder, decisions = prepare(tmp_path / "sweep", "lr=0.1,0.2")
    waiting = decisions[0].trial.folder
    waiting.mkdir(parents=True)
    attempts.append(
        waiting,
        {
            "event": "end",
            "job": "40_0",
            "restart": 0,
            "time": 1.0,
            "outcome": "preempted",
            "decision": "requeue",
        },
    )
    asked: list[list[str]] = []

    class Cluster:
        def max_array_size(self) -> None:
            return None

        def queued(self, jobs: Sequence[str]) -> dict:
            asked.append(list(jobs))
            return {"40_0": ("PENDING", "BeginTime")}

        def submit_array(
            self, job: slurm_submit.Submission, calls: list, parallel: int, after: str | None = None
        ) -> list[str]:
            assert after is None  # one array: it waits for nothing
            return [f"41_{i}" for i in range(len(calls))]

    monkeypatch.setattr(slurm_submit, "check_submit_host", lambda: None)
    monkeypatch.setattr(submitter, "_client", Cluster)
    done, _ = array.submit(launch, folder, decisions, SweepArgs(("lr=0.1,0.2",)), BASE)
    assert asked == [["40_0"]]  # one squeue for every trial that may still run
    assert [(t.name, job) for t, job in done] == [("lr=0.2", "41_0"), ("lr=0.1", "40_0")]
    out = capsys.readouterr().out
    assert "[sweep] trial lr=0.1: still queued as job 40_0; it resumes by itself (not submitted again)" in out
    assert "[sweep] trial lr=0.2: submitted as job 41_0" in out and "lr=0.1: submitted" not in out


def test_trials_running_at_once_get_job_ids_of_different_ports() -> None:
    from hpc_ddp.cluster.env import PORT_SPAN
    from hpc_ddp.launch.sweep import local

    drawn = iter(["1", str(1 + PORT_SPAN), "1", "2"])  # the second and third land on the first's port
    ids = local.job_ids(2, lambda: next(drawn))
    assert ids == ["1", "2"] and len({port_for_job(i) for i in ids}) == 2


def test_sweep_flags_without_a_sweep_are_refused() -> None:
    from hpc_ddp import submit

    with pytest.raises(UsageError, match="--sweep-parallel and --sweep-retry-failed go with --sweep"):
        submit.main(["--local", "--sweep-parallel", "2"])
    with pytest.raises(UsageError, match="--sweep-offset is slurm/ddp.sbatch's"):
        submit.main(["--local", "--sweep", "lr=1", "--sweep-offset", "3"])


def test_a_split_sweep_without_sweep_parallel_runs_its_arrays_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --sweep-parallel: nothing to hold, each array of a split sweep is submitted to run at once."""
    launch, folder, decisions = prepare(tmp_path / "sweep", "lr=0.1,0.2,0.3")
    arrays: list[tuple[str, int, int]] = []
    monkeypatch.setattr(slurm_submit, "check_submit_host", lambda: None)
    monkeypatch.setattr(submitter, "_client", split_cluster(arrays))
    done, code = array.submit(launch, folder, decisions, SweepArgs(("lr=0.1,0.2,0.3",)), BASE)
    afters = ["--dependency" in script for script, _, _ in arrays]
    assert code == exitcodes.OK and len(done) == 3 and afters == [False, False]
