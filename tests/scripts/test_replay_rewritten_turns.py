"""scripts/replay_rewritten_turns.py: the recorded harness requests give the figures in
docs/benchmarks.md (assistant turns not spliced exactly, before and after matching them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "replay_rewritten_turns", raising=False)


@pytest.mark.parametrize(
    ("fixture", "before", "after", "samples"),
    [("smolagents_code_agent", 3, 0, 2), ("pydantic_ai_length_cut", 1, 0, 2), ("aider_few_shot", 6, 6, 1)],
)
async def test_replayed_harness_turns(
    tiny_model_dir: Path, tmp_path: Path, fixture: str, before: int, after: int, samples: int
) -> None:
    import replay_rewritten_turns as replay

    recorded = json.loads((replay.FIXTURES / f"{fixture}.json").read_text())
    calls = await replay.replay(recorded, tiny_model_dir, tmp_path / "run")
    assert replay.counts(calls) == (before, after, samples)
