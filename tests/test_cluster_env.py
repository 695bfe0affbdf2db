"""Tables for `hpc_ddp.cluster.env.detect` and the port rule.

Slurm cases start from the real environments captured on the local Slurm cluster (tests/data/slurm_env/*.json,
see env/slurm/README.md), so the step-vs-job precedence is checked against what Slurm really sets, not against
what we believe it sets. Error cases are small edits of those captures, matched by message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.cluster.env import PORT_SPAN, ClusterConfigError, DistEnv, detect, port_for_job

SLURM_ENV = Path(__file__).resolve().parent / "data" / "slurm_env"


def captured(name: str, drop: tuple[str, ...] = (), **changes: str) -> dict[str, str]:
    """A real captured environment, minus `drop`, with `changes` applied."""
    env = json.loads((SLURM_ENV / f"{name}.json").read_text())
    for key in drop:
        env.pop(key)
    env.update(changes)
    return env


def slurm(
    rank: int,
    local_rank: int,
    world: int,
    local_world: int,
    node: int,
    nodes: tuple[str, ...],
    job: str,
    addr: str | None = None,
    **kw: object,
) -> DistEnv:
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=len(nodes),
        master_addr=addr or nodes[0],
        master_port=port_for_job(job),
        job_id=job,
        launcher="slurm",
        nodes=nodes,
        **kw,
    )  # type: ignore[arg-type]


N12 = ("node1", "node2")

# Every captured srun step, and the exact DistEnv it must give.
CAPTURED_STEPS = {
    # sbatch -N2 --ntasks-per-node=2; srun (all 4 tasks)
    "step_2x2_rank0": slurm(0, 0, 4, 2, 0, N12, "10"),
    "step_2x2_rank3": slurm(3, 1, 4, 2, 1, N12, "10"),
    # srun -N1 -n1: SLURM_NTASKS=1, SLURM_NNODES=1, but SLURM_JOB_NUM_NODES=2 and SLURM_NODELIST=node[1-2]
    "step_partial_1x1": slurm(0, 0, 1, 1, 0, ("node1",), "10"),
    # srun -n3: SLURM_STEP_TASKS_PER_NODE=2,1; rank 2 is alone on node2
    "step_uneven_n3_rank2": slurm(2, 0, 3, 1, 1, N12, "10"),
    # srun -N1 -n1 -w node2: SLURM_NODEID=0 (step-relative), the step's only node is node2 and hosts rank 0
    "step_node2_1x1": slurm(0, 0, 1, 1, 0, ("node2",), "8"),
    # srun -N1 -n2 -w node2: two ranks on node2, which is node 0 of the step and the rendezvous host
    "step_node2_1x2_rank1": slurm(1, 1, 2, 2, 0, ("node2",), "8"),
    # srun -N2 -n2 inside a 2x2 allocation: one task per node, SLURM_TASKS_PER_NODE=1(x2)
    "step_2x1_rank1": slurm(1, 0, 2, 1, 1, N12, "8"),
}


@pytest.mark.parametrize("name", sorted(CAPTURED_STEPS))
def test_captured_srun_steps(name: str) -> None:
    assert detect(captured(name)) == CAPTURED_STEPS[name]


def test_captures_have_the_job_level_values_that_must_lose() -> None:
    # Guards the point of the step captures: the job-level variables really disagree with the step.
    env = captured("step_node2_1x1")
    assert (env["SLURM_JOB_NUM_NODES"], env["SLURM_NODELIST"], env["SLURM_NODEID"]) == ("2", "node[1-2]", "0")
    assert env["SLURM_STEP_NODELIST"] == "node2"


def test_torchrun_inside_srun_wins_over_slurm() -> None:
    # srun -N2 -n2 torchrun --nnodes 2 --nproc-per-node 2: SLURM_PROCID=1, SLURM_NTASKS=2 describe the agents.
    env = captured("torchrun_in_srun_rank3")
    assert (env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]) == ("1", "2")
    assert detect(env) == DistEnv(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        num_nodes=2,
        master_addr="node1",
        master_port=45287,
        job_id="11",
        launcher="torchrun",
    )


TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "host-a",
    "MASTER_PORT": "29500",
}


def test_torchrun_plain() -> None:
    assert detect(TORCHRUN) == DistEnv(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        num_nodes=2,
        master_addr="host-a",
        master_port=29500,
        job_id="abc",
        launcher="torchrun",
    )


def test_torchrun_without_group_world_size_derives_nodes() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != "GROUP_WORLD_SIZE"}
    assert detect(env).num_nodes == 2


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"RANK": "8"}, r"RANK=8 WORLD_SIZE=8 .*out of range"),
        ({"LOCAL_RANK": "4"}, r"LOCAL_RANK=4 LOCAL_WORLD_SIZE=4.*out of range"),
        ({"RANK": "x"}, r"RANK='x' is not a non-negative integer"),
        ({"MASTER_ADDR": ""}, r"MASTER_ADDR is not set"),
        ({"MASTER_PORT": "p"}, r"MASTER_PORT='p' is not a non-negative integer"),
        ({"GROUP_WORLD_SIZE": "two"}, r"GROUP_WORLD_SIZE='two' is not a non-negative integer"),
        ({"GROUP_RANK": "2"}, r"GROUP_RANK=2 but there are 2 nodes"),
        ({"WORLD_SIZE": ""}, r"WORLD_SIZE is not set"),
    ],
)
def test_torchrun_errors(changes: dict[str, str], match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        detect({**TORCHRUN, **changes})


# --- outside srun -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, found, count",
    [
        ("batch_2x2", "SLURM_NTASKS=4", 4),  # sbatch -N2 --ntasks-per-node=2, the batch shell itself
        ("batch_N2_no_ntasks", r"SLURM_TASKS_PER_NODE=1\(x2\)", 2),  # sbatch -N2: no SLURM_NTASKS at all
    ],
)
def test_batch_shell_with_several_tasks_says_use_srun(name: str, found: str, count: int) -> None:
    with pytest.raises(
        ClusterConfigError,
        match=rf"\({found}\) but outside srun.*1 process instead of {count}.*`srun python -m hpc_ddp.train",
    ):
        detect(captured(name))


def test_batch_shell_fallback_to_node_count() -> None:
    env = captured("batch_N2_no_ntasks", drop=("SLURM_TASKS_PER_NODE",))
    with pytest.raises(ClusterConfigError, match=r"SLURM_JOB_NUM_NODES=2.*instead of 2"):
        detect(env)


def test_one_task_batch_job_is_a_single_process() -> None:
    # sbatch -n1: the batch shell is the whole job.
    assert detect(captured("batch_1task")) == DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=0,
        job_id="10",
        launcher="single",
    )


SINGLE = DistEnv(
    rank=0,
    local_rank=0,
    world_size=1,
    local_world_size=1,
    node_rank=0,
    num_nodes=1,
    master_addr="127.0.0.1",
    master_port=0,
    job_id=None,
    launcher="single",
)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"HOME": "/root", "PATH": "/usr/bin"},
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"},  # leftovers that agree with one process
        {"RANK": "", "WORLD_SIZE": ""},
        {"TORCHELASTIC_RUN_ID": ""},  # empty: not torchrun
    ],
)
def test_single_process(environ: dict[str, str]) -> None:
    assert detect(environ) == SINGLE


def test_single_process_with_explicit_rendezvous() -> None:
    env = detect({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"})
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.1", 12345, "single")
    assert [o.split(" ")[0] for o in env.overrides] == ["MASTER_ADDR=10.0.0.1", "MASTER_PORT=12345"]


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"WORLD_SIZE": "4"}, r"WORLD_SIZE=4 is set but no launcher is detected.*unset WORLD_SIZE"),
        ({"RANK": "2"}, r"RANK=2 is set but this is a single process.*unset RANK"),
        ({"LOCAL_RANK": "1"}, r"LOCAL_RANK=1 is set but this is a single process"),
        # SLURM_PROCID without a step id: a batch shell, not a task. Two tasks expected: refuse.
        ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, r"outside srun"),
    ],
)
def test_single_process_errors(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        detect(environ)


# --- leftovers and overrides on the Slurm path -----------------------------------------------------------------


@pytest.mark.parametrize(
    "var, value, slurm_value",
    [("RANK", "0", "3"), ("WORLD_SIZE", "8", "4"), ("LOCAL_RANK", "0", "1"), ("LOCAL_WORLD_SIZE", "4", "2")],
)
def test_leftover_that_disagrees_is_an_error(var: str, value: str, slurm_value: str) -> None:
    field = dist_env.TORCH_RANK_VARS[var]
    with pytest.raises(
        ClusterConfigError,
        match=rf"^{var}={value} is set in the environment but Slurm says {field}={slurm_value}.*"
        rf"unset {var}",
    ):
        detect(captured("step_2x2_rank3", **{var: value}))


def test_leftovers_that_agree_are_fine() -> None:
    env = captured("step_2x2_rank3", RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    assert detect(env) == CAPTURED_STEPS["step_2x2_rank3"]


def test_empty_leftover_counts_as_unset() -> None:
    assert detect(captured("step_2x2_rank3", RANK="")) == CAPTURED_STEPS["step_2x2_rank3"]


@pytest.mark.parametrize(
    "changes, addr, port, overrides",
    [
        (
            {"MASTER_ADDR": "ib-node1"},
            "ib-node1",
            port_for_job("10"),
            ["MASTER_ADDR=ib-node1 (derived: node1)"],
        ),
        ({"MASTER_PORT": "23456"}, "node1", 23456, [f"MASTER_PORT=23456 (derived: {port_for_job('10')})"]),
        (
            {"MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "a",
            1,
            ["MASTER_ADDR=a (derived: node1)", f"MASTER_PORT=1 (derived: {port_for_job('10')})"],
        ),
        # Equal to the derived values: nothing was overridden.
        ({"MASTER_ADDR": "node1", "MASTER_PORT": str(port_for_job("10"))}, "node1", port_for_job("10"), []),
    ],
)
def test_explicit_rendezvous_wins_and_is_listed(
    changes: dict[str, str], addr: str, port: int, overrides: list[str]
) -> None:
    env = detect(captured("step_2x2_rank3", **changes))
    assert (env.master_addr, env.master_port, list(env.overrides)) == (addr, port, overrides)
    assert (env.rank, env.world_size) == (3, 4)


# --- precedence when only some variables are present -----------------------------------------------------------


def test_without_step_variables_the_task_level_ones_are_used() -> None:
    # Only SLURM_STEP_* dropped: SLURM_NTASKS / SLURM_NNODES / SLURM_TASKS_PER_NODE are the step's inside srun.
    step_only = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE")
    assert detect(captured("step_uneven_n3_rank2", drop=step_only)) == CAPTURED_STEPS["step_uneven_n3_rank2"]


def test_partial_step_without_step_nodelist_is_an_error_not_the_job_nodelist() -> None:
    # SLURM_NODELIST is the job's (node[1-2]) even in a 1-node step: using it would be wrong, so say so.
    with pytest.raises(
        ClusterConfigError, match=r"SLURM_JOB_NODELIST=node\[1-2\] names 2 hosts but the step has 1"
    ):
        detect(captured("step_node2_1x1", drop=("SLURM_STEP_NODELIST",)))


def test_job_num_nodes_is_the_last_resort() -> None:
    env = captured("step_partial_1x1", drop=("SLURM_STEP_NUM_NODES",))
    assert detect(env).num_nodes == 1  # SLURM_NNODES=1, not SLURM_JOB_NUM_NODES=2


def test_without_tasks_per_node_an_even_split_is_assumed() -> None:
    env = captured("step_2x2_rank3", drop=("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    assert detect(env) == CAPTURED_STEPS["step_2x2_rank3"]


def test_jobid_alias() -> None:
    env = captured("step_2x2_rank0", drop=("SLURM_JOB_ID",))
    assert detect(env).job_id == "10"


# --- errors on the Slurm path ----------------------------------------------------------------------------------

NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@pytest.mark.parametrize(
    "base, changes, drop, match",
    [
        (
            "step_2x2_rank3",
            {"SLURM_PROCID": "three"},
            (),
            r"SLURM_PROCID='three' is not a non-negative integer",
        ),
        ("step_2x2_rank3", {"SLURM_LOCALID": "-1"}, (), r"SLURM_LOCALID=-1 is negative"),
        ("step_2x2_rank3", {"SLURM_STEP_NUM_TASKS": "4.0"}, (), r"SLURM_STEP_NUM_TASKS='4.0' is not"),
        ("step_2x2_rank3", {"SLURM_NODEID": "\u0661"}, (), r"SLURM_NODEID='\u0661' is not"),  # Arabic-Indic 1
        ("step_2x2_rank3", {}, ("SLURM_LOCALID",), r"SLURM_LOCALID is not set.*srun"),
        (
            "step_2x2_rank3",
            {"SLURM_PROCID": "4"},
            (),
            r"SLURM_PROCID=4 but the step has 4 tasks \(SLURM_STEP_NUM_TASKS\): rank must be < world size",
        ),
        (
            "step_2x2_rank3",
            {"SLURM_LOCALID": "2"},
            (),
            r"SLURM_LOCALID=2 but node 1 runs 2 tasks of this step \(SLURM_STEP_TASKS_PER_NODE=2\(x2\)\)",
        ),
        ("step_uneven_n3_rank2", {"SLURM_LOCALID": "1"}, (), r"SLURM_LOCALID=1 but node 1 runs 1 tasks"),
        ("step_2x2_rank3", {"SLURM_NODEID": "2"}, (), r"SLURM_NODEID=2 but the step has 2 nodes"),
        (
            "step_2x2_rank3",
            {"SLURM_STEP_NODELIST": "node[1-3]"},
            (),
            r"SLURM_STEP_NODELIST=node\[1-3\] names 3 hosts but the step has 2 nodes",
        ),
        ("step_2x2_rank3", {"SLURM_STEP_NUM_NODES": "3"}, (), r"names 2 hosts but the step has 3 nodes"),
        (
            "step_2x2_rank3",
            {"SLURM_STEP_NODELIST": "node[1-"},
            (),
            r"SLURM_STEP_NODELIST: invalid Slurm hostlist 'node\[1-'",
        ),
        (
            "step_2x2_rank3",
            {"SLURM_STEP_TASKS_PER_NODE": "2(x"},
            (),
            r"SLURM_STEP_TASKS_PER_NODE: invalid Slurm tasks-per-node '2\(x'",
        ),
        (
            "step_2x2_rank3",
            {"SLURM_STEP_TASKS_PER_NODE": "3,3"},
            (),
            r"=3,3 does not add up to 4 tasks on 2 nodes",
        ),
        ("step_2x2_rank3", {"SLURM_STEP_NUM_TASKS": "0", "SLURM_PROCID": "0"}, (), r"0 tasks on 2 nodes"),
        ("step_2x2_rank3", {"MASTER_PORT": "http"}, (), r"MASTER_PORT='http' is not an integer"),
        ("step_2x2_rank3", {"MASTER_PORT": "70000"}, (), r"MASTER_PORT=70000 is outside 1-65535"),
        # World > 1 and no node list: never fall back to localhost (each node would form its own world).
        ("step_2x2_rank3", {}, NODELIST_VARS, r"cannot find the rendezvous host.*MASTER_ADDR"),
    ],
)
def test_slurm_errors(base: str, changes: dict[str, str], drop: tuple[str, ...], match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        detect(captured(base, drop=drop, **changes))


def test_no_nodelist_is_fine_for_one_task_and_with_explicit_master_addr() -> None:
    one = detect(captured("step_partial_1x1", drop=NODELIST_VARS))
    assert (one.master_addr, one.world_size) == ("127.0.0.1", 1)
    four = detect(captured("step_2x2_rank3", drop=NODELIST_VARS, MASTER_ADDR="head"))
    assert (four.master_addr, four.nodes) == ("head", ())


def test_error_is_a_usage_error() -> None:
    from hpc_ddp.errors import UsageError

    assert issubclass(ClusterConfigError, UsageError)  # entry points print it as one line, exit 2


def test_detect_reads_only_the_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in captured("step_2x2_rank3").items():
        monkeypatch.setenv(key, value)
    assert detect({}) == SINGLE


def test_torch_env() -> None:
    env = CAPTURED_STEPS["step_2x2_rank3"]
    assert env.torch_env() == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": str(port_for_job("10")),
    }
    assert not env.is_main and CAPTURED_STEPS["step_2x2_rank0"].is_main


# --- the port rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job_id",
    [
        "0",
        "1",
        "10",
        "22767",
        "22768",
        "4294967295",
        "123_4",
        "123+1",
        "abc",
        "",
        "none",
        "12\u00b2",
        "\u0661\u0662",
    ],
)
def test_port_is_stable_and_in_range(job_id: str) -> None:
    port = port_for_job(job_id)
    assert port == port_for_job(job_id)
    assert 1024 <= port < 32768


def test_port_span_reaches_the_ephemeral_floor() -> None:
    assert dist_env.PORT_BASE >= 1024 and dist_env.PORT_BASE + PORT_SPAN == 32768
    assert port_for_job(str(PORT_SPAN - 1)) == 32767 and port_for_job(str(PORT_SPAN)) == dist_env.PORT_BASE


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("123+0", "123+1", True),  # het-job components form one world: one port
        ("123+0", "123", True),
        ("123_4", "123_5", False),  # array tasks are separate jobs that may share a node
        ("123_4", "127", True),  # ... each numbered like a job id: array job + task index
        ("10010", "20010", False),  # a last-4-digits rule would alias these
        ("12345", "22345", False),
    ],
)
def test_port_array_and_het_forms(a: str, b: str, same: bool) -> None:
    assert (port_for_job(a) == port_for_job(b)) is same


@given(st.integers(min_value=0, max_value=10**12), st.integers(min_value=1, max_value=PORT_SPAN - 1))
def test_ids_closer_than_the_span_never_collide(job: int, delta: int) -> None:
    assert port_for_job(str(job)) != port_for_job(str(job + delta))


@given(st.text(max_size=20))
def test_any_id_gives_a_valid_port(job_id: str) -> None:
    assert 1024 <= port_for_job(job_id) < 32768


def test_rank0_not_on_the_first_node_fails_fast_instead_of_hanging() -> None:
    env = json.loads((SLURM_ENV / "step_2x2_rank0.json").read_text())
    env["SLURMD_NODENAME"] = "node2"
    with pytest.raises(ClusterConfigError, match="rank 0 runs on node2 but the rendezvous host is node1"):
        dist_env.detect(env)
    env["SLURMD_NODENAME"] = "node1"
    assert dist_env.detect(env).master_addr == "node1"
    env.update(SLURMD_NODENAME="node2", MASTER_ADDR="node2")  # the documented fix
    assert dist_env.detect(env).master_addr == "node2"


def test_every_variable_detect_reads_is_one_that_launchers_remove() -> None:
    """One table: what `detect` reads, `torch_env` writes and `without_launcher` removes are the same names."""
    read = {
        name
        for table in (dist_env.SLURM_VARS, dist_env.TORCHRUN_VARS)
        for names in table.values()
        for name in names
    }
    assert all(
        dist_env.is_launcher_var(name)
        for name in read
        | set(
            DistEnv(
                rank=0,
                local_rank=0,
                world_size=1,
                local_world_size=1,
                node_rank=0,
                num_nodes=1,
                master_addr="h",
                master_port=1,
                job_id=None,
                launcher="single",
            ).torch_env()
        )
    )
    outer = {
        "SLURM_PROCID": "1",
        "SRUN_CPUS_PER_TASK": "3",
        "SLURMD_NODENAME": "n1",
        "SALLOC_X": "1",
        "SUBMITIT_EXECUTOR": "slurm",
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_WORLD_SIZE": "2",
        "RANK": "1",
        "HPC_DDP_FOLDER_FILE": "/tmp/f",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SBATCH_ACCOUNT": "proj",
        "OMP_NUM_THREADS": "4",
        "PATH": "/usr/bin",
    }
    assert dist_env.without_launcher(outer) == {
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SBATCH_ACCOUNT": "proj",
        "OMP_NUM_THREADS": "4",
        "PATH": "/usr/bin",
    }


# --- which start of the job, on which node (DistEnv.restart, DistEnv.node) ------------------------------------


@pytest.mark.parametrize(
    "environ, restart",
    [
        ({}, 0),
        ({"SLURM_RESTART_COUNT": "2"}, 2),  # a requeued Slurm job, the local launcher's third start
        ({"SLURM_RESTART_COUNT": "x"}, 0),
        (
            {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"},
            1,
        ),
        # torchrun inside a requeued Slurm job: each requeue makes room for torchrun's rounds (here 4).
        (
            {
                "TORCHELASTIC_RUN_ID": "r",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "3",
                "SLURM_RESTART_COUNT": "1",
            },
            4,
        ),
    ],
)
def test_restart_count(environ: dict[str, str], restart: int) -> None:
    assert dist_env.restart_count(environ) == restart


def test_detect_knows_its_restart_and_its_node() -> None:
    """Before: six readers, three meanings; under torchrun a round after the first counted as a first start."""
    torchrun = detect(
        {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}, "host-b"
    )
    assert (torchrun.restart, torchrun.is_restart, torchrun.node) == (1, True, "host-b")
    step = captured("step_2x2_rank3")
    slurm = detect({**step, "SLURM_RESTART_COUNT": "3", "SLURMD_NODENAME": "node2"}, "node2.cluster")
    assert (slurm.restart, slurm.node) == (3, "node2")  # the scheduler's name: what ExcNodeList takes
    assert detect(step, "here").node == "here" and not detect(step).is_restart
