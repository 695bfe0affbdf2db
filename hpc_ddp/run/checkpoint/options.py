"""The checkpoint options (a part of hpc_ddp.run.config.TrainConfig): when a run saves, how many it keeps, in
which format and how it is written, and what a start resumes. Checked here, beside the code that uses them. No
torch: `--help` and the submitters' checks import this."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp import registry
from hpc_ddp.errors import UsageError
from hpc_ddp.run import options

AUTO = "auto"  # --checkpoint-format auto: sharded under a strategy that shards its state, else full
ASYNC_SAVES = ("auto", "thread", "process")  # how sharded checkpoints are written (dcpwrite.py)
ASYNC_SAVE_DEFAULT = "thread"  # what auto means: chosen from `python -m hpc_ddp.bench fsdp` (README)


@dataclass(frozen=True)
class CheckpointOptions:
    checkpoint_format: str = field(
        default="auto",
        metadata={
            "help": "full: one file rank 0 writes; sharded: every rank writes its own shards (Distributed "
            "Checkpoint), in the background; auto: sharded under --strategy fsdp, full under ddp; or a plugin's "
            "(docs/plugins.md)",
            "registry": registry.checkpoint_formats,
            "also": (AUTO,),
        },
    )
    checkpoint_storage: str = field(
        default="local",
        metadata={
            "help": "where checkpoints are written and read: local, this machine's filesystem (a shared one "
            "for a multi-node run); or a plugin's storage (docs/plugins.md)",
            "registry": registry.storages,
        },
    )
    async_save: str = field(
        default="auto",
        metadata={
            "help": "sharded checkpoints: thread: every rank writes its shards on a background thread; process: "
            "in a process of its own (DCP's), which leaves the training process alone while it writes; "
            f"auto: {ASYNC_SAVE_DEFAULT}",
            "choices": ASYNC_SAVES,
        },
    )
    allow_resize: bool = field(
        default=False,
        metadata={
            "help": "resume a sharded checkpoint on another number of ranks (resharded on load; the global "
            "batch changes unless --grad-accum absorbs it)"
        },
    )
    save_every_epochs: int = field(default=1, metadata={"help": "checkpoint every N epochs (0: off)"})
    save_every_steps: int = field(default=0, metadata={"help": "checkpoint every N optimizer steps (0: off)"})
    keep: int = field(default=3, metadata={"help": "checkpoints to keep in the run folder"})
    resume: str = field(
        default="auto",
        metadata={
            "help": "auto: continue from the run folder's latest "
            "checkpoint; never; or a checkpoint PATH (first start "
            "only; a requeued run always resumes its own latest)"
        },
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "with --resume never: delete the folder's checkpoints instead of refusing to start"
        },
    )

    def __post_init__(self) -> None:
        options.finite(self)
        self._check_checkpoint()

    def _check_checkpoint(self) -> None:
        options.at_least(self, 1, ["keep"])
        options.at_least(self, 0, ["save_every_epochs", "save_every_steps"])
        if self.checkpoint_format != AUTO:
            registry.checkpoint_formats.entry(
                self.checkpoint_format
            )  # an installed name, else the names that are
        registry.storages.entry(self.checkpoint_storage)
        options.choice("async_save", self.async_save, ASYNC_SAVES)
        if self.overwrite and self.resume != "never":
            raise UsageError(
                "--overwrite only applies with --resume never (it deletes the folder's checkpoints)"
            )

    def async_save_kind(self) -> str:
        """How sharded checkpoints are written: --async-save, auto resolved to ASYNC_SAVE_DEFAULT."""
        return ASYNC_SAVE_DEFAULT if self.async_save == "auto" else self.async_save
