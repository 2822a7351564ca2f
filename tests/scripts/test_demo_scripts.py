"""CPU smoke runs of scripts/learn_demo.py and scripts/normalization_study.py with the tiny model.

One training step each, a handful of held-out tasks: the whole path (task split on disk,
appliance in process, agents through the proxy, held-out scoring on ``/v1``, JSON and PNG out).
The real figures come from running the scripts on smollm2-135m (docs/results.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "learn_demo", raising=False)


def small_run(model: Path, out: Path) -> list[str]:
    return [
        "--model", str(model), "--out", str(out), "--steps", "1", "--group-size", "2",
        "--batch-groups", "1", "--held-out", "4", "--threads", "1",
    ]  # fmt: skip


def test_learn_demo_trains_and_scores_held_out_tasks(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import learn_demo

    assert learn_demo.main(small_run(tiny_model_dir, tmp_path / "out")) == 0
    result = json.loads((tmp_path / "out" / "learn_demo.json").read_text())
    assert result["baseline"]["tasks"] == 4 and result["final"]["tasks"] == 4
    assert [row["step"] for row in result["rows"]] == [1]
    assert result["rows"][0]["heldout"] is not None  # the last step is always scored
    assert 1.0 <= result["rows"][0]["calls_per_rollout"] <= 2.0
    assert (tmp_path / "out" / "learn_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "step   1" in printed and "summary: held-out reward" in printed
    with pytest.raises(SystemExit, match="not empty"):
        learn_demo.main(small_run(tiny_model_dir, tmp_path / "out"))


def test_normalization_study_compares_modes_on_the_same_seeds(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import normalization_study

    argv = [*small_run(tiny_model_dir, tmp_path / "out"), "--modes", "rollout,sample", "--no-subprocess"]
    assert normalization_study.main(argv) == 0
    result = json.loads((tmp_path / "out" / "normalization_study.json").read_text())
    rollout, sample = result["rollout"], result["sample"]
    # Same weights, same task stream, same per-rollout sampling seeds: the first step sees the
    # same episodes in both runs, so only the normalization can make the runs differ.
    assert rollout["baseline"] == {**sample["baseline"], "seconds": rollout["baseline"]["seconds"]}
    first_r, first_s = rollout["rows"][0], sample["rows"][0]
    assert first_r["train_reward"] == first_s["train_reward"]
    assert first_r["calls_per_rollout"] == first_s["calls_per_rollout"]
    assert first_r["entropy"] == pytest.approx(first_s["entropy"], abs=1e-5)
    printed = capsys.readouterr().out
    assert "| rollout |" in printed and "| sample |" in printed
    assert (tmp_path / "out" / "normalization_study.png").is_file()
