"""No private attribute of a dependency is used (aiohttp above all: its minor releases change them).

Checked on the source of ``router``, ``replica`` and ``loadtests``:
- a private name (``_x``, not a dunder) read off any object must be one this tree defines itself;
- a class that subclasses one of aiohttp's defines and assigns no private names (no overriding
  ``_make_server``, no ``_send_headers_immediately = False``, no ``self._server = ...``);
- nothing assigns ``__class__``, nothing edits an app's middleware list after building it, and no
  module of aiohttp is imported that ``aiohttp`` / ``aiohttp.web`` do not re-export.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for pkg in ("router", "replica", "loadtests") for p in (ROOT / pkg).rglob("*.py"))
# documented API despite the underscore (namedtuple)
PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make"})
AIOHTTP_PUBLIC_MODULES = frozenset({"aiohttp", "aiohttp.web", "aiohttp.test_utils", "aiohttp.abc"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in FILES]


TREES = _trees()


def _defined_here() -> set[str]:
    names: set[str] = set()
    for _, tree in TREES:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.alias):
                names.add((n.asname or n.name).split(".")[-1])
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                names.add(n.value)  # __slots__ entries
    return names


def test_no_private_name_of_a_dependency_is_read() -> None:
    ours = _defined_here()
    offenders = [
        f"{p.relative_to(ROOT)}:{n.lineno}: .{n.attr}"
        for p, tree in TREES
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in ours
    ]
    assert offenders == []


def _aiohttp_names(tree: ast.Module) -> set[str]:
    """Names a module binds to aiohttp or to its members (``web``, ``aiohttp``, ``StreamResponse``...)."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in n.names if a.name.startswith("aiohttp"))
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("aiohttp"):
            names.update(a.asname or a.name for a in n.names)
    return names


def _base_name(base: ast.expr) -> str | None:
    while isinstance(base, ast.Attribute):
        base = base.value
    return base.id if isinstance(base, ast.Name) else None


def test_subclasses_of_aiohttp_classes_touch_no_private_names() -> None:
    offenders = []
    for p, tree in TREES:
        foreign = _aiohttp_names(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if not any(_base_name(b) in foreign for b in cls.bases):
                continue
            for n in ast.walk(cls):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name):
                    offenders.append(f"{p.relative_to(ROOT)}:{n.lineno}: {cls.name}.{n.name}")
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and _private(n.id):
                    offenders.append(f"{p.relative_to(ROOT)}:{n.lineno}: {cls.name}.{n.id}")
                elif isinstance(n, ast.Attribute) and _private(n.attr):
                    offenders.append(f"{p.relative_to(ROOT)}:{n.lineno}: {cls.name} .{n.attr}")
    assert offenders == []


def test_no_class_swap_no_middleware_edits_no_private_aiohttp_modules() -> None:
    offenders = []
    for p, tree in TREES:
        where = p.relative_to(ROOT)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr == "__class__" and isinstance(n.ctx, ast.Store):
                offenders.append(f"{where}:{n.lineno}: assigns __class__")
            if (
                isinstance(n, ast.Subscript)
                and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == "middlewares"
            ):
                offenders.append(f"{where}:{n.lineno}: edits .middlewares")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                target = n.func.value
                if isinstance(target, ast.Attribute) and target.attr == "middlewares":
                    offenders.append(f"{where}:{n.lineno}: .middlewares.{n.func.attr}()")
            module = (n.module or "") if isinstance(n, ast.ImportFrom) else ""
            if module.startswith("aiohttp") and module not in AIOHTTP_PUBLIC_MODULES:
                offenders.append(f"{where}:{n.lineno}: from {module} import ...")
            if isinstance(n, ast.Import):
                offenders += [
                    f"{where}:{n.lineno}: import {a.name}"
                    for a in n.names
                    if a.name.startswith("aiohttp") and a.name not in AIOHTTP_PUBLIC_MODULES
                ]
    assert offenders == []


@pytest.mark.parametrize("name", ["_make_server", "_send_headers_immediately", "_ssl_context", "_backlog"])
def test_the_names_the_issue_found_are_gone(name: str) -> None:
    pattern = re.compile(rf"\.{name}\b|\bdef {name}\b|^\s*{name}\s*=", re.MULTILINE)
    assert [str(p.relative_to(ROOT)) for p in FILES if pattern.search(p.read_text())] == []
