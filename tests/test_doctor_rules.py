"""The doctor's rules and report, table by table: fake ranks on fake machines, no system read."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hpc_ddp.cluster import env as dist_env
from hpc_ddp.doctor import collective, report, rules
from hpc_ddp.doctor import facts as probes
from hpc_ddp.doctor.facts import RankFacts
from hpc_ddp.doctor.rules import FAIL, PASS, WARN

V = {"torch": "2.13.0", "cuda": "12.4", "nccl": "2.21.5", "python": "3.11.7", "hpc_ddp": "0.1.0"}


def rank(r: int, machines: int = 2, **changes: object) -> RankFacts:
    """Rank r of a healthy 2 nodes x 2 ranks job; `machines=2`: node1 and node2 are separate machines."""
    node = r // 2
    own = (f"10.0.0.{node + 1}",) if machines == 2 else ("10.0.0.1",)
    base = RankFacts(
        rank=r,
        local_rank=r % 2,
        node_rank=node,
        world_size=4,
        local_world_size=2,
        launcher="slurm",
        host=f"node{node + 1}",
        machine=f"machine-{node if machines == 2 else 0}",
        netns="net:[1]",
        master_addr="node1",
        master_port=12345,
        master_ips=("10.0.0.1",),
        own_ips=own,
        interfaces=("lo", "eth0"),
        host_ips=own,
        port_error="" if r == 0 else None,
        affinity=(0, 1) if machines == 2 else (0, 1, 2, 3),
        cpus=(r % 2,),
        threads=1,
        thread_reason="2 CPUs split among 2 ranks",
        environ={"SLURM_STEP_ID": "0"},
        versions=V,
        slurm_version="22.05.8",
        folder="/shared/run",
        folder_marker="" if r == 0 else "seen",
    )
    return dataclasses.replace(base, **changes)


def world(machines: int = 2, **per_rank: dict) -> list[RankFacts]:
    """Four healthy ranks; per_rank={'r1': {...}} changes rank 1."""
    return [rank(r, machines, **per_rank.get(f"r{r}", {})) for r in range(4)]


def all_ranks(machines: int = 2, **changes: object) -> list[RankFacts]:
    return [rank(r, machines, **changes) for r in range(4)]


# ---- the rules --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("machines", [1, 2])
def test_a_healthy_world_passes_every_rule(machines: int) -> None:
    results = rules.evaluate(world(machines))
    assert [(c.name, c.status) for c in results if c.status != PASS] == []
    assert len(results) == len(rules.RULES)


@pytest.mark.parametrize(
    "local_rank, local_world, cuda_count, device, error",
    [
        (3, 4, 0, "cpu", ""),
        (3, 4, 1, "cuda:0", ""),  # --gpus-per-task=1: the one visible GPU is index 0
        (1, 4, 4, "cuda:1", ""),
        (1, 4, 2, "", "sees 2 GPUs but its node runs 4 tasks"),  # ranks would stack on GPUs
    ],
)
def test_device_choice_is_select_devices_rule(
    local_rank: int, local_world: int, cuda_count: int, device: str, error: str
) -> None:
    got_device, got_error = probes.device_choice(local_rank, local_world, cuda_count)
    assert got_device == device and (error in got_error if error else got_error == "")


def test_visible_gpus_fewer_than_tasks_fails_with_select_devices_fix() -> None:
    _, error = probes.device_choice(1, 4, 2)
    facts = world(r1={"device": "", "device_error": error, "cuda_count": 2})
    check = rules.gpu_visibility(facts)
    assert check.status == FAIL and "rank 1 on node1" in check.reason and "sees 2 GPUs" in check.reason
    assert "one task per GPU" in check.fix


@pytest.mark.parametrize(
    "uuids, machines, status, named",
    [
        (
            ["GPU-a", "GPU-a", "GPU-b", "GPU-c"],
            2,
            FAIL,
            "ranks 0-1 on node1",
        ),  # two ranks forced onto one GPU
        (["GPU-a", "GPU-b", "GPU-c", "GPU-c"], 2, FAIL, "ranks 2-3 on node2"),
        (
            ["GPU-a", "GPU-b", "GPU-a", "GPU-b"],
            2,
            PASS,
            "",
        ),  # same fallback id on different machines: no clash
        (
            ["GPU-a", "GPU-b", "GPU-a", "GPU-b"],
            1,
            FAIL,
            "ranks 0, 2",
        ),  # emulated nodes on one machine do clash
        (["", "", "", ""], 2, PASS, ""),  # CPU ranks
    ],
)
def test_shared_gpu(uuids: list[str], machines: int, status: str, named: str) -> None:
    facts = [
        dataclasses.replace(f, device="cuda:0", gpu_uuid=u)
        for f, u in zip(world(machines), uuids, strict=True)
    ]
    check = rules.shared_gpu(facts)
    assert check.status == status and named in check.reason
    if status == FAIL:
        assert "--gpus-per-task=1" in check.fix


def test_some_ranks_without_gpus_fail() -> None:
    facts = world(r0={"device": "cuda:0"}, r1={"device": "cuda:1"})
    check = rules.gpu_visibility(facts)
    assert check.status == FAIL and "ranks 2-3 on node2 see no GPU" in check.reason


@pytest.mark.parametrize(
    "changes, status, text",
    [
        ({}, PASS, "resolves to 10.0.0.1"),
        (
            {"r2": {"master_ips": (), "resolve_error": "[Errno -2] Name or service not known"}},
            FAIL,
            "does not resolve on rank 2 on node2 ([Errno -2] Name or service not known)",
        ),
    ],
)
def test_master_resolves(changes: dict, status: str, text: str) -> None:
    check = rules.master_resolves(world(**changes))
    assert check.status == status and text in check.reason


LOOP = {"master_addr": "localhost", "master_ips": ("127.0.0.1",)}


@pytest.mark.parametrize(
    "machines, changes, status, text",
    [
        (
            1,
            {f"r{r}": LOOP for r in range(4)},
            PASS,
            "one machine: loopback reaches",
        ),  # local run, test cluster
        (2, {}, PASS, "network address (2 machines)"),
        (2, {f"r{r}": LOOP for r in range(4)}, FAIL, "ranks 2-3 on node2, but the ranks run on 2 machines"),
        (2, {"r0": LOOP, "r1": LOOP}, WARN, "loopback on rank 0's machine"),  # Debian: own name -> 127.0.1.1
        (2, {"r3": {"master_ips": ("::1",)}}, FAIL, "loopback ::1 on rank 3 on node2"),
    ],
)
def test_master_loopback_with_fake_machine_ids(machines: int, changes: dict, status: str, text: str) -> None:
    check = rules.master_loopback(world(machines, **changes))
    assert check.status == status and text in check.reason
    if status != PASS:
        assert "unset MASTER_ADDR" in check.fix


def test_same_machine_id_in_two_network_namespaces_is_two_places() -> None:
    facts = world(1, **{f"r{r}": LOOP for r in range(4)})
    facts[2:] = [dataclasses.replace(f, netns="net:[2]") for f in facts[2:]]
    assert rules.master_loopback(facts).status == FAIL


@pytest.mark.parametrize(
    "changes, status, text",
    [
        ({}, PASS, "rank 0 runs on node1"),
        (
            {"master_ips": ("127.0.0.2",), "own_ips": ("127.0.0.1",)},
            PASS,
            "node1",
        ),  # the test cluster's node1
        ({"master_ips": ("172.16.0.1",)}, WARN, "is rank 0's host name, but resolves to 172.16.0.1"),  # NAT?
        (
            {"master_addr": "node7", "master_ips": ("10.0.0.7",)},
            FAIL,
            "is not rank 0's host node1 (10.0.0.1)",
        ),
        ({"master_ips": ()}, WARN, "not checked"),
        ({"store_host": "agent", "master_ips": ("10.0.0.7",)}, PASS, "torchrun's agent"),
    ],
)
def test_rank0_runs_on_the_master_host(changes: dict, status: str, text: str) -> None:
    check = rules.rank0_host(world(r0=changes))
    assert check.status == status and text in check.reason


@pytest.mark.parametrize(
    "changes, status, text",
    [
        ({}, PASS, "port 12345 (derived from the job id) is free on node1"),
        (
            {"port_error": "Address already in use, held by pid 7 (python)"},
            FAIL,
            "port 12345 on node1 is already in use (Address already in use, held by pid 7 (python))",
        ),
        (
            {"master_port": 40000, "port_override": True},
            WARN,
            "from MASTER_PORT) is in the ephemeral range 32768-60999",
        ),
        ({"master_port": 0}, PASS, "the store picks a free port"),
        ({"store_host": "agent"}, PASS, "torchrun's agent listens on 12345"),
    ],
)
def test_master_port(changes: dict, status: str, text: str) -> None:
    check = rules.master_port(world(r0=changes))
    assert check.status == status and text in check.reason
    if status == FAIL:
        assert "MASTER_PORT" in check.fix


@pytest.mark.parametrize(
    "environ, host_ips, status, text",
    [
        ({"GLOO_SOCKET_IFNAME": "eth0"}, None, PASS, "GLOO_SOCKET_IFNAME=eth0"),
        ({"GLOO_SOCKET_IFNAME": "ib0"}, None, FAIL, "GLOO_SOCKET_IFNAME=ib0 but rank 0 on node1 has no such"),
        ({"NCCL_SOCKET_IFNAME": "eth"}, None, PASS, "NCCL_SOCKET_IFNAME=eth"),  # NCCL matches prefixes
        (
            {"NCCL_SOCKET_IFNAME": "=eth"},
            None,
            FAIL,
            "no such interface",
        ),  # ... unless "=" asks for exact names
        ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, None, PASS, ""),  # exclusions
        ({}, ("127.0.1.1",), WARN, "host name resolves to loopback"),  # gloo would bind there
    ],
)
def test_socket_interfaces(environ: dict, host_ips: tuple | None, status: str, text: str) -> None:
    changes: dict = {"environ": environ}
    if host_ips:
        changes["host_ips"] = host_ips
    check = rules.socket_interfaces(all_ranks(**changes))
    assert check.status == status and text in check.reason


@pytest.mark.parametrize(
    "changes, writable, shared, text",
    [
        ({}, PASS, PASS, ""),
        (
            {"r0": {"folder_error": "Permission denied"}},
            FAIL,
            WARN,
            "not writable from rank 0 on node1 (Permission denied)",
        ),
        ({"r3": {"folder_error": "Read-only file system"}}, FAIL, PASS, "not writable from rank 3 on node2"),
        (
            {"r2": {"folder_marker": "missing"}, "r3": {"folder_marker": "folder missing on this node"}},
            PASS,
            FAIL,
            "ranks 2-3 on node2 do not see the marker",
        ),
    ],
)
def test_folder_writable_and_shared(changes: dict, writable: str, shared: str, text: str) -> None:
    facts = world(**changes)
    got = rules.folder_writable(facts), rules.folder_shared(facts)
    assert (got[0].status, got[1].status) == (writable, shared)
    assert text in got[0].reason + got[1].reason


def test_versions_must_match_on_all_ranks() -> None:
    facts = world(r3={"versions": V | {"torch": "2.11.0"}}, r2={"versions": V | {"nccl": "2.18.1"}})
    check = rules.versions_equal(facts)
    assert check.status == FAIL
    assert "torch 2.13.0 on rank 0-2, 2.11.0 on rank 3" in check.reason and "nccl" in check.reason
    assert rules.versions_equal(world()).status == PASS


@pytest.mark.parametrize(
    "machines, changes, status, text",
    [
        (2, {}, PASS, "1 thread(s) per rank"),
        (
            2,
            {"threads": 2, "environ": {"OMP_NUM_THREADS": "2"}},
            WARN,
            "2 ranks run 4 threads on 2 CPUs of node1",
        ),
        (
            1,
            {"affinity": (0, 1)},
            WARN,
            "4 ranks run 4 threads on 2 CPUs",
        ),  # emulated nodes on a 2-core machine
        (
            2,
            {"thread_error": "OMP_NUM_THREADS='x' is not an integer. Fix: unset it"},
            FAIL,
            "is not an integer",
        ),
    ],
)
def test_threads_vs_cpus(machines: int, changes: dict, status: str, text: str) -> None:
    check = rules.threads(all_ranks(machines, **changes))
    assert check.status == status and text in check.reason


def test_thread_fixes_name_the_cause() -> None:
    omp = rules.threads(all_ranks(threads=2, environ={"OMP_NUM_THREADS": "2"}))
    assert "OMP_NUM_THREADS" in omp.fix and omp.fix.endswith("set it to 1")
    crowded = rules.threads(all_ranks(1, affinity=(0, 1)))
    assert "at most 2 ranks" in crowded.fix


@pytest.mark.parametrize(
    "environ, affinity, status, text",
    [
        ({"SLURM_STEP_ID": "0"}, (0, 1), PASS, "no inherited SLURM_CPU_BIND"),
        (
            {"SLURM_CPU_BIND": "mask_cpu:0x3"},
            (0, 1),
            WARN,
            "outside any srun step",
        ),  # leaked into sbatch's shell
        ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "8"}, (0,), WARN, "the job asked --cpus-per-task=8"),
        ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "2"}, (0, 1), PASS, ""),
    ],
)
def test_cpu_binding(environ: dict, affinity: tuple, status: str, text: str) -> None:
    check = rules.cpu_binding(all_ranks(environ=environ, affinity=affinity))
    assert check.status == status and text in check.reason


@pytest.mark.parametrize(
    "versions, local, status, text",
    [
        ([None] * 4, False, PASS, "not a Slurm job"),
        ([None] * 4, True, PASS, "local run"),
        (["22.05.8"] * 4, False, PASS, "Slurm 22.05.8"),
        (["22.05.8", "22.05.8", "", ""], False, WARN, "scontrol not found on ranks 2-3 on node2"),
        (["22.05.8", "22.05.8", "23.02.1", "23.02.1"], False, WARN, "differ"),
    ],
)
def test_slurm_version(versions: list, local: bool, status: str, text: str) -> None:
    facts = [
        dataclasses.replace(f, slurm_version=v, environ={}, requeue_by="launcher" if local else "auto")
        for f, v in zip(world(), versions, strict=True)
    ]
    check = rules.slurm_version(facts)
    assert check.status == status and text in check.reason


@pytest.mark.parametrize(
    "present, status, text",
    [
        ([0, 1, 2, 3], PASS, "4 of 4 rank(s) reached the store at node1:12345"),
        ([0, 1], FAIL, "rank 2-3 did not reach the store at node1:12345 within 30 s"),
        ([0, 2], FAIL, "rank 1, 3 did not reach"),
    ],
)
def test_store_names_the_ranks_that_never_came(present: list[int], status: str, text: str) -> None:
    check = rules.store_reached(4, present, "node1:12345", 30, 0.4)
    assert check.status == status and text in check.reason


def test_rank0_does_not_host_a_store_it_cannot_serve() -> None:
    assert rules.blocking(rank(0)) == []
    busy = rules.blocking(rank(0, port_error="Address already in use"))
    assert [c.name for c in busy] == ["master-port"]
    elsewhere = rules.blocking(rank(0, master_addr="node7", master_ips=("10.0.0.7",)))
    assert [c.name for c in elsewhere] == ["rank0-host"]
    assert rules.blocking(rank(0, master_ips=("172.16.0.1",))) == []  # only a WARN: worth a try


@pytest.mark.parametrize("ranks, text", [([0, 1, 2, 5], "0-2, 5"), ([3], "3"), ([], ""), ([4, 2, 3], "2-4")])
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert rules.ranks_text(ranks) == text


@pytest.mark.parametrize(
    "ip, loop",
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("fe80::1%eth0", False),
    ],
)
def test_is_loopback(ip: str, loop: bool) -> None:
    assert rules.is_loopback(ip) is loop


# ---- the all-reduce benchmark's arithmetic -----------------------------------------------------------------


@pytest.mark.parametrize(
    "size, seconds, world_size, algbw, busbw",
    [
        (10**9, 1.0, 4, 1.0, 1.5),  # nccl-tests: busbw = algbw * 2(n-1)/n
        (10**9, 0.5, 2, 2.0, 2.0),
        (10**9, 1.0, 8, 1.0, 1.75),
        (10**9, 1.0, 1, 1.0, 0.0),  # one rank: nothing crosses a link
    ],
)
def test_bus_bandwidth(size: int, seconds: float, world_size: int, algbw: float, busbw: float) -> None:
    assert collective.bus_bandwidth(size, seconds, world_size) == pytest.approx((algbw, busbw))


@pytest.mark.parametrize(
    "totals, outliers",
    [
        ({0: 1.0, 1: 1.1, 2: 0.9, 3: 1.0}, []),
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}, [3]),  # held up
        ({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5}, [3]),  # arrived late, so waited least
        ({0: 1.0, 1: 3.0}, []),  # two ranks: no majority to stand out from
        ({0: 1e-4, 1: 1e-4, 2: 5e-4}, []),  # below the 1 ms floor: noise
    ],
)
def test_outlier_ranks(totals: dict[int, float], outliers: list[int]) -> None:
    assert collective.outlier_ranks(totals) == outliers


def test_collective_verdict() -> None:
    times = {r: {4096: 0.001, 1 << 20: 0.01} for r in range(4)}
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    ok = collective.verdict(times, {r: True for r in range(4)}, hosts, 4)
    assert ok.status == PASS and "peak bus bandwidth" in ok.reason
    everyone = dict.fromkeys(range(4), True)
    slow = collective.verdict(times | {3: {4096: 0.003, 1 << 20: 0.03}}, everyone, hosts, 4)
    assert slow.status == WARN and "rank 3 on node2 took 3.00x the median" in slow.reason
    wrong = collective.verdict(times, {0: True, 1: False, 2: True, 3: True}, hosts, 4)
    assert wrong.status == FAIL and "wrong sums on rank 1" in wrong.reason


def test_message_sizes_and_calls_agree_on_every_rank() -> None:
    assert collective.sizes(gpu=True)[0] == 4 * 1024 and collective.sizes(gpu=True)[-1] == 64 * 1024 * 1024
    assert len(collective.sizes(gpu=False)) < len(collective.sizes(gpu=True))
    assert [collective.iterations(s) for s in collective.sizes(gpu=True)] == [20, 20, 20, 10, 10, 10, 5, 5]


# ---- the report ------------------------------------------------------------------------------------------


def test_report_shows_each_rank_and_a_fix_for_what_is_not_passing() -> None:
    env = dist_env.detect(
        {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        }
    )
    results = [rules.Check(PASS, "store", "fine"), rules.Check(FAIL, "master-port", "taken", "use another")]
    text = report.render(env, world(), results)
    assert text.splitlines()[0] == (
        "hpc_ddp doctor: 4 rank(s) on 2 node(s), 2 machine(s) seen, launcher slurm, job 77"
    )
    assert len([line for line in text.splitlines() if re.match(r"\s+\d\s+\d\s+\d\s+node\d", line)]) == 4
    assert re.search(r"FAIL  master-port\s+taken\n\s+fix: use another", text)
    assert text.splitlines()[-1] == "doctor: 1 FAIL, 0 WARN, 1 PASS -> exit 1"
