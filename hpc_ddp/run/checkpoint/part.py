"""What a checkpoint is made of: named stateful parts, each saying how it is spread over the ranks.

A part is anything with a state to save and load back (torchtitan's "Stateful"): the model, the optimizer, the
AMP scaler, the position in the data, every rank's RNG (hpc_ddp.run.checkpoint.parts), and whatever comes next (an LR
scheduler, a data loader). Its `key` names its entry in a checkpoint; its `kind` tells a format what to do:

    REPLICATED  the same on every rank: rank 0's copy is saved, every rank loads it
    PER_RANK    each rank's own (the RNG): every rank's copy is saved, each rank loads its own
    SHARDED     each rank holds a shard, as the strategy laid it out (FSDP): only a sharded format saves it

Adding a part is one small class and its key; no format and no loop changes. No torch here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp.run.config import TrainConfig

REPLICATED, PER_RANK, SHARDED = "replicated", "per-rank", "sharded"
KINDS = (REPLICATED, PER_RANK, SHARDED)


@dataclass
class Loading:
    """What a part is told when it is loaded: the checkpoint, what it was written with, the options now."""

    path: Path
    meta: Mapping[str, Any]  # the checkpoint's world_size, config (as TrainConfig.as_dict()) and version
    cfg: TrainConfig
    notes: list[str] = field(default_factory=list)  # what a resume changed, said once training starts
    world_size: int = 0  # the ranks loading it (0: unknown)
    total_steps: int | None = None  # the optimizer steps this run's LR schedule is built over (None: unknown)


class Part(ABC):
    """One named stateful part of a checkpoint."""

    key: str  # its entry in the checkpoint ("model", "optimizer", ...): never renamed once written
    kind: str = REPLICATED
    what: str = ""  # how errors name its state, e.g. "the model's state_dict()"

    @abstractmethod
    def state_dict(self) -> Any:
        """This rank's state, made of tensors and plain Python data (a REPLICATED part's is the same on every
        rank). Called on every rank at each save, on the training thread."""

    @abstractmethod
    def load_state_dict(self, state: Any, ctx: Loading) -> None:
        """Take `state` back (for a PER_RANK part, this rank's own); None when the checkpoint has no entry for
        this part (written before the part existed). Raise CheckpointError for a state that does not fit."""

    def check(self, state: Any, step: int) -> None:
        """Refuse to write `state` (the copy about to be saved at `step`) by raising; on the writer thread.
        Anything goes by default."""
        return None

    def describe(self) -> str:
        return self.what or f"the checkpoint's {self.key!r} part"
