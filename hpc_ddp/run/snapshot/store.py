"""A node's snapshots in memory: `$HPC_DDP_SNAPSHOT_DIR/<job id>/<node name>/` (default /dev/shm/hpc_ddp).

    <key>.own.r00001.s0000000120.snap    rank 1's own state at step 120, written by rank 1 on this node
    <key>.copy.r00003.s0000000120.snap   rank 3's replica, sent by rank 3 (another node) to its buddy here

`<key>` names the run folder (two runs of one job never mix). Each file is a header (JSON: job, node, rank,
step, world size, the payload's length and SHA-256) and the payload (a torch file's bytes, made by the taker).
A file is written under a temporary name and renamed into place, so a listed file is a whole one; its checksum
is checked before it is trusted all the same (memory is no more reliable than a disk), and one that fails is a
torn snapshot, never read. Two generations of each (rank, kind) are kept: while the newest is being written
the previous one stands.

/dev/shm outlives the processes inside an allocation (memory-recovery notes); the ranks of the last start
remove the run's snapshots on their nodes once every rank is past the final save (`remove_run`), and the local
launcher removes the job's folder when the job ends (`remove_job`). A rank only ever reads its own node's folder: on a real cluster it cannot read another's.
No torch: the supervisors import this.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hpc_ddp.variables import SNAPSHOT_DIR

DEFAULT_ROOT = "/dev/shm/hpc_ddp"
OWN, COPY = "own", "copy"  # this node's rank's own state; a replica of a rank of another node
GENERATIONS = 2
MAGIC = b"HPCDDPSNAP1\n"
_NAME = re.compile(r"^(?P<key>[0-9a-f]{12})\.(?P<kind>own|copy)\.r(?P<rank>\d{5})\.s(?P<step>\d{10})\.snap$")


class Torn(Exception):
    """A snapshot file that is not whole (killed while it was written, or its bytes changed since)."""


class Held(NamedTuple):
    """One whole snapshot a node holds: whose (rank), which step, of how many ranks, and its file."""

    kind: str
    rank: int
    step: int
    world_size: int
    path: str
    origin: str = ""  # the node its rank wrote it on (a replica's: the node it came from)


def root(environ: Mapping[str, str]) -> Path:
    return Path(environ.get(SNAPSHOT_DIR) or DEFAULT_ROOT)


def job_dir(base: Path, job: str) -> Path:
    return base / _safe(job or "nojob")


def node_dir(base: Path, job: str, node: str) -> Path:
    return job_dir(base, job) / _safe(node or "localhost")


def run_key(folder: str | Path) -> str:
    """The run folder's key in file names: two runs of one job (a sweep's) keep apart."""
    return hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:12]


def file_name(key: str, kind: str, rank: int, step: int) -> str:
    return f"{key}.{kind}.r{rank:05d}.s{step:010d}.snap"


def write(directory: Path, key: str, header: Mapping[str, Any], payload: bytes | memoryview) -> Path:
    """Write one snapshot (header's kind, rank, step) whole under its name, then keep GENERATIONS of its kind and
    rank. The checksum is computed here, on the caller's thread (the taker's background one)."""
    kind, rank, step = header["kind"], int(header["rank"]), int(header["step"])
    directory.mkdir(parents=True, exist_ok=True)
    head = {**header, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    text = json.dumps(head, sort_keys=True).encode()
    path = directory / file_name(key, kind, rank, step)
    temp = directory / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(temp, "wb") as f:
            f.write(MAGIC + len(text).to_bytes(8, "little") + text)
            f.write(payload)
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    rotate(directory, key, kind, rank)
    return path


def rotate(directory: Path, key: str, kind: str, rank: int, keep: int = GENERATIONS) -> None:
    """Only the `keep` newest snapshots of (kind, rank) stay."""
    mine = sorted(s for k, d, r, s, _ in _listed(directory) if (k, d, r) == (key, kind, rank))
    for step in mine[:-keep] if keep else mine:
        with contextlib.suppress(FileNotFoundError):
            (directory / file_name(key, kind, rank, step)).unlink()


def read(path: str | Path, verify: bool = True) -> tuple[dict[str, Any], bytes]:
    """A snapshot's header and payload; Torn if it is not whole (or, with `verify`, its checksum differs)."""
    data = Path(path).read_bytes()
    header = _header(data, path)
    start = len(MAGIC) + 8 + int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    payload = data[start:]
    if len(payload) != header.get("size"):
        raise Torn(f"{path}: {len(payload)} bytes of payload, its header says {header.get('size')}")
    if verify and hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise Torn(f"{path}: its checksum does not match its bytes")
    return header, payload


def _header(data: bytes, path: str | Path) -> dict[str, Any]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise Torn(f"{path}: not a whole snapshot (no header)")
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    try:
        header = json.loads(data[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
    except ValueError:
        raise Torn(f"{path}: its header is not whole") from None
    if not isinstance(header, dict):
        raise Torn(f"{path}: its header is not whole")
    return header


def inventory(directory: Path, key: str, job: str, warn: Any = None) -> list[Held]:
    """Every whole snapshot of run `key` of `job` in this node's `directory`, checksums checked; a torn one is
    said (through `warn`) and left out, so that the generation before it is what this node offers."""
    held = []
    for k, kind, rank, step, name in _listed(directory):
        if k != key:
            continue
        try:
            header, _ = read(directory / name)
        except (Torn, OSError) as e:
            if warn is not None:
                warn(f"snapshot left out: {e}")
            continue
        if header.get("job") != job or header.get("rank") != rank or header.get("step") != step:
            continue  # another job's (a new job never reads one) or renamed by hand: not trusted
        size, origin = int(header.get("world_size", 0)), str(header.get("node", ""))
        held.append(Held(kind, rank, step, size, str(directory / name), origin))
    return sorted(held, key=lambda h: (h.step, h.rank, h.kind))


def _listed(directory: Path) -> list[tuple[str, str, int, int, str]]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        m = _NAME.match(name)
        if m:
            found.append((m["key"], m["kind"], int(m["rank"]), int(m["step"]), name))
    return found


def remove_run(directory: Path, key: str) -> None:
    """Remove every snapshot of run `key` in this node's folder (a rank of the step's last start, once every
    rank is past its final save: also what an earlier start left here) and this process's temporaries, then
    the node's and the job's folders if nothing else is left in them."""
    for k, _, _, _, name in _listed(directory):
        if k == key:
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(".") and f".tmp-{os.getpid()}-" in name:
                (directory / name).unlink()
    for folder in (directory, directory.parent):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: another rank's or run's snapshots stay


def remove_job(base: Path, job: str) -> bool:
    """The supervisor, when the job ends on any path: every snapshot of the job on this machine goes (a local
    run's emulated nodes all live here). Whether there was anything."""
    folder = job_dir(base, job)
    existed = folder.is_dir()
    shutil.rmtree(folder, ignore_errors=True)
    return existed


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", part) or "_"


def newest_reachable(base: Path, job: str, key: str) -> int | None:
    """The supervisor's view, without torch and without reading a payload: the newest step of which every rank
    that wrote snapshots in this job's folders on this machine has one (its own or a replica), or None. A local
    run's emulated nodes all live here; a batch shell sees its own node's only. What a restart resumes from
    is decided by the ranks themselves, checksums checked (hpc_ddp.run.snapshot.recover)."""
    steps: dict[int, set[int]] = {}
    ranks: set[int] = set()
    folder = job_dir(base, job)
    with contextlib.suppress(OSError):
        for node in os.listdir(folder):
            for k, _, rank, step, _ in _listed(folder / node):
                if k == key:
                    ranks.add(rank)
                    steps.setdefault(step, set()).add(rank)
    whole = [step for step, have in steps.items() if ranks and have == ranks]
    return max(whole) if whole else None
