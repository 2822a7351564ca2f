"""Launch the aider CLI on a coding task: the repository's source files, and the model's metadata.

``python -m harness_adapters.examples.agents.aider_agent aider --model openai/M --message ...``
runs ``aider --model openai/M --message ... fizzbuzz.py`` in a rollout of a ``python_bugs``
task. Two things a command template cannot do:

* aider edits only the files it is given, and a template cannot glob: the working directory's
  Python files that are not tests (``test_*.py``, ``*_test.py``, ``conftest.py``) are appended;
* aider looks up an unknown model's context window in litellm's price list, which it downloads
  from GitHub when its cache (in ``$HOME``, fresh in every rollout) is empty: the served model's
  entry is written to ``$HOME/.aider.model.metadata.json`` (aider reads it from the home
  directory), with ``$MODEL_CONTEXT_TOKENS`` (default 8192) as its context, so aider stays
  offline and knows the context.

The command then replaces this process (``exec``), so its exit code and signals are aider's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

METADATA_FILE = ".aider.model.metadata.json"


def source_files(root: Path) -> list[str]:
    """The Python files under ``root`` that are not tests, relative to it, sorted."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        name = path.name
        if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py":
            continue
        if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            continue
        found.append(str(relative))
    return found


def model_metadata(model: str, context_tokens: int) -> dict[str, dict[str, object]]:
    """litellm's entry for ``model`` (``provider/name``): its context, and no cost."""
    provider = model.split("/", 1)[0] if "/" in model else "openai"
    return {
        model: {
            "max_input_tokens": context_tokens,
            "max_output_tokens": context_tokens,
            "max_tokens": context_tokens,
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "litellm_provider": provider,
            "mode": "chat",
        }
    }


def option(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--name value`` or ``--name=value``), or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m harness_adapters.examples.agents.aider_agent aider [ARGS...]")
    model = option(argv, "--model")
    if model is not None:
        context = int(os.environ.get("MODEL_CONTEXT_TOKENS", "8192"))
        (Path.home() / METADATA_FILE).write_text(json.dumps(model_metadata(model, context), indent=2))
    argv += source_files(Path.cwd())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
