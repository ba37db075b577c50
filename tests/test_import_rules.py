"""The layering rules (package docstrings) and no import cycles, checked on the source (every import statement, at module
level, under ``TYPE_CHECKING`` or inside a function: a lazy import is still a dependency).

- ``router/policy`` imports only ``router.model``, ``router.errors``, ``router.events``, itself, the
  standard library and ``mmh3`` (it is pure: the gateway, the simulator and the tests run it);
- ``router/store`` never imports ``router.gateway``;
- ``replica`` never imports ``router.gateway``;
- ``loadtests/sim`` never imports ``aiohttp``;
- no two modules of ``router``, ``replica`` and ``loadtests`` import each other, directly or round a
  longer loop.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "replica", "loadtests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` yields ``a.b`` when that is a
    module of ours, else ``a``)."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in MODULES else base


def _ours(target: str) -> str | None:
    """The module of ours that ``target`` names (or the package it is in), if any."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


GRAPH = {name: {t for t in _imports(name, path)} for name, path in MODULES.items()}


def _top(target: str) -> str:
    return target.split(".")[0]


def test_the_tree_is_what_the_rules_talk_about() -> None:
    assert "router.policy.kv_aware" in MODULES and "router.store.memory" in MODULES
    assert "loadtests.sim.run" in MODULES and "replica.agent" in MODULES


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("router.policy")))
def test_policy_imports_only_pure_things(module: str) -> None:
    allowed_ours = ("router.model", "router.errors", "router.events", "router.policy")
    for target in GRAPH[module]:
        top = _top(target)
        if top in PACKAGES:
            assert target.startswith(allowed_ours), f"{module} imports {target}"
        else:
            assert top in sys.stdlib_module_names or top == "mmh3", f"{module} imports {target}"


@pytest.mark.parametrize(
    ("prefix", "forbidden"),
    [("router.store", "router.gateway"), ("replica", "router.gateway"), ("loadtests.sim", "aiohttp")],
)
def test_layer_rules(prefix: str, forbidden: str) -> None:
    offenders = [
        f"{m} -> {t}"
        for m in MODULES
        if m == prefix or m.startswith(prefix + ".")
        for t in GRAPH[m]
        if t == forbidden or t.startswith(forbidden + ".")
    ]
    assert offenders == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    edges = {m: {o for t in GRAPH[m] if (o := _ours(t)) is not None and o != m} for m in MODULES}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle
    edges = {m: {o for o in targets if not o.startswith(m + ".")} for m, targets in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycles() -> None:
    assert _cycles() == []
