"""The house rules, read from the code: arrows one way, no circles, files a reader can hold.

Every import counts, at any depth: a lazy one inside a function and a type-checking one too,
since each ties the two modules together as much as one at the top does.

- Layers: each top-level package may import only the packages below it (``ALLOWED``); every
  pair of packages is stated, and a new top-level package fails until it is placed.
- Circles: no two modules import each other, directly or around a longer loop.
- Size: no module of the packages, nor any script (or a script's helper module) under
  ``scripts/``, is longer than ``MAX_LINES`` lines.
- Inside the appliance: the error hierarchy imports nothing, the store only it, and the proxy's
  surfaces never touch tokens (the driver's and the call service's business).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Each top-level package and the packages it may import (the layers, top to bottom:
#: appliance > tui > trainer > store > contracts; the harness adapters stand on contracts only).
ALLOWED: dict[str, frozenset[str]] = {
    "appliance": frozenset({"tui", "trainer", "store", "harness_adapters", "contracts"}),
    "tui": frozenset({"trainer", "store", "contracts"}),
    "trainer": frozenset({"store", "contracts"}),
    "store": frozenset({"contracts"}),
    "harness_adapters": frozenset({"contracts"}),
    "contracts": frozenset(),
}
PACKAGES = tuple(ALLOWED)
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (examples and data files included)."""
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(module: str, name: str | None) -> str:
    """The module an import names: ``from a.b import c`` is ``a.b.c`` when that is a module."""
    if name is not None and f"{module}.{name}" in _modules():
        return f"{module}.{name}"
    return module


@cache
def _imports(name: str) -> frozenset[str]:
    """Every project module the module ``name`` imports (at any depth, type-checking blocks too)."""
    path = _modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(_resolve(base, alias.name) for alias in node.names)
    return frozenset(m for m in found if m.split(".")[0] in ALLOWED and m != name)


def _package_arrows() -> Iterator[tuple[str, str, str]]:
    for name in _modules():
        for imported in _imports(name):
            source, target = name.split(".")[0], imported.split(".")[0]
            if source != target:
                yield source, target, f"{name} -> {imported}"


def test_every_top_level_package_is_placed() -> None:
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "scripts", "docs"}
    assert on_disk == set(ALLOWED), "place a new package in ALLOWED (and docs/ARCHITECTURE.md)"


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(PACKAGES, 2)), ids="-".join)
def test_each_pair_of_packages_has_one_direction_at_most(a: str, b: str) -> None:
    assert not (b in ALLOWED[a] and a in ALLOWED[b]), f"{a} and {b} may not import each other"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    against = sorted(
        arrow
        for source, target, arrow in _package_arrows()
        if source == package and target not in ALLOWED[package]
    )
    assert against == [], f"{package} may import only {sorted(ALLOWED[package])}: {against}"


def _circles() -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in _modules():
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(_imports(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(_imports(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_no_module_imports_itself_around_a_circle() -> None:
    assert _circles() == []


def test_the_circle_finder_finds_a_circle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: two modules importing each other are found."""
    real = _imports.__wrapped__

    def with_circle(name: str) -> frozenset[str]:
        extra = {"store.events": {"store.codec"}, "store.codec": {"store.events"}}.get(name, set())
        return real(name) | extra

    monkeypatch.setattr(f"{__name__}._imports", with_circle)
    assert any({"store.codec", "store.events"} <= set(circle) for circle in _circles())


@pytest.mark.parametrize("name", sorted(_modules()), ids=str)
def test_a_module_is_a_file_a_reader_can_hold(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{_modules()[name].relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_a_script_is_a_file_a_reader_can_hold(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def test_the_errors_import_nothing_of_the_project() -> None:
    assert _imports("contracts.errors") == frozenset()


SURFACES = ("openai_chat", "openai_completions", "openai_responses", "responses_output", "anthropic_messages")


@pytest.mark.parametrize("surface", SURFACES)
def test_surfaces_never_touch_tokens(surface: str) -> None:
    touching = {
        name
        for name in _imports(f"appliance.proxy.{surface}")
        if name.startswith(("appliance.chat.tokenizer", "appliance.chat.render", "appliance.proxy.calls"))
        or (name.startswith("appliance.engines.") and name != "appliance.engines.base")
    }
    assert touching == set(), f"{surface} imports {sorted(touching)}"
