"""The layers (docs/architecture.md): every hpc_ddp import goes to its own layer or a lower one; no cycle; and the
sizes a reader measures (no function, class or constructor over its size).

Every `import` and `from ... import` of every module counts, wherever it stands: at module level, inside a
function (the lazy imports that keep `--help` fast) and under `if TYPE_CHECKING:`. A module's layer follows
from its path; a new module outside the known places fails until it is given one here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "hpc_ddp"
# Lowest first. A module may import its own layer and the ones before it.
LAYERS = ("base", "cluster", "scheduler", "ledger", "run", "launch", "tools", "entry")
BASE = {
    "hpc_ddp._version",
    "hpc_ddp.cli",
    "hpc_ddp.errors",
    "hpc_ddp.exitcodes",
    "hpc_ddp.log",
    "hpc_ddp.proc",
    "hpc_ddp.registry",  # the plugin registries: entry points by name, no import of what they name
    "hpc_ddp.variables",
}
ENTRY = {"hpc_ddp", "hpc_ddp.__main__", "hpc_ddp.train", "hpc_ddp.submit"}
PACKAGES = {
    "hpc_ddp.cluster": "cluster",
    "hpc_ddp.dist": "cluster",
    "hpc_ddp.scheduler": "scheduler",
    "hpc_ddp.ledger": "ledger",
    "hpc_ddp.run": "run",
    "hpc_ddp.plugins": "run",  # the public plugin API: run's and the scheduler's interfaces and built-ins
    "hpc_ddp.launch": "launch",
    "hpc_ddp.doctor": "tools",
    "hpc_ddp.bench": "tools",
    "hpc_ddp.report": "tools",
    "hpc_ddp.checkpoint": "tools",  # python -m hpc_ddp.checkpoint export
    "hpc_ddp.examples": "tools",  # user-facing tasks, built on run; run's BUILTINS names them lazily by path
}
# hpc_ddp.slurm_job only re-exports launch.slurm.submitter.TaskEntry for old pickles: it sits in that layer.
ALIASES = {"hpc_ddp.slurm_job": "launch"}


def layer_of(module: str) -> str | None:
    if module in BASE:
        return "base"
    if module in ENTRY:
        return "entry"
    if module in ALIASES:
        return ALIASES[module]
    for package, layer in PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return layer
    return None


def tool_of(module: str) -> str | None:
    """'hpc_ddp.doctor', 'hpc_ddp.bench' or 'hpc_ddp.report' for the modules of a tool, else None."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    return package if PACKAGES.get(package) == "tools" else None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(source: str, module: str, is_package: bool, known: Iterable[str]) -> list[tuple[int, str]]:
    """(line, imported hpc_ddp module) for every import statement anywhere in `source`.

    `from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg` itself."""
    known = set(known)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):  # every statement: module level, functions, TYPE_CHECKING blocks
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if candidate in known else base))
    return [(line, name) for line, name in found if name == "hpc_ddp" or name.startswith("hpc_ddp.")]


def violations(module: str, targets: Iterable[tuple[int, str]], where: str) -> list[str]:
    """What is wrong with `module` importing `targets`, one message per offending import."""
    mine = layer_of(module)
    if mine is None:
        return [
            f"{where}: {module} has no layer; place it in tests/test_architecture.py (and docs/architecture.md)"
        ]
    allowed = LAYERS[: LAYERS.index(mine) + 1]
    found = []
    for line, target in targets:
        theirs = layer_of(target)
        if theirs is None:
            found.append(f"{where}:{line}: {module} imports {target}, which has no layer")
        elif theirs not in allowed:
            found.append(
                f"{where}:{line}: {module} ({mine}) imports {target} ({theirs}); {mine} may import "
                f"only {', '.join(allowed)}"
            )
        elif mine == theirs == "tools" and tool_of(module) != tool_of(target):
            found.append(
                f"{where}:{line}: {module} imports {target}; the tools (doctor, bench, report) do not "
                "import each other (what two need belongs in a lower layer)"
            )
    return found


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> imported modules): each strongly connected component of more than
    one module, or a module that imports itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {
        name: {
            target
            for _, target in imports(path.read_text(), name, path.name == "__init__.py", modules)
            if target != name
        }
        for name, path in modules.items()
    }


# ----- the package as it is ---------------------------------------------------------------------------------


def test_every_folder_of_modules_is_a_package() -> None:
    """setuptools packages only folders with an __init__.py: one missing leaves its modules out of a wheel."""
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []


def test_every_module_has_a_layer() -> None:
    assert [name for name in all_modules() if layer_of(name) is None] == []


def test_every_import_goes_to_the_same_layer_or_a_lower_one() -> None:
    modules = all_modules()
    found = []
    for name, path in modules.items():
        targets = imports(path.read_text(), name, path.name == "__init__.py", modules)
        found += violations(name, targets, str(path.relative_to(ROOT)))
    assert found == [], "\n".join(found)


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_check_sees_the_imports_that_are_there() -> None:
    """Not vacuous: the graph holds the lazy and TYPE_CHECKING imports the package really has."""
    graph = import_graph()
    assert "hpc_ddp.run.session" in graph["hpc_ddp.train"]
    assert "hpc_ddp.run.loop.trainer" in graph["hpc_ddp.run.session"]  # inside a function
    assert "hpc_ddp.run.loop.position" in graph["hpc_ddp.run.records.metrics"]  # under TYPE_CHECKING
    assert "hpc_ddp.launch.slurm.submitter" in graph["hpc_ddp.slurm_job"]
    assert "hpc_ddp.run.strategy.base" in graph["hpc_ddp.run.strategy"]
    assert "hpc_ddp.run.checkpoint.store" in graph["hpc_ddp.run.loop.trainer"]


def test_the_loop_names_no_strategy_and_no_checkpoint_format() -> None:
    """The trainer talks to its Strategy and its Checkpointer (docs/architecture.md): a new strategy, format or
    storage is a file of its own, and the loop imports none of today's."""
    from hpc_ddp import registry
    from hpc_ddp.run import strategy

    named = {where.partition(":")[0] for where in strategy.STRATEGIES.values()}
    named |= {where.partition(":")[0] for where in registry.BUILTINS["hpc_ddp.checkpoint_formats"].values()}
    assert named >= {"hpc_ddp.run.strategy.ddp", "hpc_ddp.run.checkpoint.full"}  # not vacuous
    assert sorted(named & import_graph()["hpc_ddp.run.loop.trainer"]) == []


def test_every_strategy_the_registry_names_loads_lazily_from_its_own_layer() -> None:
    """run/strategy's registry names modules by string (imported when a run asks for one): each must exist,
    sit under run/strategy, and not be imported by the registry itself (a ddp run must not pay for fsdp)."""
    from hpc_ddp.run import strategy

    graph = import_graph()
    for name, where in strategy.STRATEGIES.items():
        module = where.partition(":")[0]
        assert module.startswith("hpc_ddp.run.strategy."), where
        assert module in graph, where
        assert strategy.kind(name).name == name
    assert "hpc_ddp.run.strategy.fsdp" not in graph["hpc_ddp.run.strategy"]
    assert "hpc_ddp.run.checkpoint.durable" in graph["hpc_ddp.run.checkpoint.store"]


# What the supervisors (the local launcher, the Slurm batch step) import to read a run folder: no torch, not even
# lazily, anywhere in what they pull in (torch costs seconds, and a supervisor's environment need not have it).
TORCH_FREE = ("hpc_ddp.run.checkpoint", "hpc_ddp.run.checkpoint.store")


def imports_torch(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "torch"
        ):
            return True
    return False


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_checkpoint_store_pulls_in_no_torch(module: str) -> None:
    graph, modules = import_graph(), all_modules()
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(graph.get(name, ()))
    assert [name for name in sorted(seen) if imports_torch(modules[name].read_text())] == []
    assert imports_torch("def f():\n    import torch.distributed as dist\n")  # the check is not vacuous


# ----- the rule itself, on synthetic modules ------------------------------------------------------------------

KNOWN = [
    "hpc_ddp",
    "hpc_ddp.launch",
    "hpc_ddp.launch.local",
    "hpc_ddp.run",
    "hpc_ddp.run.session",
    "hpc_ddp.run.folder",
    "hpc_ddp.cluster",
    "hpc_ddp.cluster.env",
    "hpc_ddp.doctor",
    "hpc_ddp.doctor.facts",
    "hpc_ddp.bench",
    "hpc_ddp.bench.runs",
    "hpc_ddp.errors",
]


def check(module: str, source: str, is_package: bool = False) -> list[str]:
    return violations(module, imports(source, module, is_package, KNOWN), "x.py")


@pytest.mark.parametrize(
    "module, source, named",
    [
        (
            "hpc_ddp.run.session",
            "def f():\n    from hpc_ddp.launch.local import Launcher\n",
            "hpc_ddp.launch.local",
        ),
        (
            "hpc_ddp.cluster.env",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpc_ddp.run.folder import MODEL\n",
            "hpc_ddp.run.folder",
        ),
        ("hpc_ddp.run.session", "from ..launch import local\n", "hpc_ddp.launch.local"),
        ("hpc_ddp.run.session", "import hpc_ddp.launch.local as l\n", "hpc_ddp.launch.local"),
        ("hpc_ddp.run.session", "from hpc_ddp import Task\n", "hpc_ddp (entry)"),
        ("hpc_ddp.errors", "from hpc_ddp.cluster import env\n", "hpc_ddp.cluster.env"),
        (
            "hpc_ddp.doctor.facts",
            "from hpc_ddp.bench import runs\n",
            "the tools (doctor, bench, report) do not",
        ),
        ("hpc_ddp.report.plots", "from hpc_ddp.doctor import facts\n", "hpc_ddp.doctor.facts"),
        (
            "hpc_ddp.bench.runs",
            "def f():\n    from hpc_ddp.doctor.facts import gather\n",
            "hpc_ddp.doctor.facts",
        ),
    ],
)
def test_the_rule_names_an_upward_or_sideways_import(module: str, source: str, named: str) -> None:
    found = check(module, source)
    assert len(found) == 1 and named in found[0], found
    assert found[0].startswith("x.py:")


@pytest.mark.parametrize(
    "module, source",
    [
        ("hpc_ddp.launch.local", "from hpc_ddp.run import folder\nfrom hpc_ddp.cluster.env import detect\n"),
        ("hpc_ddp.run.session", "from . import folder\nfrom hpc_ddp import errors\n"),
        ("hpc_ddp.doctor.facts", "def f():\n    from hpc_ddp.launch import local\n"),
        ("hpc_ddp", "def __getattr__(name):\n    from hpc_ddp.doctor.facts import gather\n"),
    ],
)
def test_the_rule_lets_downward_imports_pass(module: str, source: str) -> None:
    assert check(module, source) == []


def test_a_module_without_a_layer_is_named() -> None:
    assert check("hpc_ddp.stray", "import os\n") == [
        "x.py: hpc_ddp.stray has no layer; place it in tests/test_architecture.py (and docs/architecture.md)"
    ]


def test_cycles_are_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_ledger_and_the_supervisors_rules_need_no_torch() -> None:
    """Both sides import the ledger, supervisors before anything else: it must stay light (no torch)."""
    torch_users = []
    for name, path in all_modules().items():
        if name.startswith(("hpc_ddp.ledger", "hpc_ddp.variables")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                torch_users += [f"{name}: {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert torch_users == []


def test_a_ddp_rank_does_not_import_dcp_dtensor_or_sympy() -> None:
    """What every ddp rank imports at start leaves FSDP's dependencies alone: DCP, DTensor and sympy cost
    about 2 s of start-up per rank on this machine, paid only by a run that shards."""
    code = (
        "import sys, hpc_ddp.run.session, hpc_ddp.run.loop.trainer, hpc_ddp.run.checkpoint.resume, hpc_ddp.run.tasks\n"
        "from hpc_ddp.run import strategy\n"
        "from hpc_ddp.run.checkpoint import formats\n"
        "strategy.kind('ddp')\n"
        "print(sorted(m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', 'sympy') "
        "if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----- the scheduler seam: Slurm's commands and variables stay in hpc_ddp/scheduler -------------------------------

SCHEDULER = "hpc_ddp.scheduler"
# The one table of launcher variables (and `detect`, which reads it): its names may stand there too.
ENV_TABLES = ("hpc_ddp.cluster.env",)
SLURM_COMMANDS = frozenset(
    {"scontrol", "sacct", "squeue", "sinfo", "sbatch", "scancel", "srun", "salloc", "sattach", "sstat"}
)
SLURM_VARIABLE = re.compile(r"(SLURM|SLURMD|SRUN|SALLOC|SBATCH)_[A-Z0-9_]*")
SUBMITIT_SUBMITS = frozenset({"SlurmExecutor", "AutoExecutor", "_make_sbatch_string"})  # what runs sbatch
# A module none of these words occurs in uses nothing of Slurm's: it is not parsed (most are not).
_MENTIONS = re.compile("|".join([*SLURM_COMMANDS, "SLURM", "SRUN_", "SALLOC_", "SBATCH_", *SUBMITIT_SUBMITS]))


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def slurm_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place `source` runs a Slurm command (an argv whose first word is one; a call given
    one's name, as shutil.which("sbatch") or a runner), submits through submitit, or names a Slurm variable (a
    string that is one whole name, or a prefix of them). Docstrings, comments and messages that mention a
    command or a variable among other words are prose, not uses."""
    if not _MENTIONS.search(source):
        return []
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in SLURM_COMMANDS:
                found.append((node.lineno, f"runs {first.value}"))
        if isinstance(node, ast.Call):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Constant) and arg.value in SLURM_COMMANDS:
                    found.append((node.lineno, f"asks for {arg.value}"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if SLURM_VARIABLE.fullmatch(node.value):
                found.append((node.lineno, f"names {node.value}"))
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if name in SUBMITIT_SUBMITS:
            found.append((node.lineno, f"submits through submitit ({name})"))
    return found


def test_only_the_scheduler_package_runs_slurm_or_names_its_variables() -> None:
    """Issue 34: 30 files outside the Slurm folder named Slurm's commands or variables; run/loop/preemption ran
    `scontrol requeue`, run/records/record `scontrol --version`, report/sources had its own `sacct` call and parser.
    Everything Slurm is asked goes through hpc_ddp/scheduler; its variables are named in the one table."""
    found = []
    for name, path in all_modules().items():
        if name == SCHEDULER or name.startswith(SCHEDULER + ".") or name in ENV_TABLES:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in slurm_uses(path.read_text())]
    assert found == [], "\n".join(found)


def test_the_scheduler_package_is_where_slurm_is_asked() -> None:
    """Not vacuous: the check sees the scheduler's own commands and the emulated step's variables."""
    modules = all_modules()
    client = slurm_uses(modules["hpc_ddp.scheduler.slurm.client"].read_text())
    assert {"sacct", "scontrol", "squeue", "sinfo", "scancel"} <= {w.split()[-1] for _, w in client}
    assert "names SLURM_PROCID" in {w for _, w in slurm_uses(modules["hpc_ddp.scheduler.local"].read_text())}


@pytest.mark.parametrize(
    "source, what",
    [
        ('proc.run(["scontrol", "requeue", job])\n', "runs scontrol"),
        ('out = run(("sacct", "-j", job))\n', "runs sacct"),
        ('shutil.which("sbatch")\n', "asks for sbatch"),
        ('environ.get("SLURM_JOB_NODELIST")\n', "names SLURM_JOB_NODELIST"),
        ('[k for k in env if k.startswith("SLURM_")]\n', "names SLURM_"),
        ('env["SLURMD_NODENAME"]\n', "names SLURMD_NODENAME"),
        ("ex = submitit.SlurmExecutor(folder=f)\n", "submits through submitit (SlurmExecutor)"),
    ],
)
def test_the_check_names_a_slurm_use(source: str, what: str) -> None:
    assert [w for _, w in slurm_uses(source)] == [what]


@pytest.mark.parametrize(
    "source",
    [
        '"""Runs `scontrol requeue` on SLURM_JOB_ID."""\n',  # a docstring
        'if mode == "scontrol":\n    pass\n',  # a mode's name, compared
        'REQUEUE_BY = ("auto", "scontrol", "launcher")\n',  # a choice among others
        'say(f"scancel {job} failed: cancel it yourself")\n',  # advice in a message
        'raise ValueError(f"SLURM_PROCID={rank} is out of range")\n',  # a variable named in a message
    ],
)
def test_the_check_leaves_prose_and_mode_names_alone(source: str) -> None:
    assert slurm_uses(source) == []


# ----- one decision (issue 43 item 5) and one scheduler seam (item 6) ----------------------------------------
# What follows an attempt is decided once, by hpc_ddp.ledger.decision.decide (the budgets' rules beneath it): no
# other module builds a decision, edits one (dataclasses.replace), or reads a decision's message to learn what
# was decided. The scheduler is chosen by the registry (hpc_ddp.scheduler.detect): run/ and report/ never import
# the Slurm scheduler nor ask for a scheduler by name.
DECIDERS = ("hpc_ddp.ledger.decision", "hpc_ddp.ledger.rules")
NO_SCHEDULER_NAMES = ("hpc_ddp.run", "hpc_ddp.report")
_TEXT_MATCHES = frozenset(
    {"split", "partition", "rpartition", "startswith", "endswith", "find", "index", "replace"}
)


def _about_a_decision(node: ast.AST) -> bool:
    """An expression that names a decision: `decision`, `decided`, `closed.decision`, `x.decision`."""
    text = ast.unparse(node)
    return bool(re.search(r"\b(decision|decided)\b", text))


def decision_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place `source` builds a decision (a call of `Decision` or `x.Decision`), edits one
    (`replace(decision, ...)`), or matches on a decision's message (a string method of it, `in` it)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == "Decision" or name.endswith(".Decision"):
                found.append((node.lineno, "builds a Decision"))
            if (
                (name == "replace" or name.endswith(".replace"))
                and node.args
                and _about_a_decision(node.args[0])
            ):
                if not (isinstance(node.func, ast.Attribute) and _is_message(node.func.value)):
                    found.append((node.lineno, f"edits a decision ({ast.unparse(node.args[0])})"))
            if isinstance(node.func, ast.Attribute) and node.func.attr in _TEXT_MATCHES:
                if _is_message(node.func.value):
                    found.append((node.lineno, f"matches on a decision's message ({node.func.attr})"))
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_message(c) for c in node.comparators):
                found.append((node.lineno, "matches on a decision's message (in)"))
    return found


def _is_message(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr in ("message", "said") and _about_a_decision(node.value)
    )


def test_one_decision_function() -> None:
    """Issue 43: four actors adjusted the ledger's decision after the fact, and one launcher cut a decision's
    message at ". Resume with". Only the ledger's decide builds a decision; every actor acts on it as it is."""
    found = []
    for name, path in all_modules().items():
        if name in DECIDERS:
            continue
        found += [
            f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in decision_uses(path.read_text())
        ]
    assert found == [], "\n".join(found)


def test_the_ledger_is_where_decisions_are_built() -> None:
    """Not vacuous: the check sees the ledger's own decisions."""
    modules = all_modules()
    assert "builds a Decision" in {
        w for _, w in decision_uses(modules["hpc_ddp.ledger.decision"].read_text())
    }


@pytest.mark.parametrize(
    "source, what",
    [
        ('rules.Decision(outcomes.STOP, "no", decision.exclude)\n', "builds a Decision"),
        ('d = Decision("stop", "no")\n', "builds a Decision"),
        ('replace(decision, action="restart")\n', "edits a decision (decision)"),
        ("dataclasses.replace(closed.decision, nodes=2)\n", "edits a decision (closed.decision)"),
        (
            'say(closed.decision.message.split(". Resume with")[0])\n',
            "matches on a decision's message (split)",
        ),
        ('if "budget" in decided.message:\n    pass\n', "matches on a decision's message (in)"),
    ],
)
def test_the_check_names_a_decision_use(source: str, what: str) -> None:
    assert [w for _, w in decision_uses(source)] == [what]


@pytest.mark.parametrize(
    "source",
    [
        'say(f"job {job} stops: {decision.said}")\n',  # a decision said, whole
        "if decided.action == outcomes.REQUEUE:\n    pass\n",  # acted on by its data
        'log.info(f"{name}: {choice.message}")\n',  # rank 0's words about it
    ],
)
def test_the_check_leaves_acting_on_a_decision_alone(source: str) -> None:
    assert decision_uses(source) == []


def test_the_batch_shell_is_split_by_concern() -> None:
    """Issue 43: launch/slurm/batch.py was 607 lines that re-read the raw environment at every decision. Now the
    job is read once (`job.Job`) and each step has its module, none over 300 lines; only `job` reads the
    batch environment's variables."""
    modules = all_modules()
    parts = ("batch", "batch_begin", "batch_end", "job")
    for part in parts:
        lines = len(modules[f"hpc_ddp.launch.slurm.{part}"].read_text().splitlines())
        assert lines <= 300, f"launch/slurm/{part}.py has {lines} lines (at most 300)"
    for part in parts[:-1]:
        source = modules[f"hpc_ddp.launch.slurm.{part}"].read_text()
        assert "slurm_env." not in source and "environ.get(" not in source, part


def scheduler_names(source: str, module: str, known: Iterable[str]) -> list[tuple[int, str]]:
    """(line, what) for each place `source` imports the Slurm scheduler or asks for a scheduler by name."""
    found = [
        (line, f"imports {target}")
        for line, target in imports(source, module, False, known)
        if target == f"{SCHEDULER}.slurm" or target.startswith(f"{SCHEDULER}.slurm.")
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("scheduler.of", "of"):
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, f"asks for scheduler {node.args[0].value!r} by name"))
    return found


def test_run_and_report_never_import_or_name_the_slurm_scheduler() -> None:
    """Issue 43 item 6: `scheduler.of("slurm")` stood in run/ and report/. Their scheduler is the registry's
    choice (hpc_ddp.scheduler.detect from what cluster.env.detect found, or its default)."""
    modules = all_modules()
    found = []
    for name, path in modules.items():
        if any(name == p or name.startswith(p + ".") for p in NO_SCHEDULER_NAMES):
            lines = scheduler_names(path.read_text(), name, modules)
            found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in lines]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "source, what",
    [
        ('scheduler.of("slurm").version()\n', "asks for scheduler 'slurm' by name"),
        ("from hpc_ddp.scheduler.slurm import client\n", "imports hpc_ddp.scheduler.slurm.client"),
        (
            "from hpc_ddp.scheduler.slurm.client import SlurmClient\n",
            "imports hpc_ddp.scheduler.slurm.client",
        ),
    ],
)
def test_the_check_names_a_scheduler_by_name(source: str, what: str) -> None:
    modules = all_modules()
    assert [w for _, w in scheduler_names(source, "hpc_ddp.run.x", modules)] == [what]
    assert scheduler_names("scheduler.default().version()\n", "hpc_ddp.run.x", modules) == []


# ----- sizes, a reader's measure (issue 34) -----------------------------------------------------------------
# No function over 80 lines, no class in run/ over 350 lines and none elsewhere over 400, no constructor over 9
# parameters, everywhere (launch/, ledger/ and scheduler/ included). Lines are the definition's whole extent
# (docstring and comments included); a constructor's parameters are its `__init__`'s, `self` left out (a
# dataclass's fields are a record, not a parameter list).
MAX_FUNCTION, MAX_CLASS, MAX_RUN_CLASS, MAX_PARAMETERS = 80, 400, 350, 9


def oversized(source: str, where: str) -> list[str]:
    """What in module `source` (at `where`, a path under the root) is over its size, one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            limit = MAX_RUN_CLASS if where.startswith("hpc_ddp/run/") else MAX_CLASS
            if lines > limit:
                found.append(f"{where}:{node.lineno}: class {node.name} has {lines} lines (at most {limit})")
            continue
        if lines > MAX_FUNCTION:
            found.append(f"{where}:{node.lineno}: {node.name}() has {lines} lines (at most {MAX_FUNCTION})")
        args = node.args
        count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) - 1
        count += (args.vararg is not None) + (args.kwarg is not None)
        if node.name == "__init__" and count > MAX_PARAMETERS:
            found.append(f"{where}:{node.lineno}: __init__ has {count} parameters (at most {MAX_PARAMETERS})")
    return found


def test_no_function_class_or_constructor_is_over_its_size() -> None:
    found = []
    for path in all_modules().values():
        where = path.relative_to(ROOT).as_posix()
        found += oversized(path.read_text(), where)
    assert found == [], "\n".join(found)


def test_the_size_rule_names_what_is_over() -> None:
    """Not vacuous: each limit, one line over it and exactly at it."""
    body = "".join(f"    x{i} = {i}\n" for i in range(78))
    assert oversized(f"def f():\n    '''Doc.'''\n{body}", "hpc_ddp/x.py") == []  # 80 lines
    assert oversized(f"def f():\n    '''Doc.'''\n{body}    y = 0\n", "hpc_ddp/x.py") == [
        "hpc_ddp/x.py:1: f() has 81 lines (at most 80)"
    ]
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(117))  # 351 lines
    cls = f"class C:\n{methods}"
    assert oversized(cls, "hpc_ddp/run/x.py") == ["hpc_ddp/run/x.py:1: class C has 351 lines (at most 350)"]
    assert oversized(cls, "hpc_ddp/report/x.py") == []
    params = ", ".join(f"p{i}" for i in range(9))
    assert oversized(f"class C:\n    def __init__(self, {params}):\n        pass\n", "hpc_ddp/x.py") == []
    assert oversized(
        f"class C:\n    def __init__(self, {params}, *, q):\n        pass\n", "hpc_ddp/x.py"
    ) == ["hpc_ddp/x.py:2: __init__ has 10 parameters (at most 9)"]


# ----- checkpoints: a format owns its files, the run's storage reaches every reader (issue 43) ---------------
CHECKPOINT = "hpc_ddp.run.checkpoint"
# The built-in formats' own modules: only the checkpoint package, and the registries that name them, import them.
FORMAT_MODULES = {f"{CHECKPOINT}.full", f"{CHECKPOINT}.sharded", f"{CHECKPOINT}.streamed"}
NAMES_THE_FORMATS = {"hpc_ddp.registry", "hpc_ddp.plugins"}
STORAGE_TYPES = ("Storage", "CheckpointStore", "Local", "LocalStorage")


def storage_defaults(source: str) -> list[tuple[int, str]]:
    """(line, what) for every parameter (and dataclass field) that defaults to a storage: one annotated as a
    storage or a checkpoint store, one named `storage` or `checkpoints`, or any default that builds the local
    one (`Local()`, `LocalStorage()`, `LOCAL`). A reader that falls back on a default reads past the run's."""
    found = []

    def local(value: ast.expr) -> bool:
        names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(value) if isinstance(n, ast.Attribute)}
        return bool(names & {"Local", "LocalStorage", "LOCAL"})

    def storage_like(name: str, annotation: ast.expr | None) -> bool:
        text = ast.unparse(annotation) if annotation is not None else ""
        return name in ("storage", "checkpoints") or any(re.search(rf"\b{t}\b", text) for t in STORAGE_TYPES)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            for arg, default in pairs:
                if storage_like(arg.arg, arg.annotation) or local(default):
                    found.append((node.lineno, f"{node.name}({arg.arg}=...) defaults to a storage"))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and item.value is not None
                    and isinstance(item.target, ast.Name)
                ):
                    if storage_like(item.target.id, item.annotation) or local(item.value):
                        found.append((item.lineno, f"{node.name}.{item.target.id} defaults to a storage"))
        elif isinstance(node, ast.Assign) and local(node.value) and isinstance(node.value, ast.Call):
            found.append((node.lineno, "a module-level storage of its own (LOCAL = Local())"))
    return found


def test_no_parameter_defaults_to_a_storage() -> None:
    """Issue 43: 33 parameters defaulted to the local storage, and every reader bypassed the run's. The run's
    checkpoint store (its folder and storage) is built once per process and handed to every reader."""
    found = []
    for path in all_modules().values():
        where = path.relative_to(ROOT).as_posix()
        found += [f"{where}:{line}: {what}" for line, what in storage_defaults(path.read_text())]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "def f(path, storage: Storage = LOCAL): ...\n",
        "def f(path, *, storage=None): ...\n",
        "def f(path, checkpoints: CheckpointStore | None = None): ...\n",
        "def f(path, where=Local()): ...\n",
        "class C:\n    storage: Storage = field(default_factory=Local)\n",
        "LOCAL = Local()\n",
    ],
)
def test_the_storage_rule_names_a_default(source: str) -> None:
    assert len(storage_defaults(source)) == 1, storage_defaults(source)


def test_the_storage_rule_leaves_a_storage_handed_in_alone() -> None:
    source = "def f(path, storage: Storage, verify: bool = True): ...\ndef g(name: str = 'local'): ...\n"
    assert storage_defaults(source) == []


def test_nothing_outside_the_checkpoint_package_picks_a_format_by_name() -> None:
    """A format owns its files (staging, verifying, resharding, model.pth, load_model, the CLI's export): the
    resume, the session, the doctor and hpc_ddp.checkpoint ask `formats.format_of(path, storage)` and the format
    it returns, never one of the built-ins' modules (nor, so, a checkpoint's shape: only a format's `owns` asks
    whether it is a file or a folder)."""
    found = []
    for name, targets in import_graph().items():
        if name.startswith(CHECKPOINT + ".") or name == CHECKPOINT or name in NAMES_THE_FORMATS:
            continue
        found += [f"{name} imports {t}" for t in sorted(targets & FORMAT_MODULES)]
    assert found == [], "\n".join(found)
    graph = import_graph()  # not vacuous: the readers do ask the formats
    for reader in (
        "hpc_ddp.run.session",
        "hpc_ddp.run.checkpoint.resume",
        "hpc_ddp.checkpoint",
        "hpc_ddp.doctor.resume",
    ):
        assert f"{CHECKPOINT}.formats" in graph[reader], reader


def test_importing_the_options_imports_no_runtime_code() -> None:
    """Issue 43 item 4: the option parts live in modules that import no runtime code. Importing the config (what
    every entry point's --help and usage errors pay) imports neither the watchdog nor the ledger nor a loader:
    only the option modules, the packages they sit in, and what they check against (measured 2026-12-07: 80 ms
    and 46 of the kit's modules before, about 45 ms and 24 after)."""
    code = "import sys, hpc_ddp.run.config; print(' '.join(sorted(m for m in sys.modules if m.startswith('hpc_ddp'))))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    packages = {m for m in out if (ROOT / m.replace(".", "/") / "__init__.py").is_file()}
    allowed = {"hpc_ddp._version", "hpc_ddp.errors", "hpc_ddp.exitcodes", "hpc_ddp.registry"}
    allowed |= {"hpc_ddp.run.config", "hpc_ddp.run.options", "hpc_ddp.run.taskargs", "hpc_ddp.run.sinks.base"}
    runtime = [m for m in out if m not in packages | allowed and not m.endswith(".options")]
    assert runtime == [], runtime
    assert not any(m.startswith("hpc_ddp.ledger") or m.endswith(".watchdog") for m in out), out


PRELOAD_PROBE = """
import os, signal, sys, threading
from hpc_ddp.run import startup
startup.import_torch()
handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
class Seen(dict):
    read = set()
    def __getitem__(self, key):
        Seen.read.add(key)
        return super().__getitem__(key)
    def get(self, key, default=None):
        Seen.read.add(key)
        return super().get(key, default)
    def __contains__(self, key):
        Seen.read.add(key)
        return super().__contains__(key)
os.environ = Seen(os.environ)
cwd = os.getcwd
os.getcwd = lambda: (Seen.read.add("<cwd>"), cwd())[1]
before = set(sys.modules)
startup.import_frozen(*startup.RANK_MODULES)
changed = [s.name for s, h in handlers.items() if signal.getsignal(s) is not h]
kit = sorted(m for m in set(sys.modules) - before if m.startswith("hpc_ddp"))
print(threading.active_count(), sorted(Seen.read), changed, len(kit))
"""


def test_the_fork_servers_preload_reads_no_environment_and_starts_nothing() -> None:
    """The local launcher's fork server imports startup.RANK_MODULES once for every rank it forks (issue 43's
    suite time: 117 modules, 0.05 CPU-s a rank, imported after the fork before). A rank forked after them must be
    the rank that imported them itself: importing them reads no environment variable and no working directory,
    starts no thread and sets no signal handler. Each module listed is really imported there."""
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD_PROBE], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split(" ", 1)
    threads, rest = int(out[0]), out[1]
    assert threads == 1, rest
    assert rest.startswith("[] [] "), rest  # nothing read, no handler changed
    assert int(rest.split()[-1]) >= 20, rest  # the kit's modules really came in there
