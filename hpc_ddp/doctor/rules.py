"""The doctor's rules: pure functions from what each rank found (`RankFacts`) to PASS / WARN / FAIL `Check`s.

Rules read data, never the live system, so each failure mode is a row in a test table: two ranks holding one
GPU, a loopback MASTER_ADDR across two machines, a folder only one node can see. `hpc_ddp.doctor.facts`
gathers the facts on each rank; `hpc_ddp.doctor.checkup` brings them to rank 0, which runs `evaluate` and
prints the verdict (`hpc_ddp.doctor.report`).

"Machine" means one kernel (and one network namespace for loopback questions), told apart by /etc/machine-id
and the boot id, never by Slurm node names: the local launcher and the test cluster emulate several nodes on
one machine, where a loopback MASTER_ADDR is perfectly reachable.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_ddp.cluster import placement
from hpc_ddp.cluster.env import SLURM_VARS
from hpc_ddp.doctor.facts import RankFacts
from hpc_ddp.log import count, ranks_text

# How srun bound a task's CPUs: inherited from another allocation, they bind an srun started here wrongly.
BIND_VARS = (*SLURM_VARS["cpu_bind"], *SLURM_VARS["cpu_bind_type"], *SLURM_VARS["cpu_bind_list"])

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
VERSION_KEYS = ("torch", "cuda", "nccl", "python", "hpc_ddp")
OUTLIER_FACTOR = 1.5  # a rank whose all-reduce time is this far from the median (either way) is flagged
UNSET_MASTER = "unset MASTER_ADDR (hpc_ddp derives it from the first node of the step, where rank 0 runs)"


@dataclass(frozen=True)
class Check:
    """One line of the verdict: what was checked, how it went, why, and what to do about it."""

    status: str  # PASS, WARN or FAIL
    name: str
    reason: str
    fix: str = ""


def who(facts: Sequence[RankFacts]) -> str:
    """'ranks 2-3 on node2': which ranks, and where."""
    hosts = sorted({f.host for f in facts})
    where = ", ".join(hosts[:4]) + (" ..." if len(hosts) > 4 else "")
    return f"rank{'s' if len(facts) > 1 else ''} {ranks_text([f.rank for f in facts])} on {where}"


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def _rank0(facts: Sequence[RankFacts]) -> RankFacts | None:
    return next((f for f in facts if f.rank == 0), None)


def _place(f: RankFacts) -> tuple[str, str]:
    return f.machine, f.netns


def store_reached(
    world_size: int, present: Sequence[int], where: str, timeout_s: float, waited_s: float
) -> Check:
    missing = sorted(set(range(world_size)) - set(present))
    if not missing:
        return Check(
            PASS,
            "store",
            f"{world_size} of {world_size} rank(s) reached the store at {where} within {waited_s:.1f} s",
        )
    return Check(
        FAIL,
        "store",
        f"rank {ranks_text(missing)} did not reach the store at {where} within {timeout_s:g} s",
        "read those ranks' output: did they start (srun task count), can their node resolve and "
        "reach MASTER_ADDR (loopback, firewall)?",
    )


def gpu_visibility(facts: Sequence[RankFacts]) -> Check:
    """placement.select_device's rule (one GPU, or at least one per task on the node), on every rank."""
    refused = [f for f in facts if f.device_error]
    if refused:
        reason, _, fix = refused[0].device_error.partition(" Fix: ")
        return Check(FAIL, "gpus", f"{who(refused)}: {reason}", fix)
    on_gpu = [f for f in facts if f.device.startswith("cuda")]
    if not on_gpu:
        return Check(PASS, "gpus", f"no GPU visible: {len(facts)} rank(s) on CPU")
    if len(on_gpu) < len(facts):
        no_gpu = [f for f in facts if not f.device.startswith("cuda")]
        return Check(
            FAIL,
            "gpus",
            f"{who(no_gpu)} see no GPU while {len(on_gpu)} other rank(s) do",
            "ask for GPUs on every node (--gpus-per-node); do not set CUDA_VISIBLE_DEVICES to empty",
        )
    counts = "/".join(map(str, sorted({f.cuda_count for f in facts})))
    return Check(PASS, "gpus", f"{count(len(facts), 'rank')} on GPUs; each sees {counts} GPU(s)")


def shared_gpu(facts: Sequence[RankFacts]) -> Check:
    """Two ranks of one machine on one physical GPU (same UUID), whatever their device indices say."""
    machines = {m: i for i, m in enumerate(dict.fromkeys(f.machine for f in facts))}
    clashes = placement.shared_gpus([(f.rank, machines[f.machine], f.gpu_uuid) for f in facts])
    if clashes:
        _, ranks, uuid = clashes[0]
        return Check(
            FAIL,
            "gpu-sharing",
            f"{who([f for f in facts if f.rank in ranks])} are bound to the same GPU ({uuid})",
            "one task per GPU: --ntasks-per-node equal to --gpus-per-node, or --gpus-per-task=1; do "
            "not set CUDA_VISIBLE_DEVICES per rank by hand",
        )
    n = len([f for f in facts if f.gpu_uuid])
    return Check(PASS, "gpu-sharing", f"{n} GPU rank(s), each on its own GPU" if n else "no GPU ranks")


def master_resolves(facts: Sequence[RankFacts]) -> Check:
    bad = [f for f in facts if f.resolve_error or not f.master_ips]
    addr = facts[0].master_addr
    if bad:
        return Check(
            FAIL,
            "master-addr",
            f"MASTER_ADDR={addr} does not resolve on {who(bad)} ({bad[0].resolve_error or 'no address'})",
            f"{UNSET_MASTER}, or use a name every node resolves (DNS, /etc/hosts) or rank 0's IP",
        )
    ips = sorted({ip for f in facts for ip in f.master_ips})
    return Check(PASS, "master-addr", f"MASTER_ADDR={addr} resolves to {', '.join(ips[:3])} on every rank")


def master_loopback(facts: Sequence[RankFacts]) -> Check:
    """A loopback MASTER_ADDR is fine on one machine and a hang across several."""
    places = {_place(f) for f in facts}
    looped = [f for f in facts if f.master_ips and all(is_loopback(ip) for ip in f.master_ips)]
    addr = facts[0].master_addr
    if len(places) <= 1:
        return Check(PASS, "loopback", "all ranks on one machine" + (": loopback reaches" if looped else ""))
    if not looped:
        return Check(PASS, "loopback", f"MASTER_ADDR={addr} is a network address ({len(places)} machines)")
    r0 = _rank0(facts)
    far = [f for f in looped if r0 is None or _place(f) != _place(r0)]
    fix = (
        f"{UNSET_MASTER} or set rank 0's host name or IP, and make that name resolve to a network address "
        "on every node (Debian's /etc/hosts maps a host's own name to 127.0.1.1)"
    )
    if far:
        reason = (
            f"MASTER_ADDR={addr} resolves to loopback {far[0].master_ips[0]} on {who(far)}, but the "
            f"ranks run on {len(places)} machines: those ranks look for rank 0's store on their own "
            "machine"
        )
        return Check(FAIL, "loopback", reason, fix)
    reason = (
        f"MASTER_ADDR={addr} resolves to loopback on rank 0's machine ({who(looped)}): the store "
        "works, other machines need another address"
    )
    return Check(WARN, "loopback", reason, fix)


def rank0_host(facts: Sequence[RankFacts]) -> Check:
    """Rank 0 hosts the store: the host MASTER_ADDR names must be rank 0's own."""
    r0 = _rank0(facts)
    if r0 is None or r0.store_host == "agent":
        return Check(PASS, "rank0-host", "torchrun's agent hosts it" if r0 else "rank 0 did not report")
    if not r0.master_ips:
        return Check(WARN, "rank0-host", "not checked: MASTER_ADDR does not resolve on rank 0")
    if any(is_loopback(ip) or ip in r0.own_ips for ip in r0.master_ips):
        return Check(PASS, "rank0-host", f"rank 0 runs on {r0.host}, named by MASTER_ADDR={r0.master_addr}")
    mine = ", ".join(r0.own_ips[:3]) or "no address"
    if r0.master_addr in (r0.host, r0.host.split(".")[0]):  # its own name, not its own address: NAT?
        return Check(
            WARN,
            "rank0-host",
            f"MASTER_ADDR={r0.master_addr} is rank 0's host name, but resolves "
            f"to {', '.join(r0.master_ips[:3])}, none of its addresses ({mine})",
            "if the other ranks hang, export MASTER_ADDR=<rank 0's address on the cluster network>",
        )
    return Check(
        FAIL,
        "rank0-host",
        f"MASTER_ADDR={r0.master_addr} ({', '.join(r0.master_ips[:3])}) is not "
        f"rank 0's host {r0.host} ({mine}): rank 0 listens on its own host, so "
        "the others would wait where nothing listens",
        UNSET_MASTER,
    )


def master_port(facts: Sequence[RankFacts]) -> Check:
    """Checked by rank 0 before it binds: a taken port fails at init with an error that names no one."""
    r0 = _rank0(facts)
    if r0 is None:
        return Check(WARN, "master-port", "not checked: rank 0 did not report")
    port, (low, high) = r0.master_port, r0.ephemeral
    if r0.store_host == "agent":
        return Check(PASS, "master-port", f"torchrun's agent listens on {port}")
    if port == 0:
        return Check(PASS, "master-port", "single process: the store picks a free port")
    if r0.port_error:
        return Check(
            FAIL,
            "master-port",
            f"port {port} on {r0.host} is already in use ({r0.port_error})",
            f"find the holder with `ss -ltnp 'sport = :{port}'`; export MASTER_PORT=<a free port "
            f"below {low}>, or resubmit (a new job id derives a new port)",
        )
    source = "from MASTER_PORT" if r0.port_override else "derived from the job id"
    if low <= port <= high:
        return Check(
            WARN,
            "master-port",
            f"port {port} ({source}) is in the ephemeral range {low}-{high}: "
            f"an outgoing connection on {r0.host} can take it first",
            f"unset MASTER_PORT to use the derived port, or pick one below {low}",
        )
    return Check(PASS, "master-port", f"port {port} ({source}) is free on {r0.host}")


def _has_interface(var: str, wanted: str, interfaces: Sequence[str]) -> bool:
    # NCCL reads prefixes ("eth" matches eth0) unless "=" asks for exact names; gloo wants exact names.
    names = [n.lstrip("=") for n in wanted.split(",") if n]
    prefix = var.startswith("NCCL") and not wanted.startswith("=")
    return any(i == n or (prefix and i.startswith(n)) for n in names for i in interfaces)


def socket_interfaces(facts: Sequence[RankFacts]) -> Check:
    """GLOO/NCCL_SOCKET_IFNAME must name interfaces that exist; unset, gloo binds to the host name's IP."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        for f in facts:
            wanted = f.environ.get(var, "")
            if wanted and not wanted.startswith("^") and not _has_interface(var, wanted, f.interfaces):
                has = ", ".join(f.interfaces) or "none"
                return Check(
                    FAIL,
                    "interfaces",
                    f"{var}={wanted} but {who([f])} has no such interface (it has {has})",
                    f"set {var} to one every node has",
                )
    if len({_place(f) for f in facts}) > 1:
        looped = [
            f
            for f in facts
            if f.device == "cpu"
            and not f.environ.get("GLOO_SOCKET_IFNAME")
            and f.host_ips
            and all(is_loopback(ip) for ip in f.host_ips)
        ]
        if looped:
            return Check(
                WARN,
                "interfaces",
                f"the host name resolves to loopback on {who(looped)}: gloo "
                "binds there, so other machines cannot connect",
                "export GLOO_SOCKET_IFNAME=<the interface that reaches the other nodes, e.g. eth0>, "
                "or fix /etc/hosts",
            )
    named = [
        f"{v}={facts[0].environ[v]}"
        for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        if facts[0].environ.get(v)
    ]
    return Check(PASS, "interfaces", "socket interfaces: " + (", ".join(named) or "backend defaults"))


def folder_writable(facts: Sequence[RankFacts]) -> Check:
    bad = [f for f in facts if f.folder_error]
    folder = facts[0].folder
    if bad:
        return Check(
            FAIL,
            "folder",
            f"run folder {folder} is not writable from {who(bad)} ({bad[0].folder_error})",
            "--folder a directory on shared storage that every rank can write (permissions, quota, "
            "read-only mount)",
        )
    return Check(PASS, "folder", f"{folder} is writable from all {len(facts)} rank(s)")


def folder_shared(facts: Sequence[RankFacts]) -> Check:
    """Rank 0 writes a marker with a fresh nonce; every other rank must read it back: the same storage."""
    r0 = _rank0(facts)
    if len(facts) == 1:
        return Check(PASS, "shared-folder", "one rank: nothing to share")
    if r0 is None or r0.folder_error:
        return Check(WARN, "shared-folder", "not checked: rank 0 could not write its marker")
    blind = [f for f in facts if f.rank != 0 and f.folder_marker != "seen"]
    if blind:
        reason = (
            f"{who(blind)} do not see the marker rank 0 wrote to {r0.folder} "
            f"({blind[0].folder_marker or 'not read'}): it is not the same folder on every node"
        )
        return Check(
            FAIL,
            "shared-folder",
            reason,
            "--folder on storage shared by all nodes (not /tmp or a node-local disk), as an absolute path",
        )
    return Check(PASS, "shared-folder", f"every rank sees rank 0's marker in {r0.folder}")


def versions_equal(facts: Sequence[RankFacts]) -> Check:
    differ = []
    for key in VERSION_KEYS:
        seen: dict[str, list[int]] = {}
        for f in facts:
            seen.setdefault(f.versions.get(key, "?"), []).append(f.rank)
        if len(seen) > 1:
            differ.append(f"{key} " + ", ".join(f"{v} on rank {ranks_text(r)}" for v, r in seen.items()))
    if differ:
        return Check(
            FAIL,
            "versions",
            "; ".join(differ),
            "run every rank from one environment (one venv "
            "or container on shared storage, same module loads)",
        )
    v = facts[0].versions
    return Check(
        PASS,
        "versions",
        f"torch {v.get('torch')}, CUDA {v.get('cuda')}, NCCL {v.get('nccl')}, "
        f"Python {v.get('python')} on all {len(facts)} rank(s)",
    )


def threads(facts: Sequence[RankFacts]) -> Check:
    """Intra-op threads of all ranks of a machine vs the CPUs they may use: more threads than CPUs fight."""
    bad = [f for f in facts if f.thread_error]
    if bad:
        return Check(
            FAIL,
            "threads",
            f"{who(bad)}: {bad[0].thread_error.partition(' Fix: ')[0]}",
            "unset OMP_NUM_THREADS (hpc_ddp sizes threads per rank) or set an integer",
        )
    for machine in dict.fromkeys(f.machine for f in facts):
        group = [f for f in facts if f.machine == machine]
        cpus = len(set().union(*(f.affinity for f in group)))
        total = sum(f.threads for f in group)
        if total <= cpus:
            continue
        share = max(1, cpus // len(group))
        if len(group) > cpus:
            fix = f"at most {cpus} ranks on this machine, or more CPUs per task (--cpus-per-task)"
        elif group[0].environ.get("OMP_NUM_THREADS"):
            fix = f"unset OMP_NUM_THREADS (hpc_ddp gives each rank its share) or set it to {share}"
        else:  # several Slurm "nodes" on one machine (emulation, oversubscribed nodes), each planned alone
            fix = f"export OMP_NUM_THREADS={share}: these ranks share one machine's CPUs"
        return Check(
            WARN,
            "threads",
            f"{len(group)} ranks run {total} threads on {cpus} CPUs of "
            f"{group[0].host}: oversubscribed ({group[0].thread_reason})",
            fix,
        )
    counts = "/".join(map(str, sorted({f.threads for f in facts})))
    return Check(
        PASS, "threads", f"{counts} thread(s) per rank, within each machine's CPUs ({facts[0].thread_reason})"
    )


def cpu_binding(facts: Sequence[RankFacts]) -> Check:
    """A SLURM_CPU_BIND that leaked in from another allocation, and Slurm 22.05's --cpus-per-task change."""
    for f in facts:
        in_step = any(f.environ.get(name) for name in SLURM_VARS["step_id"])
        bind = {k: v for k, v in f.environ.items() if k in BIND_VARS}
        if bind and not in_step:
            k, v = next(iter(bind.items()))
            return Check(
                WARN,
                "cpu-bind",
                f"{k}={v} is set on {who([f])} outside any srun step: "
                "inherited (sbatch from an interactive srun shell?), so an srun "
                "started here would bind CPUs of another allocation",
                f"unset {' '.join(bind)} before sbatch/srun",
            )
        wanted = f.environ.get(SLURM_VARS["cpus_per_task"][0], "")
        if in_step and wanted.isdigit() and len(f.affinity) < int(wanted):
            reason = (
                f"{who([f])} may use {len(f.affinity)} CPU(s) but the job asked "
                f"--cpus-per-task={wanted}: srun does not inherit it since Slurm 22.05"
            )
            fix = "pass --cpus-per-task to srun, or export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK"
            return Check(WARN, "cpu-bind", reason, fix)
    bound = facts[0].environ.get(SLURM_VARS["cpu_bind"][0], "")
    return Check(PASS, "cpu-bind", f"SLURM_CPU_BIND={bound}" if bound else "no inherited SLURM_CPU_BIND")


def slurm_version(facts: Sequence[RankFacts]) -> Check:
    slurm = [f for f in facts if f.slurm_version is not None]
    if not slurm:
        local = any(f.requeue_by == "launcher" for f in facts)
        return Check(
            PASS,
            "slurm",
            "restarted by its launcher (--requeue-by launcher, as in a local run): no Slurm to check"
            if local
            else "not a Slurm job",
        )
    missing = [f for f in slurm if not f.slurm_version]
    if missing:
        return Check(
            WARN,
            "slurm",
            f"scontrol not found on {who(missing)}",
            "put Slurm's commands on PATH in the job (module load slurm): requeue needs scontrol",
        )
    seen = sorted({f.slurm_version or "" for f in slurm})
    if len(seen) > 1:
        return Check(
            WARN,
            "slurm",
            f"Slurm versions differ between nodes: {', '.join(seen)}",
            "tell the cluster admins; avoid the mixed nodes (--exclude)",
        )
    return Check(PASS, "slurm", f"Slurm {seen[0]}")


RULES = (
    gpu_visibility,
    shared_gpu,
    master_resolves,
    master_loopback,
    rank0_host,
    master_port,
    socket_interfaces,
    folder_writable,
    folder_shared,
    versions_equal,
    threads,
    cpu_binding,
    slurm_version,
)


def evaluate(facts: Sequence[RankFacts]) -> list[Check]:
    """Every rule over the ranks that reported (the store check is the caller's: it knows who is missing)."""
    return [rule(facts) for rule in RULES]


def blocking(facts: RankFacts) -> list[Check]:
    """Rank 0's FAILs that make hosting the store pointless: it would fail, or wait for ranks that never
    come."""
    found = (master_resolves([facts]), rank0_host([facts]), master_port([facts]))
    return [c for c in found if c.status == FAIL]


def solo(facts: RankFacts) -> list[Check]:
    """The rules that still mean something for a rank left alone (no store, so no other rank's facts)."""
    rules = [gpu_visibility, master_resolves, threads, cpu_binding, slurm_version]
    if facts.rank == 0:
        rules += [rank0_host, master_port, folder_writable]
    return [rule([facts]) for rule in rules]
