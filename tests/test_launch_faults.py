"""Whose fault is an error (hpc_ddp.ledger.faults): one test per row of the table, and the rule for an error
that follows the job from node to node (issue 23 item 4)."""

from __future__ import annotations

import pytest

from hpc_ddp.ledger import faults, judge, outcomes, rules
from hpc_ddp.ledger.attempts import Attempt
from hpc_ddp.ledger.faults import Blame

pytestmark = pytest.mark.unit

# One error as a rank would raise it, per row of faults.TABLE, and whose fault it is.
EXAMPLES = {
    "device-side assert triggered": ("RuntimeError: CUDA error: device-side assert triggered", Blame.CODE),
    "out of memory": ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", Blame.CODE),
    "misaligned address": ("RuntimeError: CUDA error: misaligned address", Blame.CODE),
    "invalid argument": ("RuntimeError: CUDA error: invalid argument", Blame.CODE),
    "invalid configuration argument": (
        "RuntimeError: CUDA error: invalid configuration argument",
        Blame.CODE,
    ),
    "illegal memory access": (
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        Blame.SUSPECT,
    ),
    "an illegal instruction was encountered": (
        "RuntimeError: CUDA error: an illegal instruction was encountered",
        Blame.SUSPECT,
    ),
    "ecc error": ("RuntimeError: CUDA error: uncorrectable ECC error encountered", Blame.NODE),
    "unspecified launch failure": ("RuntimeError: CUDA error: unspecified launch failure", Blame.NODE),
    "gpu is lost": ("RuntimeError: CUDA error: GPU is lost", Blame.NODE),
    "nvlink": ("RuntimeError: CUDA error: an uncorrectable NVLink error was detected", Blame.NODE),
    "cudaerrornodevice": ("RuntimeError: cudaErrorNoDevice", Blame.NODE),
    "no cuda-capable device is detected": ("RuntimeError: no CUDA-capable device is detected", Blame.NODE),
    "busy or unavailable": ("RuntimeError: CUDA-capable device(s) is/are busy or unavailable", Blame.NODE),
    "cuda error: uncorrectable": ("RuntimeError: CUDA error: uncorrectable hardware fault", Blame.NODE),
    "xid ": ("RuntimeError: NVRM: Xid 48 on the GPU", Blame.NODE),
    "cuda driver error": ("RuntimeError: CUDA driver error: unknown error", Blame.NODE),
    "nvml": ("RuntimeError: NVML_SUCCESS == r INTERNAL ASSERT FAILED (nvml)", Blame.NODE),
    "ncclsystemerror": ("DistBackendError: ncclSystemError: System call failed", Blame.NODE),
    "ncclinternalerror": ("DistBackendError: ncclInternalError: Internal check failed", Blame.NODE),
    "ncclunhandledcudaerror": ("DistBackendError: ncclUnhandledCudaError: Call to CUDA failed", Blame.NODE),
    "ncclremoteerror": (
        "DistBackendError: ncclRemoteError: A call failed possibly due to a network",
        Blame.NODE,
    ),
    "nccl error": (
        "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled system error",
        Blame.NODE,
    ),
    "input/output error": ("OSError: [Errno 5] Input/output error", Blame.NODE),
}


def test_every_row_has_an_example() -> None:
    assert sorted(EXAMPLES) == sorted(row.pattern for row in faults.TABLE)


@pytest.mark.parametrize("pattern", [row.pattern for row in faults.TABLE])
def test_each_row_classifies_its_error(pattern: str) -> None:
    text, blame = EXAMPLES[pattern]
    fault = faults.classify(text)
    assert fault is not None and (fault.pattern, fault.blame) == (pattern, blame)
    assert faults.blame(text, "node2") is (blame is not Blame.CODE)  # the first time, on node2


def test_an_error_no_row_matches_is_the_codes() -> None:
    assert faults.classify("ValueError: bad batch at call 3") is None
    assert faults.blame("ValueError: bad batch at call 3", "node2") is False


ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(
    "seen_on, blamed",
    [
        ((), True),  # the first time: the node's (a bad GPU)
        (("node2",), True),  # again on the same node
        (("node1",), False),  # it followed the job to a second node: the code's
    ],
)
def test_a_suspect_error_that_follows_the_job_blames_the_code(seen_on: tuple[str, ...], blamed: bool) -> None:
    assert faults.blame(ILLEGAL, "node2", seen_on) is blamed
    assert faults.blame("RuntimeError: CUDA error: uncorrectable ECC error encountered", "node2", seen_on)


def test_the_supervisor_rule_excludes_the_node_once_then_stops_as_a_crash_loop() -> None:
    """node2 raises it: blamed, requeued without node2; node3 raises it too: the code's, a crash loop."""

    def note(node: str) -> dict[str, object]:
        return {"rank": 2, "node": node, "type": "RuntimeError", "message": ILLEGAL.split(": ", 1)[1]}

    first = judge.follow([], judge.judge(judge.Evidence(code=1, notes=(note("node2"),))))
    assert (first.blamed, first.node) == (True, "node2")
    one = judge.close(Attempt("7", 0, number=1), first, None, None, 1.0)
    assert rules.decide([], one, 3).action == outcomes.REQUEUE
    second = judge.follow([one], judge.judge(judge.Evidence(code=1, notes=(note("node3"),))))
    assert (second.blamed, second.node, second.signature) == (False, "node3", first.signature)
    two = judge.close(Attempt("7", 1, number=2), second, None, None, 2.0)
    decision = rules.decide([one], two, 3)
    assert decision.action == outcomes.STOP and decision.crash_loop
    assert decision.exclude == ("node2",)


def test_a_death_by_a_signal_keeps_its_blame_after_the_follow_rule() -> None:
    """The follow rule reconsiders SUSPECT errors only: a rank killed by SIGKILL still points at its node
    (the follow rule took that blame away, since the signal's line is in no row of the table)."""
    ending = judge.Ending("failed", "rank 2 was killed by SIGKILL", "signal SIGKILL", 2, "node2", blamed=True)
    assert judge.follow([], ending).blamed
