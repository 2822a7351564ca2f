"""The import layering: the error hierarchy at the bottom, the event store just above it.

``appliance.errors`` imports nothing from the project, so every package (the store, the trainer,
the harness adapters, the dashboard) can raise its errors without importing the appliance;
the store imports nothing of the appliance but those errors; the proxy's surfaces never import
the engines or the tokenizer (tokens are the driver's and the call service's business).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("appliance", "harness_adapters", "store", "trainer", "tui")


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` imports (at any depth, type-checking blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in PROJECT}


def test_the_errors_import_nothing_of_the_project() -> None:
    assert _imports(ROOT / "appliance" / "errors.py") == set()


@pytest.mark.parametrize("path", sorted((ROOT / "store").rglob("*.py")), ids=lambda p: p.name)
def test_the_store_imports_only_itself_and_the_errors(path: Path) -> None:
    outside = {name for name in _imports(path) if not name.startswith("store")}
    assert outside <= {"appliance.errors"}, f"{path.name} imports {sorted(outside)}"


SURFACES = ("openai_chat", "openai_completions", "openai_responses", "anthropic_messages")


@pytest.mark.parametrize("surface", SURFACES)
def test_surfaces_never_touch_tokens(surface: str) -> None:
    imported = _imports(ROOT / "appliance" / "proxy" / f"{surface}.py")
    touching = {
        name
        for name in imported
        if name.startswith(("appliance.chat.tokenizer", "appliance.chat.render", "appliance.proxy.calls"))
        or (name.startswith("appliance.engines.") and name != "appliance.engines.base")
    }
    assert touching == set(), f"{surface} imports {sorted(touching)}"
