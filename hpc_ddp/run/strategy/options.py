"""The strategies by name, and the strategy options (a part of hpc_ddp.run.config.TrainConfig): which one
spreads the model over the ranks, how FSDP reshards, and the precision. No torch: `--help` and the submitters'
checks import this; a strategy's own module is imported only when a run asks for it (hpc_ddp.run.strategy)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp import registry
from hpc_ddp.errors import UsageError
from hpc_ddp.run import options

AMP_CHOICES = ("none", "bf16", "fp16")
TRUE_FALSE = ("true", "false")


@dataclass(frozen=True)
class StrategyOptions:
    """How the model is spread over the ranks, and its precision (a part of hpc_ddp.run.config.TrainConfig)."""

    strategy: str = field(
        default="ddp",
        metadata={
            "help": "ddp: a full replica of the model on every rank; fsdp: FSDP2, parameters, gradients and "
            "optimizer state sharded over the ranks (for models bigger than one GPU); or a plugin's "
            "(docs/plugins.md)",
            "registry": registry.strategies,
        },
    )
    reshard_after_forward: str = field(
        default="true",
        metadata={
            "help": "--strategy fsdp: free the gathered parameters after each block's forward (true: least "
            "memory, gathered again for backward) or keep them until backward (false: one gather less)",
            "choices": TRUE_FALSE,
        },
    )
    amp: str = field(
        default="none",
        metadata={
            "help": "autocast dtype: none, bf16 or fp16 (fp16 uses a GradScaler)",
            "choices": AMP_CHOICES,
        },
    )

    def __post_init__(self) -> None:
        self._check_strategy()

    def _check_strategy(self) -> None:
        options.choice("amp", self.amp, AMP_CHOICES)
        options.choice("reshard_after_forward", self.reshard_after_forward, TRUE_FALSE)
        # What the strategy declares (Strategy.shards_model), not its name: a plugin's strategy derived from
        # FSDP's is checked as FSDP's is.
        shards = self.strategy_shards()
        if shards and self.amp == "fp16":
            raise UsageError(
                f"--amp fp16 with --strategy {self.strategy}: fp16 needs a sharded gradient scaler, which the kit "
                "does not have. Fix: --amp bf16 (FSDP's mixed precision: bf16 parameters, fp32 reductions)"
            )
        if not shards and self.reshard_after_forward != "true":
            raise UsageError(
                f"--reshard-after-forward {self.reshard_after_forward} applies to --strategy fsdp only. "
                "Fix: add --strategy fsdp, or drop the flag"
            )

    def strategy_shards(self) -> bool:
        """The strategy shards the model and optimizer state over the ranks (its `shards_model`; a usage error
        for a name no package installed provides)."""
        return bool(registry.strategies.trait(self.strategy, "shards_model"))
