"""Training options: one frozen dataclass, its command-line flags, and its round trip back to argv.

Precedence: command-line flags > a `--config` file (hpc_ddp.run.configfile) > defaults here. The submitters (`submit`, `submit --local`) parse the same
flags, validate them once, and hand each task the canonical argv from `TrainConfig.to_argv()`, so what the
task runs is exactly what was checked at submission. No torch import here: `--help` must answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.errors import UsageError
from hpc_ddp.run import tblog
from hpc_ddp.run.sinks import trackers

BUILTIN_TASKS = ("linear", "mlp", "gpt", "cnn")
LR_SCHEDULES = ("constant", "linear", "cosine")
PIN_MEMORY = ("auto", "on", "off")
AMP_CHOICES = ("none", "bf16", "fp16")
REQUEUE_BY = ("auto", "scontrol", "launcher")
NONFINITE_CHOICES = ("stop", "skip")
STRATEGIES = ("ddp", "fsdp")  # hpc_ddp.run.strategy.STRATEGIES builds them (torch), named here for --help
CHECKPOINT_FORMATS = ("auto", "full", "sharded")  # auto: sharded under fsdp, full under ddp
ASYNC_SAVES = (
    "auto",
    "thread",
    "process",
)  # how sharded checkpoints are written (run/checkpoint/dcpwrite.py)
ASYNC_SAVE_DEFAULT = "thread"  # what auto means: chosen from `python -m hpc_ddp.bench fsdp` (README)
TRUE_FALSE = ("true", "false")
SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch's generators take (a signed 64-bit integer)
MAX_TIMEOUT_S = 30 * 86400.0  # timedelta and faulthandler overflow on absurd values (1e12 s)
# Fields that must match for an exact resume (the checkpoint's, and a local run's default folder: a rerun with
# other values is another run); the others (epochs, lr schedule length, logging) may change.
MUST_MATCH = ("task", "batch_size", "grad_accum", "seed", "amp", "lr_schedule", "warmup_steps", "strategy")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a task needs to train; every field is a `--flag` (underscores become dashes)."""

    task: str = field(
        default="linear",
        metadata={
            "help": f"a built-in task ({', '.join(BUILTIN_TASKS)}) or module.path:function returning an "
            "hpc_ddp.Task (imported from the working directory or PYTHONPATH)"
        },
    )
    epochs: int = field(default=10, metadata={"help": "epochs to train; counted from 0"})
    batch_size: int = field(default=32, metadata={"help": "samples per rank per micro-step"})
    lr: float = field(default=0.01, metadata={"help": "learning rate of the default SGD optimizer"})
    seed: int = field(default=0, metadata={"help": "seed for model init, data order and every rank's RNG"})
    folder: str = field(
        default="",
        metadata={
            "help": "run folder on shared storage: checkpoints, model.pth, metrics, run.json (default: "
            "runs/<job id>)"
        },
    )
    grad_accum: int = field(
        default=1,
        metadata={"help": "micro-batches per optimizer step; gradients are all-reduced on the last one only"},
    )
    amp: str = field(
        default="none",
        metadata={
            "help": "autocast dtype: none, bf16 or fp16 (fp16 uses a GradScaler)",
            "choices": AMP_CHOICES,
        },
    )
    clip_grad: float = field(default=0.0, metadata={"help": "clip the gradient norm to this value (0: off)"})
    strategy: str = field(
        default="ddp",
        metadata={
            "help": "ddp: a full replica of the model on every rank; fsdp: FSDP2, parameters, gradients and "
            "optimizer state sharded over the ranks (for models bigger than one GPU)",
            "choices": STRATEGIES,
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
    checkpoint_format: str = field(
        default="auto",
        metadata={
            "help": "full: one file rank 0 writes; sharded: every rank writes its own shards (Distributed "
            "Checkpoint), in the background; auto: sharded under --strategy fsdp, full under ddp",
            "choices": CHECKPOINT_FORMATS,
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
    min_nodes: int = field(
        default=0,
        metadata={
            "help": "Slurm: when excluding bad nodes leaves fewer usable nodes than the job ran on, requeue it "
            "on the rest as long as at least this many remain, instead of stopping (a smaller world size: "
            "needs --allow-resize and a sharded checkpoint, --strategy fsdp). 0: every node it ran on "
            "(default: 0)"
        },
    )
    spare_nodes: int = field(
        default=0,
        metadata={
            "help": "Slurm: allocate this many nodes more than the job trains on and keep them idle: after a "
            "failure (a node lost, a GPU error, a crashed or hung rank) the batch shell starts the next step "
            "inside the same allocation, a spare in place of the blamed node, instead of requeueing the job. "
            "sbatch slurm/ddp.sbatch: --nodes counts them. 0: requeue as before (default: 0)"
        },
    )
    wait_for_nodes: bool = field(
        default=False,
        metadata={
            "help": "Slurm: when excluding bad nodes leaves too few usable nodes, requeue the job anyway and "
            "let it pend until enough come back (submit --wait says so every minute), instead of stopping it"
        },
    )
    max_steps: int = field(
        default=0, metadata={"help": "stop after this many optimizer steps in total (0: no limit)"}
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
    deterministic: bool = field(
        default=False,
        metadata={
            "help": "deterministic algorithms and data order: a "
            "resumed run ends bitwise equal to an "
            "uninterrupted one"
        },
    )
    max_requeue: int = field(default=3, metadata={"help": "times a preempted run may requeue itself"})
    max_restarts: int = field(
        default=3,
        metadata={
            "help": (
                "times a failed run starts again from its latest checkpoint (a rank raising or killed, a hang verdict, a "
                "lost node), counted apart from --max-requeue; a crash loop (the same error twice without a newer "
                "checkpoint) stops earlier. 0: no retry (default: 3)"
            )
        },
    )
    requeue_by: str = field(
        default="auto",
        metadata={
            "help": "who restarts a preempted run: scontrol (rank 0 runs `scontrol requeue` for the job), launcher "
            "(every task exits 75 and its launcher or batch script starts it again; submit --local passes "
            "this), or auto: scontrol inside a real Slurm job with scontrol on PATH, else the launcher",
            "choices": REQUEUE_BY,
        },
    )
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
    lr_schedule: str = field(
        default="constant",
        metadata={
            "help": "learning-rate schedule when the task brings none: constant, linear (to 0 at the last step) or "
            "cosine (to 0 at the last step); the last step comes from --epochs or --max-steps",
            "choices": LR_SCHEDULES,
        },
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "optimizer steps of linear warm-up before the schedule (0: none)"}
    )
    eval_every_epochs: int = field(
        default=-1,
        metadata={
            "help": "with a task that has an eval_dataset: evaluate every N epochs, and at the end (0: only at "
            "the end; -1: 1, or 0 when --eval-every-steps is given) (default: -1)"
        },
    )
    eval_every_steps: int = field(
        default=0,
        metadata={
            "help": "evaluate every N optimizer steps instead of every epoch (unless --eval-every-epochs is "
            "given too), and at the end (0: off)"
        },
    )
    eval_batch_size: int = field(
        default=0,
        metadata={
            "help": "samples per rank per evaluation batch (0: --batch-size); no gradients, so it can be larger"
        },
    )
    keep_best: str = field(
        default="",
        metadata={
            "help": "NAME:min or NAME:max: also keep the checkpoint with the best evaluation value of NAME "
            "(e.g. accuracy:max), never rotated away; `checkpoints/best` names it"
        },
    )
    plateau_metric: str = field(
        default="loss",
        metadata={
            "help": "a Task.scheduler that returns ReduceLROnPlateau is stepped after each evaluation with this "
            "evaluation value, instead of after each optimizer step (default: loss)"
        },
    )
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
            "help": "batches each DataLoader worker loads ahead (0: torch's default, 2); needs --num-workers"
        },
    )
    log_every_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds between rank 0's plain progress lines in its log (on a terminal a live line is "
            "also updated in place); metrics.jsonl gets a step record every step of a run of up to 5,000 steps "
            "(about 5,000 in a longer one), and one every N seconds besides"
        },
    )
    tensorboard: bool = field(
        default=False,
        metadata={
            "help": "rank 0 writes TensorBoard scalars (loss, learning rate, samples/s, step time, per-rank step "
            "time, checkpoint stall, data wait, evaluation metrics) to <folder>/tb/ (needs: pip install "
            "'hpc-ddp[tensorboard]')"
        },
    )
    tracker: str = field(
        default="",
        metadata={
            "help": "experiment trackers rank 0 logs to, comma-separated: wandb, mlflow (the options once, step "
            "and evaluation metrics, new best checkpoints, the attempts and why each ended; one tracker run per "
            "run folder, resumed after a requeue). Their packages are yours to install; their own settings "
            "apply (WANDB_MODE=offline, MLFLOW_TRACKING_URI) (default: none)"
        },
    )
    nonfinite_loss: str = field(
        default="stop",
        metadata={
            "help": "when the loss averaged over all ranks is NaN "
            "or infinite: stop (exit 65; that update is "
            "not applied and nothing is saved after the "
            "last finite step) or skip the step (the run "
            "still stops after 10 in a row)",
            "choices": NONFINITE_CHOICES,
        },
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # nan/inf pass every comparison below the wrong way
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{_flag(f.name)} {value}: must be a finite number (default: {f.default})")
        positive = {
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "keep": self.keep,
        }
        for name, value in positive.items():
            if value <= 0:
                raise UsageError(f"--{_flag(name)} {value}: must be at least 1")
        non_negative = {
            "max_steps": self.max_steps,
            "save_every_epochs": self.save_every_epochs,
            "save_every_steps": self.save_every_steps,
            "max_requeue": self.max_requeue,
            "max_restarts": self.max_restarts,
            "min_nodes": self.min_nodes,
            "spare_nodes": self.spare_nodes,
            "clip_grad": self.clip_grad,
            "log_every_s": self.log_every_s,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise UsageError(f"--{_flag(name)} {value}: must be 0 or more")
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr}: must be a positive number, e.g. --lr 0.01")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise UsageError(
                f"--timeout-s {self.timeout_s}: must be positive and at most {MAX_TIMEOUT_S:.0f} (30 "
                "days), e.g. --timeout-s 600"
            )
        self.hang_setting()  # validates --hang-timeout-s
        if self.lr_schedule not in LR_SCHEDULES:
            raise UsageError(f"--lr-schedule {self.lr_schedule}: choose one of {', '.join(LR_SCHEDULES)}")
        if self.eval_every_epochs < -1:
            raise UsageError(
                f"--eval-every-epochs {self.eval_every_epochs}: use N >= 0, or -1 (1, or 0 with --eval-every-steps)"
            )
        for name in ("warmup_steps", "eval_every_steps", "eval_batch_size", "prefetch_factor"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{_flag(name)} {getattr(self, name)}: must be 0 or more")
        self.best_rule()  # validates --keep-best
        if self.pin_memory not in PIN_MEMORY:
            raise UsageError(f"--pin-memory {self.pin_memory}: choose one of {', '.join(PIN_MEMORY)}")
        if self.prefetch_factor and self.num_workers == 0:
            raise UsageError(
                f"--prefetch-factor {self.prefetch_factor} needs DataLoader workers: add --num-workers N (N > 0), "
                "or drop --prefetch-factor"
            )
        if self.num_workers < -1:
            raise UsageError(f"--num-workers {self.num_workers}: use -1 (auto) or a count >= 0")
        if self.amp not in AMP_CHOICES:
            raise UsageError(f"--amp {self.amp}: choose one of {', '.join(AMP_CHOICES)}")
        for name, value, choices in (
            ("strategy", self.strategy, STRATEGIES),
            ("reshard_after_forward", self.reshard_after_forward, TRUE_FALSE),
            ("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS),
            ("async_save", self.async_save, ASYNC_SAVES),
        ):
            if value not in choices:
                raise UsageError(f"--{_flag(name)} {value}: choose one of {', '.join(choices)}")
        if self.strategy == "fsdp" and self.amp == "fp16":
            raise UsageError(
                "--amp fp16 with --strategy fsdp: fp16 needs a sharded gradient scaler, which the kit does not "
                "have. Fix: --amp bf16 (FSDP's mixed precision: bf16 parameters, fp32 reductions)"
            )
        if self.strategy == "ddp" and self.checkpoint_format == "sharded":
            raise UsageError(
                "--checkpoint-format sharded needs --strategy fsdp (DDP's replicas are the same on every rank: "
                "rank 0's full checkpoint holds them). Fix: --strategy fsdp, or --checkpoint-format full"
            )
        if self.async_save == "process" and self.format_name() != "sharded":
            raise UsageError(
                "--async-save process writes sharded checkpoints (each rank's shards, from a process of its own); "
                "this run writes the full format (one file, rank 0). Fix: --strategy fsdp (sharded by default), "
                "or drop --async-save"
            )
        if self.strategy == "ddp" and self.reshard_after_forward != "true":
            raise UsageError(
                f"--reshard-after-forward {self.reshard_after_forward} applies to --strategy fsdp only. "
                "Fix: add --strategy fsdp, or drop the flag"
            )
        if self.requeue_by not in REQUEUE_BY:
            raise UsageError(f"--requeue-by {self.requeue_by}: choose one of {', '.join(REQUEUE_BY)}")
        if self.nonfinite_loss not in NONFINITE_CHOICES:
            raise UsageError(
                f"--nonfinite-loss {self.nonfinite_loss}: choose one of {', '.join(NONFINITE_CHOICES)}"
            )
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise UsageError(
                f"--seed {self.seed}: must be a 64-bit integer, from {SEED_RANGE[0]} to {SEED_RANGE[1]} "
                "(e.g. --seed 0)"
            )
        if self.backend not in ("", "gloo", "nccl", "mpi", "ucc"):
            raise UsageError(f"--backend {self.backend}: choose gloo or nccl (or leave it out)")
        module, _, function = self.task.partition(":")
        if self.task not in BUILTIN_TASKS and not (module and function):
            raise UsageError(
                f"--task {self.task!r}: unknown task. Use one of {', '.join(BUILTIN_TASKS)}, or "
                "module.path:function for your own (e.g. --task mytasks:build)"
            )
        if self.tensorboard:  # every entry point, before torch: a missing package is a usage error at once
            why = tblog.missing()
            if why:
                raise UsageError(why)
        if self.tracker:  # every entry point, before torch: a missing package is a usage error at once
            why = trackers.problem(self.tracker)
            if why:
                raise UsageError(why)
        if self.overwrite and self.resume != "never":
            raise UsageError(
                "--overwrite only applies with --resume never (it deletes the folder's checkpoints)"
            )

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

    def eval_epochs(self) -> int:
        """Every how many epochs to evaluate (0: not by epochs): --eval-every-epochs, whose default (-1) is 1,
        or 0 when --eval-every-steps is given (then evaluations come by steps instead)."""
        if self.eval_every_epochs >= 0:
            return self.eval_every_epochs
        return 0 if self.eval_every_steps else 1

    def format_name(self) -> str:
        """The checkpoint format this run writes: --checkpoint-format, auto resolved by --strategy."""
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if self.strategy == "fsdp" else "full"

    def async_save_kind(self) -> str:
        """How sharded checkpoints are written: --async-save, auto resolved to ASYNC_SAVE_DEFAULT."""
        return ASYNC_SAVE_DEFAULT if self.async_save == "auto" else self.async_save

    def best_rule(self) -> tuple[str, str] | None:
        """--keep-best as (metric name, "min" or "max"), or None when off (raises UsageError when malformed)."""
        if not self.keep_best:
            return None
        name, _, direction = self.keep_best.rpartition(":")
        if not name or direction not in ("min", "max"):
            raise UsageError(
                f"--keep-best {self.keep_best!r}: expected NAME:min or NAME:max, e.g. --keep-best accuracy:max "
                "or --keep-best loss:min (NAME: a value the task's evaluation reports)"
            )
        return name, direction

    def to_argv(self) -> list[str]:
        """The flags that reproduce this config (defaults left out), for a task's command line.

        `--flag=value`, one word each: a value that starts with "-" (a folder named "-x", a negative number)
        would otherwise be read by argparse as a flag. str() of a float round-trips exactly.
        """
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                argv.append(f"--{_flag(f.name)}")
            else:
                argv.append(f"--{_flag(f.name)}={value}")
        return argv

    def with_folder(self, folder: str) -> TrainConfig:
        return dataclasses.replace(self, folder=folder)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_min_nodes(cfg: TrainConfig, nodes: int, tasks_per_node: int | None) -> None:
    """--min-nodes against the job's node count (`nodes`: --nodes at submission, what Slurm allocated in the
    batch shell); raises UsageError for a combination that cannot work. Below `nodes`, the job may go on with
    fewer ranks: the checkpoint must load on another world size (a sharded one, resharded) and the user must
    accept what a resize changes (--allow-resize: the global batch, bitwise equality). A full checkpoint
    (ddp's) holds one RNG state and data position per rank of its world size: it cannot resume on fewer.
    `tasks_per_node` is None when the batch shell does not know it (no --ntasks-per-node): the requeue could
    not say how many tasks the smaller job runs."""
    least = cfg.min_nodes
    if least == 0 or least == nodes:
        return
    if least > nodes:
        raise UsageError(
            f"--min-nodes {least} is more than the job's {nodes} node(s) (--nodes). Fix: --min-nodes between 1 "
            f"and {nodes}, or drop it"
        )
    if cfg.format_name() != "sharded":
        raise UsageError(
            f"--min-nodes {least} below --nodes {nodes} lets the job go on with fewer ranks, but "
            f"{'ddp' if cfg.strategy == 'ddp' else '--checkpoint-format full'}'s full checkpoint resumes "
            "only on the world size that wrote it (one RNG state and data position per rank). Fix: "
            "--strategy fsdp --allow-resize (sharded checkpoints reshard), or drop --min-nodes"
        )
    if not cfg.allow_resize:
        raise UsageError(
            f"--min-nodes {least} below --nodes {nodes} lets the job go on with fewer ranks, which changes the "
            "world size: add --allow-resize (the sharded checkpoint is resharded; the global batch changes "
            "unless --grad-accum absorbs it; no bitwise equality across the resize), or drop --min-nodes"
        )
    if tasks_per_node is None:
        raise UsageError(
            f"--min-nodes {least}: the job has no --ntasks-per-node, so a requeue on fewer nodes could not "
            "say how many tasks to run. Fix: submit with --ntasks-per-node (one task per GPU)"
        )


def accum_for(grad_accum: int, saved: int, now: int) -> int | None:
    """The --grad-accum that keeps the global batch of `grad_accum` micro-batches on `saved` ranks once on
    `now` ranks, or None when none does (it does not divide evenly). Pure: the batch steps use it too."""
    return grad_accum * saved // now if (grad_accum * saved) % now == 0 else None


def differences(saved: dict[str, Any], cfg: TrainConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """The MUST_MATCH fields where `saved` (a run's recorded config) differs from `cfg`, each as
    "--seed 0 (now 1)"; empty when `cfg` continues that run."""
    return [
        f"--{_flag(k)} {saved.get(k)!r} (now {getattr(cfg, k)!r})"
        for k in MUST_MATCH
        if k in saved and saved[k] != getattr(cfg, k) and k not in skip
    ]


def _flag(name: str) -> str:
    return name.replace("_", "-")


def add_train_arguments(parser: argparse.ArgumentParser, folder_default: str | None = None) -> None:
    """Add one flag per TrainConfig field, with its help and default, to `parser`. `folder_default`: what
    --folder defaults to for this entry point (see hpc_ddp.run.folder), said in its help."""
    group = parser.add_argument_group("training options (passed to every task)")
    for f in dataclasses.fields(TrainConfig):
        help_text = f.metadata.get("help", "")
        if f.name == "folder" and folder_default:
            help_text = help_text.replace("runs/<job id>", folder_default)
        if f.type in ("bool", bool):
            # --no-FLAG turns off what a --config file turned on. The default is None, not False: Python 3.10's
            # BooleanOptionalAction would add a second "(default: False)" to the help (from_namespace: False).
            group.add_argument(
                f"--{_flag(f.name)}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} (default: off)",
            )
            continue
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        group.add_argument(
            f"--{_flag(f.name)}",
            type=kind,
            default=f.default,
            metavar=f.name.upper(),
            help=help_text if "(default: " in help_text else f"{help_text} (default: {_shown(f.default)})",
            choices=f.metadata.get("choices"),
        )


def _shown(default: Any) -> str:
    return "none" if default == "" else str(default)


def from_namespace(ns: argparse.Namespace) -> TrainConfig:
    """Build the validated config from parsed flags (raises UsageError)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: False if v is None and k in _FLAGS else v for k, v in values.items()})


_FLAGS = {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("bool", bool)}
