"""`hpc_ddp.doctor`: a table per rule (fake ranks, fake machines), the probes on this host, a few real runs.

The real runs: a healthy 2 x 2 local run with the all-reduce benchmark, a healthy 2 x 2 srun step on the local
Slurm cluster, a 2-rank srun step with an unwritable folder (every rank must exit 1), and three single
processes started together: an occupied derived port, a rank 0 whose peer never comes, and a rank 1 whose
rank 0 never comes (each must name the problem instead of hanging).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp import checks, cluster, collective, doctor, local, probes
from hpc_ddp.checks import FAIL, PASS, WARN, RankFacts

from conftest import clean_environ, die_with_test, run_module

V = {"torch": "2.13.0", "cuda": "12.4", "nccl": "2.21.5", "python": "3.11.7", "hpc_ddp": "0.1.0"}


def rank(r: int, machines: int = 2, **changes: object) -> RankFacts:
    """Rank r of a healthy 2 nodes x 2 ranks job; `machines=2`: node1 and node2 are separate machines."""
    node = r // 2
    own = (f"10.0.0.{node + 1}",) if machines == 2 else ("10.0.0.1",)
    base = RankFacts(
        rank=r, local_rank=r % 2, node_rank=node, world_size=4, local_world_size=2, launcher="slurm",
        host=f"node{node + 1}", machine=f"machine-{node if machines == 2 else 0}", netns="net:[1]",
        master_addr="node1", master_port=12345, master_ips=("10.0.0.1",), own_ips=own,
        interfaces=("lo", "eth0"), host_ips=own, port_error="" if r == 0 else None,
        affinity=(0, 1) if machines == 2 else (0, 1, 2, 3),
        cpus=(r % 2,), threads=1, thread_reason="2 CPUs split among 2 ranks",
        environ={"SLURM_STEP_ID": "0"}, versions=V, slurm_version="22.05.8", folder="/shared/run",
        folder_marker="" if r == 0 else "seen")
    return dataclasses.replace(base, **changes)


def world(machines: int = 2, **per_rank: dict) -> list[RankFacts]:
    """Four healthy ranks; per_rank={'r1': {...}} changes rank 1."""
    return [rank(r, machines, **per_rank.get(f"r{r}", {})) for r in range(4)]


def all_ranks(machines: int = 2, **changes: object) -> list[RankFacts]:
    return [rank(r, machines, **changes) for r in range(4)]


# ---- the rules --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("machines", [1, 2])
def test_a_healthy_world_passes_every_rule(machines: int) -> None:
    results = checks.evaluate(world(machines))
    assert [(c.name, c.status) for c in results if c.status != PASS] == []
    assert len(results) == len(checks.RULES)


@pytest.mark.parametrize("local_rank, local_world, cuda_count, device, error", [
    (3, 4, 0, "cpu", ""),
    (3, 4, 1, "cuda:0", ""),  # --gpus-per-task=1: the one visible GPU is index 0
    (1, 4, 4, "cuda:1", ""),
    (1, 4, 2, "", "sees 2 GPUs but its node runs 4 tasks"),  # ranks would stack on GPUs
])
def test_device_choice_is_select_devices_rule(local_rank: int, local_world: int, cuda_count: int, device: str,
                                              error: str) -> None:
    got_device, got_error = probes.device_choice(local_rank, local_world, cuda_count)
    assert got_device == device and (error in got_error if error else got_error == "")


def test_visible_gpus_fewer_than_tasks_fails_with_select_devices_fix() -> None:
    _, error = probes.device_choice(1, 4, 2)
    facts = world(r1={"device": "", "device_error": error, "cuda_count": 2})
    check = checks.gpu_visibility(facts)
    assert check.status == FAIL and "rank 1 on node1" in check.reason and "sees 2 GPUs" in check.reason
    assert "one task per GPU" in check.fix


@pytest.mark.parametrize("uuids, machines, status, named", [
    (["GPU-a", "GPU-a", "GPU-b", "GPU-c"], 2, FAIL, "ranks 0-1 on node1"),  # two ranks forced onto one GPU
    (["GPU-a", "GPU-b", "GPU-c", "GPU-c"], 2, FAIL, "ranks 2-3 on node2"),
    (["GPU-a", "GPU-b", "GPU-a", "GPU-b"], 2, PASS, ""),  # same fallback id on different machines: no clash
    (["GPU-a", "GPU-b", "GPU-a", "GPU-b"], 1, FAIL, "ranks 0, 2"),  # emulated nodes on one machine do clash
    (["", "", "", ""], 2, PASS, ""),  # CPU ranks
])
def test_shared_gpu(uuids: list[str], machines: int, status: str, named: str) -> None:
    facts = [dataclasses.replace(f, device="cuda:0", gpu_uuid=u) for f, u in zip(world(machines), uuids,
                                                                                   strict=True)]
    check = checks.shared_gpu(facts)
    assert check.status == status and named in check.reason
    if status == FAIL:
        assert "--gpus-per-task=1" in check.fix


def test_some_ranks_without_gpus_fail() -> None:
    facts = world(r0={"device": "cuda:0"}, r1={"device": "cuda:1"})
    check = checks.gpu_visibility(facts)
    assert check.status == FAIL and "ranks 2-3 on node2 see no GPU" in check.reason


@pytest.mark.parametrize("changes, status, text", [
    ({}, PASS, "resolves to 10.0.0.1"),
    ({"r2": {"master_ips": (), "resolve_error": "[Errno -2] Name or service not known"}}, FAIL,
     "does not resolve on rank 2 on node2 ([Errno -2] Name or service not known)"),
])
def test_master_resolves(changes: dict, status: str, text: str) -> None:
    check = checks.master_resolves(world(**changes))
    assert check.status == status and text in check.reason


LOOP = {"master_addr": "localhost", "master_ips": ("127.0.0.1",)}


@pytest.mark.parametrize("machines, changes, status, text", [
    (1, {f"r{r}": LOOP for r in range(4)}, PASS, "one machine: loopback reaches"),  # local run, test cluster
    (2, {}, PASS, "network address (2 machines)"),
    (2, {f"r{r}": LOOP for r in range(4)}, FAIL, "ranks 2-3 on node2, but the ranks run on 2 machines"),
    (2, {"r0": LOOP, "r1": LOOP}, WARN, "loopback on rank 0's machine"),  # Debian: own name -> 127.0.1.1
    (2, {"r3": {"master_ips": ("::1",)}}, FAIL, "loopback ::1 on rank 3 on node2"),
])
def test_master_loopback_with_fake_machine_ids(machines: int, changes: dict, status: str, text: str) -> None:
    check = checks.master_loopback(world(machines, **changes))
    assert check.status == status and text in check.reason
    if status != PASS:
        assert "unset MASTER_ADDR" in check.fix


def test_same_machine_id_in_two_network_namespaces_is_two_places() -> None:
    facts = world(1, **{f"r{r}": LOOP for r in range(4)})
    facts[2:] = [dataclasses.replace(f, netns="net:[2]") for f in facts[2:]]
    assert checks.master_loopback(facts).status == FAIL


@pytest.mark.parametrize("changes, status, text", [
    ({}, PASS, "rank 0 runs on node1"),
    ({"master_ips": ("127.0.0.2",), "own_ips": ("127.0.0.1",)}, PASS, "node1"),  # the test cluster's node1
    ({"master_ips": ("172.16.0.1",)}, WARN, "is rank 0's host name, but resolves to 172.16.0.1"),  # NAT?
    ({"master_addr": "node7", "master_ips": ("10.0.0.7",)}, FAIL, "is not rank 0's host node1 (10.0.0.1)"),
    ({"master_ips": ()}, WARN, "not checked"),
    ({"store_host": "agent", "master_ips": ("10.0.0.7",)}, PASS, "torchrun's agent"),
])
def test_rank0_runs_on_the_master_host(changes: dict, status: str, text: str) -> None:
    check = checks.rank0_host(world(r0=changes))
    assert check.status == status and text in check.reason


@pytest.mark.parametrize("changes, status, text", [
    ({}, PASS, "port 12345 (derived from the job id) is free on node1"),
    ({"port_error": "Address already in use, held by pid 7 (python)"}, FAIL,
     "port 12345 on node1 is already in use (Address already in use, held by pid 7 (python))"),
    ({"master_port": 40000, "port_override": True}, WARN, "from MASTER_PORT) is in the ephemeral range "
                                                           "32768-60999"),
    ({"master_port": 0}, PASS, "the store picks a free port"),
    ({"store_host": "agent"}, PASS, "torchrun's agent listens on 12345"),
])
def test_master_port(changes: dict, status: str, text: str) -> None:
    check = checks.master_port(world(r0=changes))
    assert check.status == status and text in check.reason
    if status == FAIL:
        assert "MASTER_PORT" in check.fix


@pytest.mark.parametrize("environ, host_ips, status, text", [
    ({"GLOO_SOCKET_IFNAME": "eth0"}, None, PASS, "GLOO_SOCKET_IFNAME=eth0"),
    ({"GLOO_SOCKET_IFNAME": "ib0"}, None, FAIL, "GLOO_SOCKET_IFNAME=ib0 but rank 0 on node1 has no such"),
    ({"NCCL_SOCKET_IFNAME": "eth"}, None, PASS, "NCCL_SOCKET_IFNAME=eth"),  # NCCL matches prefixes
    ({"NCCL_SOCKET_IFNAME": "=eth"}, None, FAIL, "no such interface"),  # ... unless "=" asks for exact names
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, None, PASS, ""),  # exclusions
    ({}, ("127.0.1.1",), WARN, "host name resolves to loopback"),  # gloo would bind there
])
def test_socket_interfaces(environ: dict, host_ips: tuple | None, status: str, text: str) -> None:
    changes: dict = {"environ": environ}
    if host_ips:
        changes["host_ips"] = host_ips
    check = checks.socket_interfaces(all_ranks(**changes))
    assert check.status == status and text in check.reason


@pytest.mark.parametrize("changes, writable, shared, text", [
    ({}, PASS, PASS, ""),
    ({"r0": {"folder_error": "Permission denied"}}, FAIL, WARN, "not writable from rank 0 on node1 "
                                                                "(Permission denied)"),
    ({"r3": {"folder_error": "Read-only file system"}}, FAIL, PASS, "not writable from rank 3 on node2"),
    ({"r2": {"folder_marker": "missing"}, "r3": {"folder_marker": "folder missing on this node"}}, PASS, FAIL,
     "ranks 2-3 on node2 do not see the marker"),
])
def test_folder_writable_and_shared(changes: dict, writable: str, shared: str, text: str) -> None:
    facts = world(**changes)
    got = checks.folder_writable(facts), checks.folder_shared(facts)
    assert (got[0].status, got[1].status) == (writable, shared)
    assert text in got[0].reason + got[1].reason


def test_versions_must_match_on_all_ranks() -> None:
    facts = world(r3={"versions": V | {"torch": "2.11.0"}}, r2={"versions": V | {"nccl": "2.18.1"}})
    check = checks.versions_equal(facts)
    assert check.status == FAIL
    assert "torch 2.13.0 on rank 0-2, 2.11.0 on rank 3" in check.reason and "nccl" in check.reason
    assert checks.versions_equal(world()).status == PASS


@pytest.mark.parametrize("machines, changes, status, text", [
    (2, {}, PASS, "1 thread(s) per rank"),
    (2, {"threads": 2, "environ": {"OMP_NUM_THREADS": "2"}}, WARN, "2 ranks run 4 threads on 2 CPUs of "
                                                                    "node1"),
    (1, {"affinity": (0, 1)}, WARN, "4 ranks run 4 threads on 2 CPUs"),  # emulated nodes on a 2-core machine
    (2, {"thread_error": "OMP_NUM_THREADS='x' is not an integer. Fix: unset it"}, FAIL, "is not an integer"),
])
def test_threads_vs_cpus(machines: int, changes: dict, status: str, text: str) -> None:
    check = checks.threads(all_ranks(machines, **changes))
    assert check.status == status and text in check.reason


def test_thread_fixes_name_the_cause() -> None:
    omp = checks.threads(all_ranks(threads=2, environ={"OMP_NUM_THREADS": "2"}))
    assert "OMP_NUM_THREADS" in omp.fix and omp.fix.endswith("set it to 1")
    crowded = checks.threads(all_ranks(1, affinity=(0, 1)))
    assert "at most 2 ranks" in crowded.fix


@pytest.mark.parametrize("environ, affinity, status, text", [
    ({"SLURM_STEP_ID": "0"}, (0, 1), PASS, "no inherited SLURM_CPU_BIND"),
    ({"SLURM_CPU_BIND": "mask_cpu:0x3"}, (0, 1), WARN, "outside any srun step"),  # leaked into sbatch's shell
    ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "8"}, (0,), WARN, "the job asked --cpus-per-task=8"),
    ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "2"}, (0, 1), PASS, ""),
])
def test_cpu_binding(environ: dict, affinity: tuple, status: str, text: str) -> None:
    check = checks.cpu_binding(all_ranks(environ=environ, affinity=affinity))
    assert check.status == status and text in check.reason


@pytest.mark.parametrize("versions, local, status, text", [
    ([None] * 4, False, PASS, "not a Slurm job"),
    ([None] * 4, True, PASS, "local run"),
    (["22.05.8"] * 4, False, PASS, "Slurm 22.05.8"),
    (["22.05.8", "22.05.8", "", ""], False, WARN, "scontrol not found on ranks 2-3 on node2"),
    (["22.05.8", "22.05.8", "23.02.1", "23.02.1"], False, WARN, "differ"),
])
def test_slurm_version(versions: list, local: bool, status: str, text: str) -> None:
    facts = [dataclasses.replace(f, slurm_version=v, environ={"HPC_DDP_LOCAL": "1"} if local else {})
             for f, v in zip(world(), versions, strict=True)]
    check = checks.slurm_version(facts)
    assert check.status == status and text in check.reason


@pytest.mark.parametrize("present, status, text", [
    ([0, 1, 2, 3], PASS, "4 of 4 rank(s) reached the store at node1:12345"),
    ([0, 1], FAIL, "rank 2-3 did not reach the store at node1:12345 within 30 s"),
    ([0, 2], FAIL, "rank 1, 3 did not reach"),
])
def test_store_names_the_ranks_that_never_came(present: list[int], status: str, text: str) -> None:
    check = checks.store_reached(4, present, "node1:12345", 30, 0.4)
    assert check.status == status and text in check.reason


def test_rank0_does_not_host_a_store_it_cannot_serve() -> None:
    assert checks.blocking(rank(0)) == []
    busy = checks.blocking(rank(0, port_error="Address already in use"))
    assert [c.name for c in busy] == ["master-port"]
    elsewhere = checks.blocking(rank(0, master_addr="node7", master_ips=("10.0.0.7",)))
    assert [c.name for c in elsewhere] == ["rank0-host"]
    assert checks.blocking(rank(0, master_ips=("172.16.0.1",))) == []  # only a WARN: worth a try


@pytest.mark.parametrize("ranks, text", [([0, 1, 2, 5], "0-2, 5"), ([3], "3"), ([], ""), ([4, 2, 3], "2-4")])
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert checks.ranks_text(ranks) == text


@pytest.mark.parametrize("ip, loop", [("127.0.0.1", True), ("127.0.1.1", True), ("127.0.0.2", True),
                                      ("::1", True), ("::ffff:127.0.0.1", True), ("10.0.0.1", False),
                                      ("fe80::1%eth0", False)])
def test_is_loopback(ip: str, loop: bool) -> None:
    assert checks.is_loopback(ip) is loop


def test_facts_survive_the_trip_through_the_store() -> None:
    facts = rank(2, environ={"OMP_NUM_THREADS": "1"})
    assert RankFacts.from_json(facts.to_json()) == facts


# ---- the all-reduce benchmark's arithmetic -----------------------------------------------------------------

@pytest.mark.parametrize("size, seconds, world_size, algbw, busbw", [
    (10**9, 1.0, 4, 1.0, 1.5),  # nccl-tests: busbw = algbw * 2(n-1)/n
    (10**9, 0.5, 2, 2.0, 2.0),
    (10**9, 1.0, 8, 1.0, 1.75),
    (10**9, 1.0, 1, 1.0, 0.0),  # one rank: nothing crosses a link
])
def test_bus_bandwidth(size: int, seconds: float, world_size: int, algbw: float, busbw: float) -> None:
    assert collective.bus_bandwidth(size, seconds, world_size) == pytest.approx((algbw, busbw))


@pytest.mark.parametrize("totals, outliers", [
    ({0: 1.0, 1: 1.1, 2: 0.9, 3: 1.0}, []),
    ({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}, [3]),  # held up
    ({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5}, [3]),  # arrived late, so waited least
    ({0: 1.0, 1: 3.0}, []),  # two ranks: no majority to stand out from
    ({0: 1e-4, 1: 1e-4, 2: 5e-4}, []),  # below the 1 ms floor: noise
])
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


# ---- probes on this host -----------------------------------------------------------------------------------

@pytest.mark.parametrize("files, expected", [
    ({"/etc/machine-id": "abc", "/proc/sys/kernel/random/boot_id": "b00t"}, "abc/b00t"),
    ({"/var/lib/dbus/machine-id": "dbus", "/proc/sys/kernel/random/boot_id": "b00t"}, "dbus/b00t"),
    ({"/proc/sys/kernel/random/boot_id": "b00t"}, "b00t"),
    ({}, "host:node7"),  # a bare container: the host name is the best left
])
def test_machine_identity(files: dict[str, str], expected: str) -> None:
    assert probes.machine_identity(lambda path: files.get(path, ""), hostname="node7") == expected


def test_port_probe_sees_a_listener_and_a_free_port() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert "in use" in probes.port_in_use(port)
    assert probes.port_in_use(port) == ""  # closed again (SO_REUSEADDR: TIME_WAIT does not count)


def test_marker_tells_a_shared_folder_from_a_node_local_one(tmp_path: Path) -> None:
    shared, elsewhere = tmp_path / "run", tmp_path / "other"
    elsewhere.mkdir()
    assert probes.missing_dirs(shared / "a" / "b") == [shared / "a" / "b", shared / "a", shared]
    assert probes.write_marker(shared, "n0nce") == ""
    assert probes.read_marker(shared, "n0nce") == "seen"
    assert probes.read_marker(elsewhere, "n0nce") == "missing"
    assert probes.read_marker(tmp_path / "absent", "n0nce") == "folder missing on this node"
    assert probes.write_probe(shared, 3, "n0nce") == ""
    assert os.listdir(shared) == [".hpc_ddp-doctor-n0nce"]  # the probe is gone, the marker stays
    probes.remove_marker(shared, "n0nce", [shared])
    assert not shared.exists()  # the doctor made it, the doctor removes it


def test_report_shows_each_rank_and_a_fix_for_what_is_not_passing() -> None:
    env = cluster.detect({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                          "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "4",
                          "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[1-2]",
                          "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    results = [checks.Check(PASS, "store", "fine"), checks.Check(FAIL, "master-port", "taken", "use another")]
    text = doctor.render(env, world(), results)
    assert text.splitlines()[0] == ("hpc_ddp doctor: 4 rank(s) on 2 node(s), 2 machine(s) seen, launcher "
                                    "slurm, job 77")
    assert len([line for line in text.splitlines() if re.match(r"\s+\d\s+\d\s+\d\s+node\d", line)]) == 4
    assert re.search(r"FAIL  master-port\s+taken\n\s+fix: use another", text)
    assert text.splitlines()[-1] == "doctor: 1 FAIL, 0 WARN, 1 PASS -> exit 1"


# ---- the command line --------------------------------------------------------------------------------------

@pytest.mark.parametrize("module, args, text", [
    ("hpc_ddp.doctor", ["--join-timeout-s", "0"], "--join-timeout-s 0.0: must be positive"),
    ("hpc_ddp.doctor", ["--bogus"], "unrecognized arguments: --bogus"),
    ("hpc_ddp.submit", ["--local", "--collective"], "--collective is a doctor option: add --doctor"),
])
def test_usage_errors_exit_2_with_one_line(module: str, args: list[str], text: str) -> None:
    proc = run_module(module, *args, timeout=60)
    assert proc.returncode == 2 and text in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---- real runs ---------------------------------------------------------------------------------------------

def statuses(out: str) -> dict[str, str]:
    """{check name: status} from the doctor's table."""
    return {m[2]: m[1] for m in re.finditer(r"^(PASS|WARN|FAIL)  (\S+)", out, re.M)}


@pytest.mark.slow
def test_local_2x2_run_is_healthy_with_collective(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    proc = run_module("hpc_ddp.submit", "--local", "--doctor", "--collective", "--folder", str(folder))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "hpc_ddp doctor: 4 rank(s) on 2 node(s), 1 machine(s) seen, launcher slurm" in out
    assert all(re.search(rf"^\s+{r}\s+{r % 2}\s+{r // 2}\s+\S+\s+\w+\s+127\.0\.0\.1:\d+\s+cpu", out, re.M)
               for r in range(4))
    found = statuses(out)
    assert set(found.values()) <= {PASS, WARN}
    assert {"store", "gpus", "loopback", "master-port", "shared-folder", "versions", "threads",
            "collective"} <= set(found)
    assert found["collective"] == PASS and "busbw = algbw * 2(n-1)/n" in out and " 4 MB " in out
    assert not [p for p in folder.iterdir() if p.name.startswith(".hpc_ddp-doctor")]  # markers cleaned up


def srun(partition: str, nodes: int, per_node: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["srun", f"-N{nodes}", f"--ntasks-per-node={per_node}", "-p", partition,
                           sys.executable, "-m", "hpc_ddp.doctor", *args],
                          env=clean_environ(), capture_output=True, text=True, timeout=300,
                          preexec_fn=die_with_test)


@pytest.mark.slow
@pytest.mark.slurm
def test_srun_2x2_on_the_local_cluster_is_healthy(slurm_cluster: str, tmp_path: Path) -> None:
    proc = srun(slurm_cluster, 2, 2, "--folder", str(tmp_path))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "4 rank(s) on 2 node(s), 1 machine(s) seen, launcher slurm" in out  # node1, node2: one machine
    assert re.search(r"^\s+3\s+1\s+1\s+node2\s", out, re.M)
    found = statuses(out)
    assert set(found.values()) <= {PASS, WARN} and found["loopback"] == PASS and found["rank0-host"] == PASS
    assert re.search(r"PASS  slurm\s+Slurm \d+\.\d+", out)


def unwritable(tmp_path: Path) -> Path:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    return folder / "run" if not os.access(folder, os.W_OK) else Path("/sys/hpc_ddp-doctor-test")  # root


@pytest.mark.slow
@pytest.mark.slurm
def test_unwritable_folder_fails_on_every_rank(slurm_cluster: str, tmp_path: Path) -> None:
    folder = unwritable(tmp_path)
    proc = srun(slurm_cluster, 2, 1, "--folder", str(folder))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(rf"FAIL  folder\s+run folder {folder} is not writable from ranks 0-1", proc.stdout)
    assert "[rank 1] doctor: FAIL" in proc.stdout
    assert "task 0: Exited with exit code 1" in proc.stderr
    assert "task 1: Exited with exit code 1" in proc.stderr


def fake_step(job_id: str, task: int, tasks: int) -> dict[str, str]:
    """What `srun -n<tasks>` on one node gives task `task` (as the local launcher fakes it)."""
    return clean_environ(SLURM_JOB_ID=job_id, SLURM_STEP_ID="0", SLURM_PROCID=str(task),
                         SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_STEP_NUM_TASKS=str(tasks),
                         SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="127.0.0.1",
                         SLURM_STEP_TASKS_PER_NODE=str(tasks), HPC_DDP_LOCAL="1")


def start(folder: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """A doctor that waits only 1 s for its peers."""
    argv = [sys.executable, "-m", "hpc_ddp.doctor", "--join-timeout-s", "1", "--folder", str(folder)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_test)


@pytest.fixture(scope="module")
def lone_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Three single doctor processes at once (each pays one torch import):
    busy: the only task of a job whose derived port another process listens on;
    rank0: rank 0 of 2 whose rank 1 never starts, with an unwritable folder;
    rank1: rank 1 of 2 whose rank 0 never starts."""
    tmp = tmp_path_factory.mktemp("lone")
    busy_job, rank0_job, rank1_job = (local.fresh_job_id() for _ in range(3))
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", cluster.port_for_job(busy_job)))
        held.listen()
        procs = {"busy": start(tmp / "busy", fake_step(busy_job, 0, 1)),
                 "rank0": start(unwritable(tmp), fake_step(rank0_job, 0, 2)),
                 "rank1": start(tmp / "r1", fake_step(rank1_job, 1, 2))}
        try:
            outs = {name: p.communicate(timeout=180) for name, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    return {name: subprocess.CompletedProcess(p.args, p.returncode, *outs[name]) for name, p in procs.items()}


@pytest.mark.slow
def test_occupied_derived_port_fails_before_init(lone_runs: dict) -> None:
    proc = lone_runs["busy"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"FAIL  master-port\s+port \d+ on \S+ is already in use \(Address already in use",
                     proc.stdout)
    assert "fix: find the holder with `ss -ltnp" in proc.stdout
    assert re.search(r"FAIL  store\s+not started: rank 0 cannot host it", proc.stdout)
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_rank0_names_the_rank_that_never_came_instead_of_hanging(lone_runs: dict) -> None:
    proc = lone_runs["rank0"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"FAIL  store\s+rank 1 did not reach the store at 127\.0\.0\.1:\d+ within 1 s",
                     proc.stdout)
    assert re.search(r"FAIL  folder\s+run folder \S+ is not writable from rank 0", proc.stdout)


@pytest.mark.slow
def test_a_rank_whose_rank0_never_came_says_so(lone_runs: dict) -> None:
    proc = lone_runs["rank1"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"\[rank 1\] FAIL  store\s+rank 1 could not reach the store at 127\.0\.0\.1:\d+ "
                     r"within 1 s \(Connection refused\)", proc.stdout)
    assert "[rank 1]" in proc.stdout and "Traceback" not in proc.stderr
