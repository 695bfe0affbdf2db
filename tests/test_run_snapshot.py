"""Snapshots in memory (hpc_ddp.run.snapshot, issue 45): the node's store (generations, checksums, torn files),
the restart's choice (every rank must reach the step; own memory first, else a buddy's replica), the buddies,
the options; and one real local run whose rank is SIGKILLed and whose node lost its memory, resumed from memory
bitwise equal to the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DETERMINISTIC_2X1, local_checkpoints

from hpc_ddp.errors import UsageError
from hpc_ddp.ledger import attempts
from hpc_ddp.run.snapshot import plan, store
from hpc_ddp.run.snapshot.options import SnapshotOptions, memory_limit

KEY = store.run_key("/some/run")


def _put(directory: Path, kind: str, rank: int, step: int, payload: bytes = b"state", job: str = "7") -> Path:
    header = {"job": job, "node": directory.name, "rank": rank, "step": step, "world_size": 2, "kind": kind}
    return store.write(directory, KEY, header, payload)


# ----- the store ----------------------------------------------------------------------------------------------
def test_a_snapshot_reads_back_whole_and_two_generations_are_kept(tmp_path: Path) -> None:
    node = store.node_dir(tmp_path, "7", "node1")
    for step in (1, 2, 3):
        _put(node, store.OWN, 0, step, f"state {step}".encode())
    _put(node, store.COPY, 1, 3)
    held = store.inventory(node, KEY, "7")
    assert [(h.kind, h.rank, h.step) for h in held] == [
        (store.OWN, 0, 2),
        (store.OWN, 0, 3),
        (store.COPY, 1, 3),
    ]
    header, payload = store.read(held[1].path)
    assert payload == b"state 3" and header["step"] == 3 and len(header["sha256"]) == 64
    assert [n for n in sorted(p.name for p in node.iterdir()) if ".tmp" in n] == []  # nothing left over


def test_a_torn_snapshot_is_never_read_the_generation_before_it_stands(tmp_path: Path) -> None:
    node = tmp_path / "node1"
    _put(node, store.OWN, 0, 4, b"older")
    newest = _put(node, store.OWN, 0, 5, b"newer")
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF  # a bit changed: the checksum says so
    newest.write_bytes(bytes(data))
    warned: list[str] = []
    assert [h.step for h in store.inventory(node, KEY, "7", warned.append)] == [4]
    assert "checksum" in warned[0]
    newest.write_bytes(bytes(data[:-3]))  # cut short (killed mid-copy, renamed by hand): not whole
    with pytest.raises(store.Torn, match="bytes of payload"):
        store.read(newest)
    (node / f".{newest.name}.tmp-1-2").write_bytes(b"HPCDDP")  # a temporary is never listed
    assert [h.step for h in store.inventory(node, KEY, "7")] == [4]


def test_another_jobs_or_runs_snapshot_is_never_offered(tmp_path: Path) -> None:
    node = tmp_path / "node1"
    _put(node, store.OWN, 0, 4, job="8")  # renamed into this job's folder: its header says whose it is
    assert store.inventory(node, KEY, "7") == []
    assert store.inventory(node, store.run_key("/another/run"), "8") == []


def test_cleanup_removes_the_runs_snapshots_then_the_empty_folders(tmp_path: Path) -> None:
    node = store.node_dir(tmp_path, "7", "node1")
    _put(node, store.OWN, 0, 1)
    _put(node, store.COPY, 1, 1)
    other = store.write(
        node, store.run_key("/another/run"), {"job": "7", "rank": 0, "step": 1, "kind": "own"}, b""
    )
    store.remove_run(node, KEY)
    assert store.inventory(node, KEY, "7") == [] and other.is_file()  # another run's stays, and its folder
    other.unlink()
    store.remove_run(node, KEY)
    assert not store.job_dir(tmp_path, "7").exists()
    _put(node, store.OWN, 0, 1)
    assert store.remove_job(tmp_path, "7") and not store.job_dir(tmp_path, "7").exists()


def test_the_supervisor_sees_the_newest_step_every_rank_has(tmp_path: Path) -> None:
    one, two = store.node_dir(tmp_path, "7", "n1"), store.node_dir(tmp_path, "7", "n2")
    _put(one, store.OWN, 0, 5)
    _put(one, store.OWN, 0, 6)
    _put(two, store.COPY, 0, 6)
    _put(two, store.OWN, 1, 5)
    assert store.newest_reachable(tmp_path, "7", KEY) == 5  # rank 1's step 6 never came
    assert store.newest_reachable(tmp_path, "8", KEY) is None


# ----- the choice ---------------------------------------------------------------------------------------------
def _held(kind: str, rank: int, step: int, origin: str = "", world: int = 2) -> store.Held:
    return store.Held(kind, rank, step, world, f"{kind}{rank}@{step}", origin)


def test_the_newest_step_every_rank_reaches_wins_own_memory_first() -> None:
    both = plan.Report("n1", True, (_held("own", 0, 9), _held("own", 0, 10), _held("copy", 1, 9, "n2")))
    other = plan.Report("n2", True, (_held("own", 1, 9), _held("copy", 0, 9, "n1")))
    assert plan.choose([both, other], disk_step=5) == plan.Choice(9, (0, 1))  # step 10: rank 1 has none
    assert plan.choose([both, other], disk_step=9) is None  # no newer than the disk's: the disk
    replaced = plan.Report("n3", True, ())  # a spare in place of n2: rank 1's state is rank 0's replica
    assert plan.choose([both, replaced], disk_step=5) == plan.Choice(9, (0, 0))
    assert plan.choose([both, replaced], 5).from_buddies() == [1]
    assert plan.lost_nodes([both, replaced]) == ["n2"]
    emptied = plan.Report("n2", False, ())  # its folder deleted: its memory lost, not trusted
    assert plan.lost_nodes([both, emptied]) == ["n2"] and plan.lost_nodes([both, other]) == []
    both_lost = [plan.Report("n3", True, ()), plan.Report("n4", False, ())]  # both buddies lost: the disk
    assert plan.choose(both_lost, disk_step=-1) is None
    resized = plan.Report("n1", True, (_held("own", 0, 9, world=3),))
    assert plan.choose([resized, replaced], disk_step=-1) is None  # of another world size: never


def test_a_nodes_first_rank_reports_for_every_rank_of_the_node() -> None:
    """Only one rank a node reads (and checksums) the node's snapshots; its other ranks read their own."""
    first = plan.Report(
        "n1",
        True,
        (
            _held("own", 0, 3, world=4),
            _held("own", 1, 3, world=4),
            _held("copy", 2, 3, world=4),
            _held("copy", 3, 3, world=4),
        ),
    )
    second = plan.Report("n1", True, ())
    lost = plan.Report("n2", False, ())  # n2's memory gone: ranks 2 and 3 from n1's replicas
    assert plan.choose([first, second, lost, lost], disk_step=0) == plan.Choice(3, (0, 1, 0, 0))


def test_buddies_are_on_the_next_node_never_the_same() -> None:
    assert plan.buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert plan.buddies(["a", "b", "c"]) == [1, 2, 0]
    assert plan.buddies(["a", "a"]) == [None, None]  # one node: no other memory
    assert plan.senders(plan.buddies(["a", "a", "b", "b"]), 2) == [0]


def test_the_options_take_sizes_and_refuse_the_rest_in_one_line() -> None:
    assert SnapshotOptions().snapshot_every_steps == 0  # off by default
    assert memory_limit("8G") == 8 * 2**30 and memory_limit("512m") == 512 * 2**20
    assert memory_limit("auto", 1000) == 500 and memory_limit("auto") is None
    with pytest.raises(UsageError, match="--snapshot-memory-limit lots: expected auto or a size"):
        SnapshotOptions(snapshot_memory_limit="lots")
    with pytest.raises(UsageError, match="--snapshot-every-steps -1"):
        SnapshotOptions(snapshot_every_steps=-1)


# ----- a real run ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.deadline(150)
def test_a_rank_killed_with_its_nodes_memory_resumes_from_memory_bitwise(
    tmp_path: Path, uninterrupted_2x1: Path
) -> None:
    """Rank 1 deletes its node's snapshot folder and SIGKILLs itself in step 25 (epoch 1; the disk holds
    epoch 0's checkpoint, step 16): the restart resumes from memory, rank 0 from its own, rank 1 from its
    buddy's replica on node 0, at most 2 steps behind, and ends bitwise equal to the uninterrupted run; the
    job's snapshots are gone afterwards."""
    from test_launch_local import finish, start

    shm = tmp_path / "shm"
    folder = tmp_path / "killed"
    args = [*DETERMINISTIC_2X1, "--task", "snapshot_tasks:killed", "--snapshot-every-steps", "1"]
    env = {
        "SLOW_TASK_SLEEP_S": "0",
        "KILL_AT_STEP": "25",
        "LOSE_MEMORY": "1",
        "HPC_DDP_SNAPSHOT_DIR": str(shm),
    }
    code, out = finish(start(folder, *args, **env))
    assert code == 0, out
    assert "snapshots: the memory of 127.0.0.2 is gone (not trusted)" in out, out
    assert "rank(s) 1 from a buddy's replica" in out, out
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    (resumed,) = [r for r in records if r.get("event") == "resume"]
    assert (resumed["from"], resumed["own"], resumed["from_buddies"]) == ("memory", 1, [1])
    assert 22 <= resumed["step"] <= 24 and resumed["lost_steps"] <= 2, resumed
    first, second = attempts.read(folder)
    assert (first.outcome, second.outcome, second.resumed_from) == ("failed", "completed", resumed["step"])
    summary = [r for r in records if r.get("event") == "snapshots"][-1]
    assert summary["taken"] > 0 and summary["stall_s"] is not None
    expected = torch.load(uninterrupted_2x1 / "model.pth", weights_only=True)
    got = torch.load(folder / "model.pth", weights_only=True)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert not shm.exists() or list(shm.iterdir()) == []  # nothing left in memory


# ----- in process, on a real one-rank gloo group --------------------------------------------------------------
def _trainer(cfg, env, folder: Path):  # type: ignore[no-untyped-def]
    from hpc_ddp.log import RankLog
    from hpc_ddp.run import tasks
    from hpc_ddp.run.loop.trainer import Trainer

    torch.manual_seed(cfg.seed)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = cfg.with_folder(str(folder))
    return Trainer(cfg, env, torch.device("cpu"), tasks.build(cfg), RankLog(0), local_checkpoints(cfg))


@pytest.mark.deadline(120)
def test_a_restart_resumes_the_newest_whole_snapshot_a_torn_one_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots every step of a 6-step run (none at its last: the final save is the disk's); the newest, of
    step 5, torn (its bytes changed after the rename); a restart resumes the one of step 4, exactly the state
    of a run stopped there; the memory limit is checked at start, refused in one line."""
    import dataclasses

    from hpc_ddp.cluster import env as dist_env
    from hpc_ddp.cluster.group import process_group
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.snapshot import recover

    monkeypatch.setenv("HPC_DDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    single = dist_env.detect({})
    cfg = TrainConfig(epochs=1, max_steps=6, save_every_epochs=0, snapshot_every_steps=1)
    with process_group(single, torch.device("cpu")):
        with _trainer(cfg, single, tmp_path / "run") as trainer:
            trainer.run()
            node = trainer.snapshots.dir
        held = store.inventory(node, store.run_key(tmp_path / "run"), trainer.snapshots.job)
        assert [(h.kind, h.step) for h in held] == [(store.OWN, 4), (store.OWN, 5)]  # two generations
        data = bytearray(Path(held[-1].path).read_bytes())
        data[-8] ^= 1
        Path(held[-1].path).write_bytes(bytes(data))
        with _trainer(cfg, dataclasses.replace(single, restart=1), tmp_path / "run") as again:
            found = recover.resume(again, None)
            assert found is not None and (found.source, found.step, found.from_buddies) == ("memory", 4, [])
            resumed = {k: v.clone() for k, v in again.model.state_dict().items()}
            assert again.pos.step == 4
        with _trainer(dataclasses.replace(cfg, max_steps=4), single, tmp_path / "stopped") as stopped:
            stopped.run()
            assert all(torch.equal(v, stopped.model.state_dict()[k]) for k, v in resumed.items())
        small = dataclasses.replace(cfg, snapshot_memory_limit="1K")
        with pytest.raises(
            UsageError, match=r"snapshots would take .* over --snapshot-memory-limit 1K \(1 KiB\)"
        ):
            _trainer(small, single, tmp_path / "small")


@pytest.mark.deadline(120)
def test_under_fsdp_each_rank_keeps_its_shards_and_gets_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--strategy fsdp: a snapshot holds this rank's shards (its local tensors, the optimizer's too), laid
    out again as the strategy's DTensors on resume: exactly the state of a run stopped there."""
    import dataclasses

    from hpc_ddp.cluster import env as dist_env
    from hpc_ddp.cluster.group import process_group
    from hpc_ddp.run.config import TrainConfig
    from hpc_ddp.run.snapshot import recover

    monkeypatch.setenv("HPC_DDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    single = dist_env.detect({})
    monkeypatch.setenv("SLOW_TASK_SLEEP_S", "0")
    task = "slow_tasks:slow"  # dropout (the RNG) and momentum (the optimizer's state, sharded)
    cfg = TrainConfig(
        task=task, epochs=1, max_steps=4, save_every_epochs=0, snapshot_every_steps=1, strategy="fsdp"
    )

    def local(trainer):  # type: ignore[no-untyped-def]
        momentum = trainer.strategy.optimizer_state()["state"]
        state = {
            **trainer.model.state_dict(),
            **{k + ".m": v["momentum_buffer"] for k, v in momentum.items()},
        }
        assert all(hasattr(v, "to_local") for v in state.values())  # sharded: DTensors
        return {k: v.to_local().clone() for k, v in state.items()}

    with process_group(single, torch.device("cpu")):
        with _trainer(cfg, single, tmp_path / "run") as trainer:
            trainer.run()
        with _trainer(cfg, dataclasses.replace(single, restart=1), tmp_path / "run") as again:
            found = recover.resume(again, None)
            assert found is not None and (found.source, found.step) == ("memory", 3)
            resumed = local(again)
        with _trainer(dataclasses.replace(cfg, max_steps=3), single, tmp_path / "stopped") as stopped:
            stopped.run()
            expected = local(stopped)
    assert resumed.keys() == expected.keys() and len(expected) == 8  # 4 weights and biases, 4 momenta
    assert all(torch.equal(v, expected[k]) for k, v in resumed.items())


def test_the_recovery_bench_reports_the_memory_path_and_its_three_targets(tmp_path: Path) -> None:
    """`python -m hpc_ddp.bench recovery` (hpc_ddp/bench/memory.py: local runs, not run here): the memory
    path's figures become rows and targets, with or without a Slurm cluster for the other two paths."""
    from hpc_ddp.bench import report
    from hpc_ddp.bench.runs import Settings

    s = Settings(trials=1, steps=100, world_size=2, batch_size=8, work=tmp_path)
    trial = {"lost_steps": 1.0, "to_next_step_s": 3.0, "stall_fraction": 0.004}
    memory = {
        "task": "gpt",
        "disk_lost_steps": 25.0,
        "memory_lost_steps": 1.0,
        "disk_to_next_step_s": 4.0,
        "memory_to_next_step_s": 3.0,
        "memory_vs_disk": 0.75,
        "stall_fraction": 0.004,
        "trials": {"disk": [{"lost_steps": 25.0, "to_next_step_s": 4.0}], "memory": [trial]},
    }
    results = {"recovery": {"skipped": "no Slurm cluster answers (sinfo)", "memory": memory}}
    found = {t.name: (t.value, t.op, t.threshold, t.met) for t in report.targets(results)}
    assert found == {
        "recovery from memory: steps lost (worst)": (1.0, "<=", 1.0, True),
        "snapshot stall / step time": (0.004, "<=", 0.01, True),
        "recovery from memory / from disk, s": (0.75, "<=", 1.0, True),
    }
    assert [r[1:] for r in report.rows(results, s)] == [
        ("rank + its memory lost (gpt), steps lost: disk every 50", "25"),
        ("steps lost: snapshots every step (worst)", "1"),
        ("kill -> next step, from disk / from memory", "4.0 / 3.0 s"),
        ("snapshot stall / step time", "0.40 %"),
        ("skipped", "no Slurm cluster answers (sinfo)"),
    ]


def test_a_memory_trial_without_a_stall_figure_is_left_out_not_a_crash(tmp_path: Path) -> None:
    """A --quick trial whose resumed attempt took no snapshot before the run ended has no stall figure (the
    suite's quick bench once crashed on it with a TypeError): the trial is left out and the figure is nan."""
    import math

    from hpc_ddp.bench import report

    trials = {
        "disk": [{"lost_steps": 4.0, "to_next_step_s": 2.0}],
        "memory": [{"lost_steps": 0.0, "to_next_step_s": 1.5}],
    }
    memory = {
        "memory_lost_steps": 0.0,
        "memory_vs_disk": 0.75,
        "stall_fraction": float("nan"),
        "trials": trials,
    }
    found = {t.name: t for t in report.targets({"recovery": {"skipped": "no cluster", "memory": memory}})}
    stall = found["snapshot stall / step time"]
    assert math.isnan(stall.value) and stall.trials == () and not stall.met
    assert found["recovery from memory: steps lost (worst)"].trials == (0.0,)
