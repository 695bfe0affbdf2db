"""Whose fault is an error: the node's (its GPU, its driver, its links) or the code's (pure, one table).

A rank's error is matched against `TABLE`, first row first (lower-case substrings of "Type: message"):

- NODE: a hardware or driver fault (ECC, a GPU fallen off the bus, Xid-style launch failures, NVLink, NCCL's
  system errors). The node is blamed at once: the requeued job excludes it.
- SUSPECT: usually a bug in the code (a kernel writing out of bounds: "an illegal memory access was
  encountered"), but a failing GPU raises the same error. The node is blamed the first time; when the same
  error follows the job to a second node, the code is blamed instead (`blame`: the job then stops as a crash
  loop, rather than walking through every node of the partition).
- CODE: the code's, whatever the node (a device-side assert, CUDA out of memory, a misaligned address, an
  invalid argument): never blamed on the node.

An error no row matches is the code's (a Python exception in the user's task).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Blame(enum.Enum):
    NODE = "node"
    SUSPECT = "suspect"  # the node's the first time, the code's once it follows the job to another node
    CODE = "code"


@dataclass(frozen=True)
class Fault:
    pattern: str  # a lower-case substring of "Type: message"
    blame: Blame
    why: str


TABLE: tuple[Fault, ...] = (
    # The code's, even on a GPU: checked first ("CUDA error: device-side assert triggered" is no GPU fault).
    Fault(
        "device-side assert triggered", Blame.CODE, "an assert in a kernel: an index out of range, bad data"
    ),
    Fault("out of memory", Blame.CODE, "the model or batch does not fit: the same on every node"),
    Fault("misaligned address", Blame.CODE, "a kernel's bad pointer arithmetic"),
    Fault("invalid argument", Blame.CODE, "a CUDA call with a bad argument"),
    Fault("invalid configuration argument", Blame.CODE, "a kernel launched with a bad grid or block size"),
    # Usually the code's, but a bad GPU raises them too: the node's once, the code's when they follow the job.
    Fault("illegal memory access", Blame.SUSPECT, "a kernel out of bounds, or memory corrupted by the GPU"),
    Fault("an illegal instruction was encountered", Blame.SUSPECT, "a bad kernel, or a GPU fault"),
    # The node's: hardware, driver, links.
    Fault("ecc error", Blame.NODE, "the GPU's memory reports an (uncorrectable) ECC error"),
    Fault("unspecified launch failure", Blame.NODE, "Xid 13/43-style: a kernel killed by the GPU or driver"),
    Fault("gpu is lost", Blame.NODE, "Xid 79: the GPU fell off the bus"),
    Fault("nvlink", Blame.NODE, "an NVLink error between GPUs"),
    Fault("cudaerrornodevice", Blame.NODE, "the node's GPU is gone"),
    Fault("no cuda-capable device is detected", Blame.NODE, "the node's GPU is gone"),
    Fault("busy or unavailable", Blame.NODE, "the GPU is held or in a bad state"),
    Fault("cuda error: uncorrectable", Blame.NODE, "an uncorrectable hardware error"),
    Fault("xid ", Blame.NODE, "the driver reported an Xid (hardware or driver fault)"),
    Fault("cuda driver error", Blame.NODE, "the CUDA driver failed"),
    Fault("nvml", Blame.NODE, "NVML (the driver's management library) failed"),
    Fault("ncclsystemerror", Blame.NODE, "NCCL: a system call or device failed"),
    Fault("ncclinternalerror", Blame.NODE, "NCCL: an internal error"),
    Fault("ncclunhandledcudaerror", Blame.NODE, "NCCL: a CUDA call failed"),
    Fault("ncclremoteerror", Blame.NODE, "NCCL: a peer's network or device failed"),
    Fault("nccl error", Blame.NODE, "NCCL failed (network, device)"),
    Fault("input/output error", Blame.NODE, "the node's disk or device"),
)


def classify(text: str) -> Fault | None:
    """The first row of TABLE that `text` ("Type: message") matches; None: the code's (pure)."""
    low = text.lower()
    return next((row for row in TABLE if row.pattern in low), None)


def blame(text: str, node: str | None, seen_on: Iterable[str | None] = ()) -> bool:
    """Whether `text` ("Type: message"), raised on `node`, blames that node. `seen_on`: the nodes where the
    same error already failed this job; a SUSPECT error seen on another node is the code's (pure)."""
    fault = classify(text)
    if fault is None or fault.blame is Blame.CODE:
        return False
    return fault.blame is Blame.NODE or all(other == node for other in seen_on)
