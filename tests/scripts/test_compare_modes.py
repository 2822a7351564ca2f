"""A CPU smoke run of scripts/compare_modes.py with the tiny model: two steps of sync and of
async (eta 1), once each, the cost model fitted from their events, each run predicted by the
simulator, the JSON written; then ``--refit`` reads the same runs back and predicts the same.
The real figures come from longer runs in the background (docs/scheduler.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "compare_modes", raising=False)


def test_compare_modes_measures_fits_and_predicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import compare_modes

    argv = ["--steps", "2", "--repeats", "1", "--runs", "sync", "async-1"]
    argv += ["--no-warm-up-run", "--out", str(tmp_path)]
    assert compare_modes.main(argv) == 0
    result = json.loads((tmp_path / "compare_modes.json").read_text())
    assert [row["run"] for row in result["runs"]] == ["sync", "async-1"]
    for row in result["runs"]:
        assert row["steps"] == 1  # two steps, the first a warm-up
        assert row["measured"]["seconds_per_step"] > 0 and row["predicted"]["seconds_per_step"] > 0
        assert row["measured"]["train"] > 0
    assert [ratio["run"] for ratio in result["ratios"]] == ["async-1"]
    cost = result["cost"]
    assert cost["peak_tokens_per_s"] > 0
    # Two steps are two points: the line through them may meet 0 seconds at some tokens above 0
    # (then the fit keeps the intercept at 0, ``fit_train``), but a step costs time either way.
    assert cost["train_step_s"] >= 0 and cost["train_s_per_token"] >= 0
    assert cost["train_step_s"] + cost["train_s_per_token"] > 0
    printed = capsys.readouterr().out
    assert "fitted cost model:" in printed and "sync/async-1: measured" in printed

    assert compare_modes.main([*argv, "--refit"]) == 0
    refit = json.loads((tmp_path / "compare_modes.json").read_text())
    assert refit["runs"] == result["runs"] and refit["cost"] == result["cost"]
    with pytest.raises(SystemExit):
        compare_modes.main(argv)  # the runs are there: not made again
