"""The training data's options (the loaders' workers, pinned memory, prefetch): a part of TrainConfig that imports
no runtime code, so that importing the options costs no loader, watchdog or ledger (issue 43 item 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp.errors import UsageError
from hpc_ddp.run import options

PIN_MEMORY = ("auto", "on", "off")


@dataclass(frozen=True)
class DataOptions:
    """The training and evaluation loaders' workers and memory (a part of hpc_ddp.run.config.TrainConfig)."""

    num_workers: int = field(
        default=-1,
        metadata={
            "help": "DataLoader workers per rank (-1: none on a CPU rank; on a GPU rank 2, or fewer when the rank "
            "runs on fewer CPUs)"
        },
    )
    pin_memory: str = field(
        default="auto",
        metadata={"help": "pin the loaders' host memory: auto (on GPU), on, off", "choices": PIN_MEMORY},
    )
    prefetch_factor: int = field(
        default=0,
        metadata={
            "help": "batches each DataLoader worker loads ahead (0: torch's default, 2); needs --num-workers N "
            "given (N > 0): refused without it"
        },
    )

    def __post_init__(self) -> None:
        self._check_data()

    def _check_data(self) -> None:
        options.at_least(self, 0, ["prefetch_factor"])
        options.choice("pin_memory", self.pin_memory, PIN_MEMORY)
        if self.num_workers < -1:
            raise UsageError(f"--num-workers {self.num_workers}: use -1 (auto) or a count >= 0")
        # Auto workers (-1) are none on a CPU rank, where the prefetch would be ignored without a word: it asks
        # for workers by number (issue 46).
        if self.prefetch_factor and self.num_workers <= 0:
            given = "none" if self.num_workers == 0 else "auto (none on a CPU rank)"
            raise UsageError(
                f"--prefetch-factor {self.prefetch_factor} needs DataLoader workers, and --num-workers is {given}: "
                "add --num-workers N (N > 0), or drop --prefetch-factor"
            )
