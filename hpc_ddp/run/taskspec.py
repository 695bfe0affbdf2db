"""`--task module.path:function` checked where it is given (at submission), before any rank starts. No torch.

The module is read, never run: its file is found the way an import would find it (the top-level name looked
up on sys.path, which runs nothing; its packages' folders walked by hand, so no `__init__` runs either), and
its source parsed with `ast`. What that can tell without running user code is refused in one line:

    a module that is not there         --task mytasks:build: module 'mytasks' not found in ...
    a syntax error                     --task mytasks:build: mytasks.py line 7 does not parse: ...
    a top-level import that is missing --task mytasks:build: mytasks.py line 3 imports 'wandb', which is not ...
    a function that is not there       --task mytasks:buidl: mytasks has no function 'buidl'; did you mean build? ...

What it cannot know is left to the rank, which imports the module (hpc_ddp.run.tasks.resolve): a name made at
run time (`from x import *`, a module `__getattr__`, `globals()[...]`), an import inside a `try` (optional), a
module that is no plain `.py` file (compiled, zipped, a namespace package), the imports of a module that changes
sys.path. `environment` False (a Slurm job
whose --setup, --python or container gives the tasks another environment): only a module found here is read,
and its imports are not looked up.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from hpc_ddp import cli
from hpc_ddp.errors import UsageError

# A module that changes where imports look (sys.path.insert before its imports) may import what is not found
# here before it runs: its imports are left to the rank.
_PATH_CHANGES = ("sys.path", "addsitedir", "importlib", "__path__")
# Names a module defines without a statement that says so.
_IMPLICIT = ("__name__", "__file__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__")


def check(spec: str, builtins: tuple[str, ...], environment: bool = True) -> None:
    """UsageError for a `--task` that cannot work, as far as reading its module's source tells (see above).
    `environment`: the ranks run in this interpreter's environment (its sys.path, its packages)."""
    module_name, _, func_name = spec.partition(":")
    if spec in builtins or not module_name or not func_name:
        return  # a built-in; a malformed spec is TrainConfig's to refuse
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as the ranks do (hpc_ddp.run.tasks.resolve)
    path = locate(module_name)
    if path is False:
        if not environment:
            return  # the tasks' environment may hold it (a container, a venv its --setup activates)
        raise UsageError(
            f"--task {spec!r}: module {module_name!r} not found in {os.getcwd()} or PYTHONPATH. "
            "Fix: run from the folder that holds it, or add that folder to PYTHONPATH"
        )
    if path is None:
        return  # not a plain .py file: the rank's import tells
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise UsageError(
            f"--task {spec!r}: {path.name} line {e.lineno} does not parse: {e.msg}. Fix: correct that line"
        ) from e
    except (OSError, ValueError):
        return  # unreadable here: the rank's import tells
    if environment and not any(word in source for word in _PATH_CHANGES):
        _check_imports(spec, path, tree)
    names = defined(tree)
    if names is None or func_name in names:
        return
    meant = cli.nearest(func_name, [n for n in names if not n.startswith("_")])
    hint = f"; did you mean {meant}?" if meant else ""
    raise UsageError(f"--task {spec!r}: {module_name} has no function {func_name!r}{hint} (read from {path})")


def locate(module_name: str) -> Path | None | bool:
    """The .py file `module_name` imports from, found without running anything; None for one that is no plain
    .py file (or cannot be told), False for one that is not there."""
    top, *rest = module_name.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: looked up on sys.path, never run
    except (ImportError, ValueError):
        return None
    if spec is None:
        return False
    if not rest:
        origin = spec.origin or ""
        return Path(origin) if origin.endswith(".py") else None
    folders = [Path(p) for p in spec.submodule_search_locations or ()]
    if not folders:
        return False  # a plain module has no submodules
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        package = next((f / part for f in folders if (f / part / "__init__.py").is_file()), None)
        if last:
            module = next((f / f"{part}.py" for f in folders if (f / f"{part}.py").is_file()), None)
            if module is not None:
                return module
            return package / "__init__.py" if package is not None else _other(folders, part)
        if package is None:
            return _other(folders, part)
        folders = [package]
    return None


def _other(folders: list[Path], part: str) -> None | bool:
    """Nothing plain named `part` in `folders`: a namespace package or a compiled module (None: the import
    tells), or nothing at all (False)."""
    if any((f / part).is_dir() or any(f.glob(f"{part}.*")) for f in folders):
        return None
    return False


def defined(tree: ast.Module) -> set[str] | None:
    """The names a module's top level defines (functions, classes, assignments, imports, in `if`/`try`/`with`
    blocks too); None when names may be made at run time (`import *`, a module `__getattr__`, `globals()`)."""
    names = set(_IMPLICIT)
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    if "__getattr__" in names or any(
        isinstance(n, ast.Name) and n.id in ("globals", "setattr", "vars") for n in ast.walk(tree)
    ):
        return None
    names.update(n.target.id for n in ast.walk(tree) if isinstance(n, ast.NamedExpr))
    return names


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements run at a module's top level: its own, and those in its `if`, `try`, `with`, `for`
    blocks (never a function's or a class's body)."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                found.extend(_top_level(inner))
        for handler in getattr(node, "handlers", ()):
            found.extend(_top_level(handler.body))
    return found


def _check_imports(spec: str, path: Path, tree: ast.Module) -> None:
    """A top-level import (not inside a `try`: an optional one) of a package this environment does not have."""
    for node in tree.body:  # the module's own statements: an import in an `if` or a `try` may be conditional
        if isinstance(node, ast.Import):
            wanted = [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            wanted = [(node.module.split(".")[0], node.lineno)]
        else:
            continue
        for name, line in wanted:
            if name in sys.builtin_module_names or name in sys.modules:
                continue
            try:
                found = importlib.util.find_spec(name)  # a top-level name: never run
            except (ImportError, ValueError):
                continue
            if found is None:
                raise UsageError(
                    f"--task {spec!r}: {path.name} line {line} imports {name!r}, which is not installed in this "
                    f"environment ({sys.executable}). Fix: install the package that provides it, or fix the import"
                )
