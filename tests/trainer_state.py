"""A Trainer's checkpoint state in memory, for tests that stop one Trainer and go on in another without a
file: gathered as the full format gathers it (every part, every rank's RNG), loaded as a resume loads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.run.checkpoint import full
from hpc_ddp.run.loop.trainer import Trainer


def gather(trainer: Trainer) -> dict[str, Any] | None:
    """Collective: the full format's checkpoint state on rank 0, None elsewhere."""
    fmt = full.Full(trainer.folder, trainer.env, trainer.cfg.keep, trainer.checkpointer.format.storage)
    return fmt.gather(trainer.checkpointer.parts, trainer.checkpointer.meta())


def restore(trainer: Trainer, state: dict[str, Any], path: Path) -> None:
    """Every rank: load `state` (as if read from checkpoint `path`), as Trainer.resume_from does."""
    trainer.load(full.Loaded(state), path)
