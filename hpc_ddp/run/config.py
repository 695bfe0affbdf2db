"""Training options: one frozen dataclass, the union of a part per concern, its flags, and its round trip back
to argv.

Each concern is a frozen dataclass in its room's `options` module, which imports no runtime code (importing
this imports no loader, watchdog or ledger: tests/test_architecture.py); `TrainConfig` inherits them all, so
every option is a flat field (`cfg.keep`, `--keep`) and a function that needs one concern takes that part:

    RunOptions         here: the task, how long, the batch and the step (the trainer's)
    ScheduleOptions    hpc_ddp.run.loop.options: --lr-schedule, --warmup-steps, --plateau-metric
    DataOptions        hpc_ddp.run.data.options: the loaders' workers, pinned memory, prefetch
    EvalOptions        hpc_ddp.run.loop.options: when to evaluate, --keep-best
    StrategyOptions    hpc_ddp.run.strategy.options: --strategy, --reshard-after-forward, --amp
    CheckpointOptions  hpc_ddp.run.checkpoint.options: when to save, how many, the format, --resume
    SnapshotOptions    hpc_ddp.run.snapshot.options: snapshots in memory, how often, how much memory
    LoggingOptions     hpc_ddp.run.sinks.options: progress lines, TensorBoard, trackers
    RestartOptions     here: what the supervisors (hpc_ddp.launch) may do after a preemption or a failure
    GroupOptions       hpc_ddp.run.watch.options: the process group's backend and timeout, the hang watchdog's limit

A part's own checks run when it is built alone and when TrainConfig is; the checks that span two parts are
TrainConfig's (`__post_init__`). Every check fails with one line: the flag, the value, what it must be.

Precedence: command-line flags > a `--config` file (hpc_ddp.run.configfile) > defaults here. The submitters
(`submit`, `submit --local`) parse the same flags, validate them once, and hand each task the canonical argv
from `TrainConfig.to_argv()`, so what the task runs is exactly what was checked at submission. No torch import
here: `--help` must answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp import registry
from hpc_ddp.errors import UsageError
from hpc_ddp.run import options, taskargs
from hpc_ddp.run.checkpoint.options import ASYNC_SAVE_DEFAULT as ASYNC_SAVE_DEFAULT
from hpc_ddp.run.checkpoint.options import CheckpointOptions
from hpc_ddp.run.data.options import DataOptions
from hpc_ddp.run.loop.options import EvalOptions, ScheduleOptions
from hpc_ddp.run.sinks.options import LoggingOptions
from hpc_ddp.run.snapshot.options import SnapshotOptions
from hpc_ddp.run.strategy.options import AMP_CHOICES as AMP_CHOICES
from hpc_ddp.run.strategy.options import StrategyOptions
from hpc_ddp.run.taskargs import TaskArgs
from hpc_ddp.run.watch.options import GroupOptions

BUILTIN_TASKS = ("linear", "mlp", "gpt", "cnn")
REQUEUE_BY = ("auto", "scontrol", "launcher")
NONFINITE_CHOICES = ("stop", "skip")
SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch's generators take (a signed 64-bit integer)
# Fields that must match for an exact resume (the checkpoint's, and a local run's default folder: a rerun with
# other values is another run); the others (epochs, lr schedule length, logging) may change.
MUST_MATCH = ("task", "batch_size", "grad_accum", "seed", "amp", "lr_schedule", "warmup_steps", "strategy")


@dataclass(frozen=True)
class RunOptions:
    """What to train, for how long, and the optimizer step (the trainer's: hpc_ddp.run.loop.trainer)."""

    task: str = field(
        default="linear",
        metadata={
            "help": f"a built-in task ({', '.join(BUILTIN_TASKS)}) or module.path:function returning an "
            "hpc_ddp.Task (imported from the working directory or PYTHONPATH); Task(callbacks=[...]) takes "
            "hpc_ddp.Callback objects with any of on_train_start, on_step_end, on_eval_end, on_save, "
            "on_train_end (saved with the checkpoint if they have state_dict/load_state_dict)"
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
    clip_grad: float = field(default=0.0, metadata={"help": "clip the gradient norm to this value (0: off)"})
    max_steps: int = field(
        default=0, metadata={"help": "stop after this many optimizer steps in total (0: no limit)"}
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "help": "deterministic algorithms and data order: a "
            "resumed run ends bitwise equal to an "
            "uninterrupted one"
        },
    )
    # The task's own settings (hpc_ddp.run.taskargs): --task-arg KEY=VALUE and a --config file's [task-args].
    task_args: TaskArgs = field(default=TaskArgs(), metadata={"help": taskargs.HELP})
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
        options.finite(self)
        self._check_run()

    def _check_run(self) -> None:
        if not isinstance(self.task_args, TaskArgs):  # TrainConfig(task_args={...}) in code: frozen the same
            object.__setattr__(self, "task_args", TaskArgs(self.task_args))
        options.at_least(self, 1, ["epochs", "batch_size", "grad_accum"])
        options.at_least(self, 0, ["max_steps", "clip_grad"])
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr}: must be a positive number, e.g. --lr 0.01")
        options.choice("nonfinite_loss", self.nonfinite_loss, NONFINITE_CHOICES)
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise UsageError(
                f"--seed {self.seed}: must be a 64-bit integer, from {SEED_RANGE[0]} to {SEED_RANGE[1]} "
                "(e.g. --seed 0)"
            )
        module, _, function = self.task.partition(":")
        if self.task not in BUILTIN_TASKS and not (module and function):
            raise UsageError(
                f"--task {self.task!r}: unknown task. Use one of {', '.join(BUILTIN_TASKS)}, or "
                "module.path:function for your own (e.g. --task mytasks:build)"
            )


@dataclass(frozen=True)
class RestartOptions:
    """What may start a stopped run again: read by its supervisors (hpc_ddp.launch: the local launcher, the
    Slurm batch shell), and by rank 0 where none of the kit supervises (hpc_ddp.run.loop.preemption)."""

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
            "sbatch slurm/ddp.sbatch: --nodes counts them; submit --local: K more emulated nodes. 0: requeue as "
            "before (default: 0)"
        },
    )
    wait_for_nodes: bool = field(
        default=False,
        metadata={
            "help": "Slurm: when excluding bad nodes leaves too few usable nodes, requeue the job anyway and "
            "let it pend until enough come back (submit --wait says so every minute), instead of stopping it"
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

    def __post_init__(self) -> None:
        self._check_restarts()

    def _check_restarts(self) -> None:
        options.at_least(self, 0, ["max_requeue", "max_restarts", "min_nodes", "spare_nodes"])
        options.choice("requeue_by", self.requeue_by, REQUEUE_BY)


# Fields come in the reverse order of the bases (dataclasses collects them from the most basic class up): the
# flags, --help and to_argv() list them from RunOptions, the last base, to GroupOptions, the first.
@dataclass(frozen=True)
class TrainConfig(
    GroupOptions,
    RestartOptions,
    LoggingOptions,
    SnapshotOptions,
    CheckpointOptions,
    StrategyOptions,
    EvalOptions,
    DataOptions,
    ScheduleOptions,
    RunOptions,
):
    """Everything a task needs to train; every field is a `--flag` (underscores become dashes)."""

    def __post_init__(self) -> None:
        options.finite(self)  # first: nan and inf pass every comparison the wrong way
        self._check_run()
        self._check_checkpoint()
        self._check_snapshot()
        self._check_restarts()
        self._check_logging()
        self._check_group()
        self._check_schedule()
        self._check_eval()
        self._check_data()
        self._check_strategy()
        # Across parts: the checkpoint format against the strategy, by what each declares (a plugin's class
        # derived from a built-in is checked as the built-in is: hpc_ddp.registry).
        if not self.strategy_shards() and self.format_shards():
            raise UsageError(
                f"--checkpoint-format {self.format_name()} needs --strategy fsdp (DDP's replicas are the same on "
                "every rank: rank 0's full checkpoint holds them). Fix: --strategy fsdp, or --checkpoint-format "
                "full"
            )
        if self.async_save == "process" and not self.format_shards():
            raise UsageError(
                "--async-save process writes sharded checkpoints (each rank's shards, from a process of its own); "
                "this run writes the full format (one file, rank 0). Fix: --strategy fsdp (sharded by default), "
                "or drop --async-save"
            )

    def format_name(self) -> str:
        """The checkpoint format this run writes: --checkpoint-format, auto resolved by --strategy."""
        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        return "sharded" if self.strategy_shards() else "full"

    def format_shards(self) -> bool:
        """This run's checkpoint format writes shards, every rank its own (its class's `shards`)."""
        return bool(registry.checkpoint_formats.trait(self.format_name(), "shards"))

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
            if f.name == "task_args":
                argv.extend(self.task_args.argv())
                continue
            if isinstance(value, bool):
                argv.append(f"--{options.flag(f.name)}")
            else:
                argv.append(f"--{options.flag(f.name)}={value}")
        return argv

    def with_folder(self, folder: str) -> TrainConfig:
        return dataclasses.replace(self, folder=folder)

    def as_dict(self) -> dict[str, Any]:
        """Every option by name, plain (JSON-ready: `task_args` a dict): run.json, the checkpoint, trackers."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**values, "task_args": self.task_args.plain()}


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
    if not registry.checkpoint_formats.trait(cfg.format_name(), "reshards"):
        raise UsageError(
            f"--min-nodes {least} below --nodes {nodes} lets the job go on with fewer ranks, but "
            f"{cfg.strategy if not cfg.strategy_shards() else '--checkpoint-format ' + cfg.format_name()}'s "
            f"{cfg.format_name()} checkpoint resumes "
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
    "--seed 0 (now 1)", then the task's settings that differ ("--task-arg depth=12 (now 16)": they shape the
    task as much); empty when `cfg` continues that run. A record from before task settings has none to check."""
    found = [
        f"--{options.flag(k)} {saved.get(k)!r} (now {getattr(cfg, k)!r})"
        for k in MUST_MATCH
        if k in saved and saved[k] != getattr(cfg, k) and k not in skip
    ]
    recorded = saved.get("task_args")
    if isinstance(recorded, dict):
        found += taskargs.differences(recorded, cfg.task_args)
    return found


def add_train_arguments(parser: argparse.ArgumentParser, folder_default: str | None = None) -> None:
    """Add one flag per TrainConfig field, with its help and default, to `parser`. `folder_default`: what
    --folder defaults to for this entry point (see hpc_ddp.run.folder), said in its help."""
    group = parser.add_argument_group("training options (passed to every task)")
    for f in dataclasses.fields(TrainConfig):
        help_text = f.metadata.get("help", "")
        if f.name == "folder" and folder_default:
            help_text = help_text.replace("runs/<job id>", folder_default)
        if f.name == "task_args":  # repeatable; merged over the --config file's [task-args] by from_namespace
            group.add_argument(
                f"--{options.flag(f.name)}",
                taskargs.OPTION,
                dest="task_args",
                action="append",
                default=None,
                metavar="KEY=VALUE",
                help=help_text,
            )
            continue
        if f.type in ("bool", bool):
            # --no-FLAG turns off what a --config file turned on. The default is None, not False: Python 3.10's
            # BooleanOptionalAction would add a second "(default: False)" to the help (from_namespace: False).
            group.add_argument(
                f"--{options.flag(f.name)}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} (default: off)",
            )
            continue
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        named = f.metadata.get("registry")
        if named is not None:  # a registry's names: those installed now, checked by the config (one line)
            installed = f"; installed: {', '.join([*f.metadata.get('also', ()), *named.names()])}"
            at = help_text.find(" (default: ")
            help_text = help_text[:at] + installed + help_text[at:] if at >= 0 else help_text + installed
        group.add_argument(
            f"--{options.flag(f.name)}",
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
    # The file's [task-args] table (hpc_ddp.run.configfile sets it as a parser default), then --task-arg.
    values["task_args"] = taskargs.merge(getattr(ns, taskargs.FILE_DEST, None), values["task_args"])
    return TrainConfig(**{k: False if v is None and k in _FLAGS else v for k, v in values.items()})


_FLAGS = {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("bool", bool)}
