"""The resume check's judge: where a stopped run first differs from the uninterrupted one, and why. Pure.

Each run's evidence (`Evidence`, read by hpc_ddp.doctor.resume) is the probe's trace merged over its attempts
(for a position reached twice, an evaluation a resume reruns, the later attempt's record counts: it is the one
training went on from), metrics.jsonl's records (what the trackers and TensorBoard receive: each step's loss,
its grad_norm, lr and epoch, the values Task.step returned beside the loss; the evaluation records; each epoch's
record, its mean loss, the `Epoch N, Loss:` line, once; their times left out), the fingerprints of `model.pth`,
of the final checkpoint's parts and of the best one's, and the `best` and `latest` pointers.

`first_divergence` walks the run in the order things happen and returns the first difference: step by step, each
micro-batch's data, then the random-number generators, then (at the step's first micro-batch) what the step
starts from, a cause before what it changes: the optimizer's settings (param_groups), its plain attributes, its
state, then the parameters and the buffers; the step's loss, then the rest of its record (grad_norm, lr, epoch),
then the values Task.step returned (a symptom: what they are computed from comes before them); the evaluation at
that step (its batches, then its record); the record of the epoch that ended there (or of the run's end); after
the last step, `model.pth`, the final checkpoint, the best checkpoint and the pointers. A position one run reached and the other did not is a
difference too (work lost, or done twice). `explain` turns it into the lines the check prints: the part, the
step, which stop it followed, the likely cause and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# (kind, step, index, rank): a batch the probe saw. kind "train" (index: micro-batch) or "eval" (index: batch).
Key = tuple[str, int, int, int]

DATA, RNG, PARAMS, BUFFERS, OPTIMIZER = (
    "data order",
    "an RNG stream",
    "parameters",
    "a buffer",
    "optimizer state",
)
OPT_GROUPS, OPT_ATTRIBUTES = "an optimizer setting", "an optimizer attribute"
# A step's first micro-batch: what it starts from, causes before what they change (an lr set in step changes
# the optimizer's state and then the parameters; the probe's fields, hpc_ddp.doctor.probe).
STARTS_FROM = (
    ("opt_groups", OPT_GROUPS),
    ("opt_attributes", OPT_ATTRIBUTES),
    ("optimizer", OPTIMIZER),
    ("params", PARAMS),
    ("buffers", BUFFERS),
)
OPTIMIZER_PARTS = (OPT_GROUPS, OPT_ATTRIBUTES, OPTIMIZER)
LOSS, EVAL_DATA, EVAL_RNG, EVALS = "the loss", "evaluation data", "the evaluation's RNG", "evaluation records"
EPOCHS = "epoch records"
STEP_RECORD, STEP_EXTRA = "the step's record", "a value the step returned"
RECORD_FIELDS = ("grad_norm", "lr", "epoch")  # a step record's values beside the loss, timings left out
BEST_CHECKPOINT = "the best checkpoint"
MODEL, CHECKPOINT, BEST, LATEST, LOST, EXTRA = (
    "model.pth",
    "the final checkpoint",
    "the best pointer",
    "the latest pointer",
    "work lost",
    "work done twice",
)


@dataclass(frozen=True)
class Evidence:
    """What one run left, merged over its attempts."""

    trace: Mapping[Key, Mapping[str, Any]] = field(default_factory=dict)
    losses: Mapping[int, Any] = field(default_factory=dict)  # step -> its loss (None: not finite)
    records: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # step -> {RECORD_FIELDS: value}
    extras: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # step -> Task.step's {name: value}
    evals: Mapping[int, Any] = field(default_factory=dict)  # step -> (samples, {name: mean})
    epochs: Mapping[int, Any] = field(
        default_factory=dict
    )  # step -> [(epoch, mean loss)] of those ended there
    model: Mapping[str, str] = field(default_factory=dict)  # model.pth: tensor name -> fingerprint
    checkpoint: Mapping[str, str] = field(default_factory=dict)  # the final checkpoint: path -> fingerprint
    best_checkpoint: Mapping[str, str] = field(
        default_factory=dict
    )  # the one `best` names: path -> fingerprint
    best: int | None = None  # the step `best` names
    latest: int | None = None  # the step `latest` names


@dataclass(frozen=True)
class Divergence:
    part: str  # one of the names above
    name: str  # which one: the generator, the tensor, the metric ("" when the part says it all)
    step: int | None  # None: after training (model.pth, the final checkpoint, the pointers)
    where: str  # "micro-batch 0 of step 8 on rank 1", ...
    at: (
        tuple[int, int, int] | None
    )  # its place in run order (step, phase, index: `_order`); None: after training
    straight: Any = None
    stopped: Any = None

    @property
    def evaluation(self) -> bool:
        return self.at is not None and self.at[1] in (EVAL_BATCH, EVAL_RECORD)


# Phases of a step in run order: its micro-batches, its loss (then its record's other values, then Task.step's:
# indexes 1 and 2), its evaluation's batches, its evaluation's record, the record of the epoch that ended there.
TRAIN, STEP_LOSS, EVAL_BATCH, EVAL_RECORD, EPOCH_RECORD = 0, 1, 2, 3, 4


def _order(key: Key) -> tuple[int, int, int, int]:
    kind, step, index, rank = key
    return step, TRAIN if kind == "train" else EVAL_BATCH, index, rank


def _where(key: Key) -> str:
    kind, step, index, rank = key
    if kind == "train":
        return f"micro-batch {index} of step {step} on rank {rank}"
    return f"batch {index} of the evaluation at step {step} on rank {rank}"


def _first_mismatch(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first name (in `a`'s order, then `b`'s) whose value differs, or is in one only."""
    for name in list(a) + [n for n in b if n not in a]:
        if a.get(name) != b.get(name):
            return name
    return None


def _record(key: Key, a: Mapping[str, Any], b: Mapping[str, Any]) -> Divergence | None:
    """The first difference between two records of the same batch."""
    kind, step = key[0], key[1]
    at = _order(key)[:3]
    if a.get("data") != b.get("data"):
        part = DATA if kind == "train" else EVAL_DATA
        return Divergence(part, "", step, _where(key), at, a.get("data"), b.get("data"))
    checks = [("rng", RNG if kind == "train" else EVAL_RNG)]
    if kind == "train" and key[2] == 0:
        checks += list(STARTS_FROM)
    for field_, part in checks:
        x, y = a.get(field_) or {}, b.get(field_) or {}
        name = _first_mismatch(x, y)
        if name is not None:
            return Divergence(part, name, step, _where(key), at, x.get(name), y.get(name))
    return None


def _same(x: Any, y: Any) -> bool:
    """Bitwise for numbers (NaN equals NaN: a run that went NaN in both is no divergence)."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return bool(x == y)


def first_divergence(straight: Evidence, stopped: Evidence) -> Divergence | None:
    """The first difference of the stopped run from the uninterrupted one, in the order things happened."""
    keys = sorted(set(straight.trace) | set(stopped.trace), key=_order)
    tables = (straight.losses, stopped.losses, straight.evals, stopped.evals, straight.epochs, stopped.epochs)
    steps = sorted(set().union(*tables))
    # Events in run order: each step's batches, its loss, its record's other values, the values Task.step
    # returned, its evaluation's batches, its evaluation's record, the record of the epoch that ended there.
    events: list[tuple[tuple[int, int, int, int], str, Any]] = [(_order(k), "batch", k) for k in keys]
    events += [((s, STEP_LOSS, 0, 0), "loss", s) for s in steps]
    events += [((s, STEP_LOSS, 1, 0), "record", s) for s in steps]
    events += [((s, STEP_LOSS, 2, 0), "extras", s) for s in steps]
    events += [((s, EVAL_RECORD, 0, 0), "eval", s) for s in steps]
    events += [((s, EPOCH_RECORD, 0, 0), "epoch", s) for s in steps]
    for _, what, key in sorted(events, key=lambda e: e[0]):
        found = _event(straight, stopped, what, key)
        if found is not None:
            return found
    return _after_training(straight, stopped)


def _event(straight: Evidence, stopped: Evidence, what: str, key: Any) -> Divergence | None:
    if what == "batch":
        a, b = straight.trace.get(key), stopped.trace.get(key)
        if a is None or b is None:
            return Divergence(LOST if b is None else EXTRA, "", key[1], _where(key), _order(key)[:3])
        return _record(key, a, b)
    if what == "epoch":
        return _epoch_event(straight.epochs.get(key) or [], stopped.epochs.get(key) or [], key)
    if what in ("record", "extras"):
        # A step both runs recorded (one recorded by one run only is the loss's finding, before this).
        if key not in straight.losses or key not in stopped.losses:
            return None
        part, a, b = (
            (STEP_RECORD, straight.records, stopped.records)
            if what == "record"
            else (STEP_EXTRA, straight.extras, stopped.extras)
        )
        x, y = a.get(key) or {}, b.get(key) or {}
        for name in list(x) + [n for n in y if n not in x]:
            if not _same(x.get(name), y.get(name)):
                at, where = (
                    (key, STEP_LOSS, 1 if what == "record" else 2),
                    f"metrics.jsonl's record of step {key}",
                )
                if what == "record" and name == "lr":  # the rate of the optimizer's first group: its setting
                    return Divergence(OPT_GROUPS, "group 0's lr", key, where, at, x.get(name), y.get(name))
                return Divergence(part, name, key, where, at, x.get(name), y.get(name))
        return None
    table_a, table_b = (
        (straight.losses, stopped.losses) if what == "loss" else (straight.evals, stopped.evals)
    )
    if key not in table_a and key not in table_b:
        return None
    x, y = table_a.get(key), table_b.get(key)
    missing = LOST if key not in table_b else EXTRA if key not in table_a else ""
    if what == "loss":
        at = (key, STEP_LOSS, 0)
        if missing:
            return Divergence(missing, "the step's record", key, f"step {key}", at)
        return None if _same(x, y) else Divergence(LOSS, "", key, f"step {key}", at, x, y)
    at, where = (key, EVAL_RECORD, 0), f"the evaluation at step {key}"
    if missing:
        return Divergence(missing, "the evaluation", key, where, at)
    return None if x == y else Divergence(EVALS, _eval_name(x, y), key, where, at, x, y)


def _epoch_event(a: Sequence[Any], b: Sequence[Any], step: int) -> Divergence | None:
    """The epochs that ended at `step`: each recorded once, with the same mean loss, in both runs."""
    at, where = (step, EPOCH_RECORD, 0), f"the end of an epoch at step {step}"
    if len(b) < len(a):
        return Divergence(LOST, "the epoch's record", step, where, at, a, b)
    if len(b) > len(a):
        return Divergence(EXTRA, "the epoch's record", step, where, at, a, b)
    same = all(x[0] == y[0] and _same(x[1], y[1]) for x, y in zip(a, b, strict=True))
    return None if same else Divergence(EPOCHS, "", step, where, at, a, b)


def _eval_name(x: Any, y: Any) -> str:
    (samples_a, means_a), (samples_b, means_b) = x, y
    if samples_a != samples_b:
        return "samples"
    return _first_mismatch(means_a, means_b) or ""


def _after_training(straight: Evidence, stopped: Evidence) -> Divergence | None:
    for part, a, b in (
        (MODEL, straight.model, stopped.model),
        (CHECKPOINT, straight.checkpoint, stopped.checkpoint),
        (BEST_CHECKPOINT, straight.best_checkpoint, stopped.best_checkpoint),
    ):
        name = _first_mismatch(a, b)
        if name is not None:
            return Divergence(part, name, None, "after training", None, a.get(name), b.get(name))
    if straight.best != stopped.best:
        return Divergence(BEST, "", None, "after training", None, straight.best, stopped.best)
    if straight.latest != stopped.latest:
        return Divergence(LATEST, "", None, "after training", None, straight.latest, stopped.latest)
    return None


# ----- what to tell the user ---------------------------------------------------------------------------------

# part -> (the likely cause, the fix). A cause that depends on whether the difference came right after a resume
# says so itself.
CAUSES: dict[str, tuple[str, str]] = {
    DATA: (
        "the batches differ: the data position, a stream's own state, or the randomness of its samples (an "
        "augmentation drawn in DataLoader workers, whose generators start anew when the workers do) is not "
        "what the uninterrupted run had",
        "give a stream state_dict()/load_state_dict(); draw per-sample randomness from a generator seeded by "
        "(seed, epoch, sample index) instead of the workers' global ones; or --num-workers 0",
    ),
    RNG: (
        "the generator's state differs: something drew from it outside a training step (a stream's __iter__ "
        "fetching ahead, an evaluation, a set_epoch or a callback that draws), so the checkpoint holds another "
        "state than the run went on with",
        "draw such numbers from a torch.Generator of your own, seeded from (--seed, step), or only inside "
        "Task.step",
    ),
    PARAMS: (
        "the parameters differ with the same data and generators: the checkpoint did not restore them (a "
        "parameter outside state_dict()), or the update is not deterministic (GPU kernels, atomics)",
        "keep every parameter in the model's state_dict(); run with --deterministic",
    ),
    BUFFERS: (
        "a buffer differs (BatchNorm's running statistics, a counter): it is kept outside state_dict() "
        "(persistent=False), or its ranks' copies differ and the checkpoint keeps one of them (fsdp does not "
        "synchronise buffers)",
        "register it as a persistent buffer; under fsdp keep every rank's copy equal (SyncBatchNorm, or "
        "computing it from all-reduced values)",
    ),
    OPT_GROUPS: (
        "the optimizer's settings (its param_groups: learning rate, momentum, a step count kept there) differ "
        "while the data and generators matched: something outside the checkpoint sets them (a closure or a "
        "Python counter in Task.step that sets the lr, a scheduler of your own that is not Task.scheduler)",
        "set the learning rate with Task.scheduler (the kit saves and restores it), or compute it from the "
        "step the kit restores (hpc_ddp's config and the optimizer's own state), never from a counter of calls",
    ),
    OPT_ATTRIBUTES: (
        "an attribute of the optimizer (a Python value outside its state_dict(), such as a hand-written "
        "optimizer's step count) differs: the checkpoint does not hold it, so a resumed process starts it anew",
        "keep it in the optimizer's state (self.state[p] or a param_group key), or override "
        "state_dict()/load_state_dict() to save and restore it",
    ),
    OPTIMIZER: (
        "the optimizer state differs while its settings matched: the optimizer keeps state outside "
        "state_dict() (a closure's counter), or its restored state was changed after loading",
        "keep the optimizer's whole state in state_dict()/load_state_dict()",
    ),
    LOSS: (
        "the same batch, generators and parameters gave another loss: the step depends on something outside "
        "the checkpoint (a Python counter, the clock, a global of its own) or on a non-deterministic kernel",
        "make the step a function of the batch, the model and the seeded generators; run with --deterministic",
    ),
    EVAL_DATA: (
        "the evaluation's batches differ: its dataset or its loader draws random numbers, or depends on state "
        "the checkpoint does not hold",
        "make the evaluation set fixed (no random transforms), or seed them from (--seed, step)",
    ),
    EVAL_RNG: (
        "the evaluation starts from other generator states: the training before it drew differently, or the "
        "evaluation is run in the training's random streams",
        "evaluate with a generator of your own seeded from (--seed, step)",
    ),
    EVALS: (
        "an evaluation gave other values with the same inputs: it draws from the training's generators (a "
        "stop during it, then the rerun, drew twice), or depends on state outside the checkpoint",
        "draw an evaluation's random numbers from a generator of its own, seeded from (--seed, step)",
    ),
    STEP_RECORD: (
        "the step's record differs with the same batch, generators, starting state and loss: the backward or the "
        "update depends on something outside the checkpoint (a Python counter that unfreezes a layer or scales a "
        "gradient, a flag set once, the clock) or on a non-deterministic kernel",
        "make what the step does a function of the batch, the model, the seeded generators and the step the kit "
        "restores (never a counter of calls); run with --deterministic",
    ),
    STEP_EXTRA: (
        "a value Task.step returned beside the loss differs while the step's batch, generators, starting state "
        "and loss matched: it is computed from state outside the checkpoint (a running mean, a counter or a list "
        "kept in a closure or a global), which a resumed process starts anew",
        "compute it from the step's batch and model alone (the kit averages it over the ranks and the trackers "
        "chart it), or keep its state in a persistent buffer of the model, which the checkpoint holds",
    ),
    EPOCHS: (
        "an epoch's mean loss differs while its steps matched: the resumed epoch did not go on from the sums "
        "its checkpoint holds",
        "report it with the check's folders",
    ),
    MODEL: (
        "every step matched but the final weights differ: the end of the run (model.pth written from another "
        "checkpoint, a final step trained twice or not at all) differs",
        "check that the run that was stopped finished once, at the same step",
    ),
    BEST_CHECKPOINT: (
        "every step matched but the checkpoint `best` names holds another state: it was saved at another moment "
        "(a stop at the step of the best evaluation, or a best found again after a resume)",
        "report it with the check's folders",
    ),
    CHECKPOINT: (
        "every step matched but the final checkpoint holds another state: a part the loop does not use again "
        "(the position, a generator, the best value) was saved at another moment",
        "report it: the kit takes every part at the step boundary",
    ),
    BEST: (
        "--keep-best names another checkpoint: an evaluation was lost, repeated or different after a stop, or "
        "the best one was rotated away",
        "see the evaluation records; report it if they match",
    ),
    LATEST: (
        "the run ended at another checkpoint: it stopped for good, or trained past where the uninterrupted one "
        "ended",
        "see the run's log",
    ),
    LOST: (
        "the uninterrupted run got here and the stopped one did not: the work of that point was lost across a "
        "stop (a step never trained, an evaluation never run)",
        "report it with the check's folders: a stop must never lose work",
    ),
    EXTRA: (
        "the stopped run did this and the uninterrupted one did not (a step trained twice, an evaluation run "
        "again): a resume repeated work",
        "report it with the check's folders: a resume must go on from exactly where the stop left",
    ),
}


def explain(found: Divergence, stops: Sequence[tuple[tuple[str, int, int], str]]) -> list[str]:
    """The lines that name `found`: what, where, after which stop, the likely cause and the fix. `stops`: each
    stop's position (kind, step, index) and its words, in run order."""
    what = found.part + (f" ({found.name})" if found.name else "")
    at = f"at step {found.step}" if found.step is not None else "after training"
    if found.part in OPTIMIZER_PARTS:  # "the optimizer's group 0's lr differs at step 7"
        what, at = f"the optimizer's {found.name or 'state'}", f"differs {at}"
    elif found.part == STEP_EXTRA:  # "the step's extra value 'avg' differs at step 7"
        what, at = f"the step's extra value '{found.name}'", f"differs {at}"
    elif found.part == STEP_RECORD:  # "the step's grad_norm differs at step 60"
        what, at = f"the step's {found.name}", f"differs {at}"
    lines = [f"first divergence: {what} {at}: {found.where}"]
    before = _stops_before(found, stops)
    if before:
        lines.append(f"  after stop {before} ({stops[before - 1][1]}), which the run resumed from")
    elif found.step is not None:
        lines.append("  before the first stop: two starts of the same command already differ")
    if found.straight is not None or found.stopped is not None:
        lines.append(f"  uninterrupted: {_short(found.straight)}; stopped: {_short(found.stopped)}")
    cause, fix = CAUSES[found.part]
    if found.part == LOST and found.evaluation:
        cause = (
            "the uninterrupted run evaluated here and the stopped one never did: a stop in the step at which "
            "an evaluation was due (or during it) lost that evaluation"
        )
    elif found.at is not None and found.at[1] == EPOCH_RECORD and found.part in (LOST, EXTRA):
        cause = "the uninterrupted run ended an epoch (or the run) here, once; the stopped one " + (
            "never did: a stop in that last step, or during its evaluation, lost the end of it"
            if found.part == LOST
            else "did it twice: a resume ended it again"
        )
    if not before and found.step is not None:
        cause, fix = (
            "the task draws from unseeded sources (the clock, os.urandom, a hash of object ids) or runs "
            "non-deterministic kernels",
            "seed everything from --seed (config.seed); run with --deterministic",
        )
    lines.append(f"  likely cause: {cause}")
    lines.append(f"  fix: {fix}")
    return lines


def _stops_before(found: Divergence, stops: Sequence[tuple[tuple[str, int, int], str]]) -> int:
    """How many stops came at or before the divergence (all of them for one after training)."""
    if found.at is None:
        return len(stops)
    # A stop at a step ends that step as it would have ended (its batches and its loss are the attempt's that
    # was stopped); what comes after (the step's evaluation, rerun or not, and the next steps) is the resume's.
    return sum(1 for (_, step, _), _ in stops if (step, EVAL_BATCH, 0) <= found.at)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
