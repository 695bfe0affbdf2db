"""The logging options (a part of hpc_ddp.run.config.TrainConfig): how often rank 0 says where the run is, and
which sinks beside metrics.jsonl get its records (hpc_ddp.run.sinks). A sink whose package is missing is a
usage error at every entry point, before torch. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp import registry
from hpc_ddp.errors import UsageError
from hpc_ddp.run import options


@dataclass(frozen=True)
class LoggingOptions:
    log_every_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds between rank 0's plain progress lines in its log (on a terminal a live line is "
            "also updated in place); metrics.jsonl gets a step record every step of a run of up to 5,000 steps "
            "(about 5,000 in a longer one), and one every N seconds besides"
        },
    )
    log_grad_norm: bool = field(
        default=False,
        metadata={
            "help": "show the gradient norm (before clipping) on the progress line; metrics.jsonl's step "
            "records, TensorBoard (train/grad_norm) and the trackers have it always"
        },
    )
    tensorboard: bool = field(
        default=False,
        metadata={
            "help": "rank 0 writes TensorBoard scalars (loss, learning rate, gradient norm, samples/s, step time, per-rank step "
            "time, checkpoint stall, data wait, evaluation metrics) to <folder>/tb/ (needs: pip install "
            "'hpc-ddp[tensorboard]')"
        },
    )
    tracker: str = field(
        default="",
        metadata={
            "help": "experiment trackers (sinks) rank 0 logs to, comma-separated: wandb, mlflow, or a plugin's "
            "(docs/plugins.md) (the options once, step "
            "and evaluation metrics, new best checkpoints, the attempts and why each ended; one tracker run per "
            "run folder, resumed after a requeue). Their packages are yours to install; their own settings "
            "apply (WANDB_MODE=offline, MLFLOW_TRACKING_URI) (default: none)",
            "registry": registry.sinks,
        },
    )

    def __post_init__(self) -> None:
        options.finite(self)
        self._check_logging()

    def _check_logging(self) -> None:
        # Imported here, where a sink is asked for: importing the options imports no sink (issue 43 item 4).
        from hpc_ddp.run.records import tblog
        from hpc_ddp.run.sinks import trackers

        options.at_least(self, 0, ["log_every_s"])
        if self.tensorboard:  # every entry point, before torch: a missing package is a usage error at once
            why = tblog.missing()
            if why:
                raise UsageError(why)
        if self.tracker:  # every entry point, before torch: a missing package is a usage error at once
            why = trackers.problem(self.tracker)
            if why:
                raise UsageError(why)
