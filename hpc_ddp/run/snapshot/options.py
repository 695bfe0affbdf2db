"""The snapshot options (a part of hpc_ddp.run.config.TrainConfig): how often each rank copies its state into
memory and how much memory that may take. No torch: `--help` and the submitters' checks import this."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hpc_ddp.errors import UsageError
from hpc_ddp.run import options

AUTO_FRACTION = 0.5  # --snapshot-memory-limit auto: this fraction of the node's available memory
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(frozen=True)
class SnapshotOptions:
    snapshot_every_steps: int = field(
        default=0,
        metadata={
            "help": "every N optimizer steps each rank copies its whole state into its node's memory "
            "($HPC_DDP_SNAPSHOT_DIR, default /dev/shm/hpc_ddp) and a replica into a buddy node's; a restart "
            "of the job resumes from the newest one every rank can reach (docs/memory.md). 0: off"
        },
    )
    snapshot_memory_limit: str = field(
        default="auto",
        metadata={
            "help": "the most memory one node's snapshots may take (two generations, its own and the replicas "
            "it holds), e.g. 8G: a run over it is refused at start; auto: half the node's available memory"
        },
    )

    def __post_init__(self) -> None:
        self._check_snapshot()

    def _check_snapshot(self) -> None:
        options.at_least(self, 0, ["snapshot_every_steps"])
        memory_limit(self.snapshot_memory_limit)

    def snapshots(self) -> bool:
        return self.snapshot_every_steps > 0


def memory_limit(text: str, available: int | None = None) -> int | None:
    """--snapshot-memory-limit in bytes: a size (`8G`, `512M`, `1073741824`), or auto (AUTO_FRACTION of
    `available`; None when `available` is not given: the check at start knows it)."""
    if text == "auto":
        return None if available is None else int(available * AUTO_FRACTION)
    found = _SIZE.match(text)
    if not found:
        raise UsageError(
            f"--snapshot-memory-limit {text}: expected auto or a size such as 8G, 512M or a number of bytes"
        )
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])
