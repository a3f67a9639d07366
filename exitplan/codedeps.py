"""The project modules a pipeline stage runs, found statically, and the ones its DVC deps do not cover.

A DVC stage re-runs when one of its ``deps`` changes; code it runs but does not list can change without a re-run,
and ``dvc.lock`` then calls results current that the code would no longer produce. :func:`uncovered` closes a
stage's entry module (``exitplan stage <name>`` runs ``exitplan/stages/<name>.py``, ``python -m M`` runs ``M``) over
every project import in it, at module level or inside a function (the project imports lazily), and returns the
module files that no dep (a file, or a folder above it) covers. ``tests/test_dvc_deps.py`` holds every stage of
``dvc.yaml`` to that.

A few modules are :data:`NEUTRAL`: they shape how a stage runs or reports, never what it writes, so listing them
would only re-run the pipeline for nothing (and what they import for themselves is not followed).
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

PACKAGES = ("exitplan", "serving", "validation", "flows", "tasks")
"""Top-level packages of this project (imports of anything else are libraries)."""

NEUTRAL = {
    "exitplan/__init__.py": "the package root: REPO_ROOT and the version",
    "exitplan/errors.py": "exception types: a failing stage writes nothing",
    "exitplan/atomic.py": "how files are written (temp file + rename), not what",
    "exitplan/tracking.py": "MLflow logging of a run, outside the pipeline's outputs",
    "exitplan/runtime.py": "threads and allocator: execution settings (beyond float summation order)",
    "exitplan/config.py": "the params schema: the values a stage reads are DVC params (its `params:`), by value",
    "exitplan/cli.py": "the command line that dispatches to the stage module",
    "exitplan/kinds.py": "the names of the kinds; what each kind does is in the tables (heads, confidence, arrivals)",
}
"""Module -> why no stage lists it."""

STAGE_COMMAND = re.compile(r"^exitplan stage (?P<name>[a-z0-9-]+)")


def entry_module(cmd: str) -> str | None:
    """The dotted module a stage's command runs, or None for a command that runs no project module."""
    match = STAGE_COMMAND.match(cmd)
    if match:
        return "exitplan.stages." + match.group("name").replace("-", "_")
    words = shlex.split(cmd)
    if len(words) >= 3 and words[0].startswith("python") and words[1] == "-m":
        return words[2]
    return None


def module_path(root: Path, name: str) -> Path | None:
    """The file of dotted module ``name`` under ``root`` (a package's ``__init__.py``), None if not a project one."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(tree: ast.AST, package: str) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # a submodule, when it is one


def imports(root: Path, name: str) -> set[str]:
    """Project modules that module ``name`` imports anywhere in its body (parents' ``__init__`` included)."""
    path = module_path(root, name)
    if path is None:
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for imported in _imported_names(ast.parse(path.read_text(), str(path)), package):
        parts = imported.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                     if module_path(root, p) is not None)
    return found


def closure(root: Path, entry: str) -> set[Path]:
    """Files of every project module that running module ``entry`` can import, relative to ``root`` (what a
    :data:`NEUTRAL` module imports for itself is not followed)."""
    seen: set[str] = set()
    todo = [entry, *(".".join(entry.split(".")[:i]) for i in range(1, entry.count(".") + 1))]
    while todo:
        name = todo.pop()
        if name in seen or module_path(root, name) is None:
            continue
        seen.add(name)
        if module_path(root, name).relative_to(root).as_posix() not in NEUTRAL:  # type: ignore[union-attr]
            todo.extend(imports(root, name) - seen)
    return {p.relative_to(root) for p in (module_path(root, n) for n in seen) if p is not None}


def covers(deps: Sequence[str], file: Path) -> bool:
    """Whether one of ``deps`` (paths relative to the repo) is ``file`` or a folder above it."""
    return any(file == Path(d) or Path(d) in file.parents for d in deps)


def uncovered(root: Path, cmd: str, deps: Sequence[str]) -> list[str]:
    """The project module files that the stage command ``cmd`` runs and ``deps`` does not cover, sorted; empty when
    the deps are complete (or the command runs no project module)."""
    entry = entry_module(cmd)
    if entry is None:
        return []
    return sorted(str(f) for f in closure(root, entry) if _matters(root, f) and not covers(deps, f))


def _matters(root: Path, file: Path) -> bool:
    """Whether ``file`` can change a stage's outputs: not :data:`NEUTRAL`, and not a package's ``__init__.py`` that
    holds nothing but a docstring and ``from __future__`` lines."""
    if file.as_posix() in NEUTRAL:
        return False
    if file.name != "__init__.py":
        return True
    body = ast.parse((root / file).read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__") for n in body)
