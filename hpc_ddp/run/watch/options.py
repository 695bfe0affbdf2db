"""The process group's and the hang watch's options (backend, timeout, --hang-timeout-s): a part of TrainConfig
that imports no runtime code, so that importing the options costs no watchdog or ledger (issue 43 item 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpc_ddp.errors import UsageError
from hpc_ddp.run import options

MAX_TIMEOUT_S = 30 * 86400.0  # timedelta and faulthandler overflow on absurd values (1e12 s)
BACKENDS = ("", "gloo", "nccl", "mpi", "ucc")


@dataclass(frozen=True)
class GroupOptions:
    """How long ranks wait for each other (a part of hpc_ddp.run.config.TrainConfig): the process group's
    backend and collective timeout, and the hang watchdog's limit, which must stay below that timeout."""

    backend: str = field(
        default="", metadata={"help": "process-group backend (default: nccl on GPU, gloo on CPU)"}
    )
    timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds a collective may wait for a peer before the job fails (stacks dumped first)"
        },
    )
    hang_timeout_s: str = field(
        default="auto",
        metadata={
            "help": (
                "seconds a rank may stay in one phase (data, forward/backward, all-reduce, ...) at one step before the "
                "hang watchdog names the stalled rank, its host and its line, writes <folder>/hang.json and ends the run "
                "with exit code 76. It bounds the steady state; long phases (startup, the first step of each start, "
                "an epoch's first batch, saves, the end) get half of --timeout-s. auto: 20 median step times, at "
                "least 60 s, at most half of --timeout-s; 0: no watchdog; a number: that many seconds, below "
                "--timeout-s (default: auto)"
            )
        },
    )

    def __post_init__(self) -> None:
        options.finite(self)
        self._check_group()

    def _check_group(self) -> None:
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise UsageError(
                f"--timeout-s {self.timeout_s}: must be positive and at most {MAX_TIMEOUT_S:.0f} (30 "
                "days), e.g. --timeout-s 600"
            )
        self.hang_setting()  # validates --hang-timeout-s
        if self.backend not in BACKENDS:
            raise UsageError(f"--backend {self.backend}: choose gloo or nccl (or leave it out)")

    def hang_setting(self) -> float | None:
        """--hang-timeout-s as the watchdog takes it: None for auto, 0.0 for off, else seconds."""
        if self.hang_timeout_s == "auto":
            return None
        try:
            seconds = float(self.hang_timeout_s)
        except ValueError:
            seconds = -1.0
        if not (math.isfinite(seconds) and seconds >= 0):
            raise UsageError(
                f"--hang-timeout-s {self.hang_timeout_s}: use auto, 0 (off) or a number of seconds, "
                "e.g. --hang-timeout-s 120"
            )
        if seconds >= self.timeout_s:
            raise UsageError(
                f"--hang-timeout-s {self.hang_timeout_s} is not below --timeout-s {self.timeout_s:g}: "
                "the collective timeout would end the run before the watchdog could say why. Fix: "
                "a smaller --hang-timeout-s, or auto"
            )
        return seconds
