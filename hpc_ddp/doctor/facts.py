"""What one rank finds about itself for `hpc_ddp.doctor`: the system-reading half of the checks.

Each probe is small and returns plain data (an error is a string, not an exception), so a rank that finds
something wrong still reports it to rank 0 instead of dying alone. `gather` assembles a `RankFacts` from the
kit's own derivations (`dist.env.detect`, `placement.select_device`, `placement.plan_cpus`); the rules that
judge the facts live in `hpc_ddp.doctor.rules`.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp import scheduler
from hpc_ddp.cluster import placement
from hpc_ddp.cluster.env import SLURM_VARS
from hpc_ddp.errors import ClusterConfigError
from hpc_ddp.run.folder import write_test

if TYPE_CHECKING:
    from hpc_ddp.cluster.env import DistEnv

# The variables the rules look at; only these travel to rank 0.
RULE_VARS = (
    "OMP_NUM_THREADS",
    *SLURM_VARS["cpu_bind"],
    *SLURM_VARS["cpu_bind_type"],
    *SLURM_VARS["cpu_bind_list"],
    *SLURM_VARS["cpus_per_task"],
    *SLURM_VARS["step_id"],
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "CUDA_VISIBLE_DEVICES",
)
MARKER = ".hpc_ddp-doctor-{nonce}"


@dataclass(frozen=True)
class RankFacts:
    """What one rank derived and found about itself; sent to rank 0 as JSON through the store."""

    rank: int
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "single"
    host: str = "host"  # socket.gethostname() on this rank
    machine: str = "m"  # /etc/machine-id + boot id: the same on every rank of one machine
    netns: str = ""  # network namespace: loopback reaches only processes in the same one
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    master_ips: tuple[str, ...] = ()  # MASTER_ADDR as resolved on this rank
    resolve_error: str = ""
    own_ips: tuple[str, ...] = ()  # this host's interface addresses
    interfaces: tuple[str, ...] = ()
    host_ips: tuple[str, ...] = ()  # this host's own name, resolved (gloo binds there by default)
    store_host: str = "rank0"  # "rank0", or "agent" when torchrun's agent hosts the store
    port_error: str | None = None  # rank 0 only: None not checked, "" free, else why not
    ephemeral: tuple[int, int] = (32768, 60999)
    port_override: bool = False  # MASTER_PORT came from the environment, not from the job id
    device: str = "cpu"  # what placement.select_device chose ("" if it refused)
    device_error: str = ""
    cuda_count: int = 0
    gpu_uuid: str = ""
    affinity: tuple[int, ...] = (0,)  # the CPUs this rank may use
    cpus: tuple[int, ...] = (0,)  # what placement.plan_cpus would pin it to
    threads: int = 1  # and how many intra-op threads it would run
    thread_reason: str = ""
    thread_error: str = ""
    environ: Mapping[str, str] = field(default_factory=dict)  # the variables the rules look at
    versions: Mapping[str, str] = field(default_factory=dict)
    slurm_version: str | None = None  # None: not a Slurm job; "": scontrol not found
    requeue_by: str = "auto"  # --requeue-by: "launcher" when the launcher restarts the run (submit --local)
    folder: str = ""
    folder_error: str = ""  # "" when this rank wrote a file there
    folder_marker: str = ""  # others: "seen", "missing", ... for rank 0's marker file

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankFacts:
        data: dict[str, Any] = json.loads(text)
        tuples = {f.name for f in fields(cls) if str(f.type).startswith("tuple")}  # JSON has only lists
        values: dict[str, Any] = {k: tuple(v) if k in tuples else v for k, v in data.items()}
        return cls(**values)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine_identity(read: Callable[[str], str] = _read, hostname: str | None = None) -> str:
    """One kernel on one installation. Not the Slurm node name: emulated nodes share a machine.

    /etc/machine-id alone is not enough (cloned VM images and containers copy it), so the boot id is added;
    without either (minimal containers), the host name is the best left.
    """
    machine_id = read("/etc/machine-id") or read("/var/lib/dbus/machine-id")
    boot_id = read("/proc/sys/kernel/random/boot_id")
    key = "/".join(p for p in (machine_id, boot_id) if p)
    return key or f"host:{hostname or socket.gethostname()}"


def network_namespace() -> str:
    """Processes in different network namespaces (containers) do not share loopback, even on one machine."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def resolve(name: str) -> tuple[tuple[str, ...], str]:
    """The addresses `name` resolves to here, and the resolver's complaint if none."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return (), str(e)
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos)), ""


def interfaces() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(interface names, their IPv4/IPv6 addresses) on this host."""
    import psutil

    table = psutil.net_if_addrs()
    ips = [
        a.address.split("%")[0]
        for addrs in table.values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    ]
    return tuple(table), tuple(dict.fromkeys(ips))


def port_in_use(port: int) -> str:
    """'' if a listener could bind `port` on every address (as the TCPStore does), else why not.

    SO_REUSEADDR as the store sets it: a port left in TIME_WAIT by the previous run is reusable; one that a
    live process listens on is not.
    """
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((addr, port))
            except OSError as e:
                if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue
                holder = port_holder(port)
                return f"{e.strerror or e}{', held by ' + holder if holder else ''}"
    return ""


def port_holder(port: int) -> str:
    """'pid 123 (python)' listening on `port`, when this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


def ephemeral_range() -> tuple[int, int]:
    parts = _read("/proc/sys/net/ipv4/ip_local_port_range").split()
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (32768, 60999)


def device_choice(local_rank: int, local_world_size: int, cuda_count: int) -> tuple[str, str]:
    """(device, error) from placement.select_device: its refusal becomes a finding, not a crash."""
    try:
        return str(placement.select_device(local_rank, local_world_size, cuda_count)), ""
    except ClusterConfigError as e:
        return "", str(e)


def versions() -> dict[str, str]:
    import torch
    import torch.distributed as dist

    from hpc_ddp._version import __version__

    nccl = "none"
    if dist.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = "unknown"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "nccl": nccl,
        "python": platform.python_version(),
        "hpc_ddp": __version__,
    }


def write_marker(folder: Path, nonce: str) -> str:
    """Rank 0: create the folder and a marker file only this run knows; '' or why it failed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER.format(nonce=nonce)).write_text(nonce)
    except OSError as e:
        return e.strerror or str(e)
    return ""


def missing_dirs(folder: Path) -> list[Path]:
    """The folder and its parents that do not exist yet, deepest first: what write_marker will create."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def remove_marker(folder: Path, nonce: str, created: list[Path] | None = None) -> None:
    """Leave the folder as the doctor found it: no marker, and no directories it made (if still empty)."""
    try:
        (folder / MARKER.format(nonce=nonce)).unlink(missing_ok=True)
        for path in created or []:
            path.rmdir()
    except OSError:
        pass


def read_marker(folder: Path, nonce: str) -> str:
    """Other ranks: 'seen' when rank 0's marker is here, i.e. this is the same storage."""
    try:
        text = (folder / MARKER.format(nonce=nonce)).read_text()
    except FileNotFoundError:
        return "missing" if folder.is_dir() else "folder missing on this node"
    except OSError as e:
        return e.strerror or str(e)
    return "seen" if text == nonce else "different"


def write_probe(folder: Path, rank: int, nonce: str) -> str:
    """Every rank other than 0 writes (and removes) a file of its own: '' or why it could not."""
    return write_test(folder, f".hpc_ddp-doctor-probe-{rank}-{nonce}")


def slurm_version(environ: Mapping[str, str], requeue_by: str = "auto") -> str | None:
    """None outside Slurm and where the launcher, not Slurm, restarts the run (--requeue-by launcher: the local
    launcher's emulated job), '' if scontrol is missing."""
    who = scheduler.for_task(requeue_by)
    if who.name != "slurm" or not who.identity(environ).job:
        return None
    return who.version() or ""


def gather(
    env: DistEnv,
    folder: Path,
    environ: Mapping[str, str],
    store_host: str,
    check_port: bool,
    requeue_by: str = "auto",
) -> RankFacts:
    """This rank's facts, before any rank talks to another (the folder marker comes later)."""
    import torch

    host = socket.gethostname()
    ips, resolve_error = resolve(env.master_addr)
    names, own = interfaces()
    cuda_count = torch.cuda.device_count()
    device, device_error = device_choice(env.local_rank, env.local_world_size, cuda_count)
    uuid = placement.gpu_uuid(torch.device(device)) if device.startswith("cuda") else ""
    affinity = placement.current_affinity()
    try:
        plan = placement.plan_cpus(affinity, env.local_rank, env.local_world_size, environ)
        cpus, thread_count, thread_reason, thread_error = plan.cpus, plan.threads, plan.reason, ""
    except ClusterConfigError as e:
        cpus, thread_count, thread_reason, thread_error = tuple(affinity), 0, "", str(e)
    return RankFacts(
        rank=env.rank,
        local_rank=env.local_rank,
        node_rank=env.node_rank,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        launcher=env.launcher,
        host=host,
        machine=machine_identity(hostname=host),
        netns=network_namespace(),
        master_addr=env.master_addr,
        master_port=env.master_port,
        master_ips=ips,
        resolve_error=resolve_error,
        own_ips=own,
        interfaces=names,
        host_ips=resolve(host)[0],
        store_host=store_host,
        port_error=port_in_use(env.master_port) if check_port else None,
        ephemeral=ephemeral_range(),
        port_override=any(o.startswith("MASTER_PORT") for o in env.overrides),
        device=device,
        device_error=device_error,
        cuda_count=cuda_count,
        gpu_uuid=uuid,
        affinity=tuple(affinity),
        cpus=tuple(cpus),
        threads=thread_count,
        thread_reason=thread_reason,
        thread_error=thread_error,
        environ={k: environ[k] for k in RULE_VARS if environ.get(k)},
        versions=versions(),
        slurm_version=slurm_version(environ, requeue_by),
        requeue_by=requeue_by,
        folder=str(folder),
    )
