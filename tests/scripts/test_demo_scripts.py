"""CPU smoke runs of the learning scripts (learn_demo, normalization_study, async_vs_sync) with
the tiny model, and the seed-spread arithmetic they share.

One or two training steps each, a handful of held-out tasks: the whole path (task split on
disk, appliance in process, agents through the proxy, held-out scoring on ``/v1`` or by the
appliance's validation rounds, JSON and PNG out). The real figures come from running the
scripts on smollm2-135m (docs/results.md).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    for name in ("learn_demo", "seed_spread"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def small_run(model: Path, out: Path) -> list[str]:
    return [
        "--model", str(model), "--out", str(out), "--steps", "1", "--group-size", "2",
        "--batch-groups", "1", "--held-out", "4", "--threads", "1",
    ]  # fmt: skip


def study(name: str, model: Path, out: Path, *more: str) -> dict[str, Any]:
    """Run the study script ``name`` (module ``main``) on one seed in this process; its JSON."""
    module = importlib.import_module(name)
    argv = [*small_run(model, out), "--seeds", "0", "--eval-every", "1", "--no-subprocess", *more]
    assert module.main(argv) == 0
    result: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return result


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
    result = study("normalization_study", tiny_model_dir, tmp_path / "out", "--modes", "rollout,sample")
    rollout, sample = result["runs"]["rollout"]["0"], result["runs"]["sample"]["0"]
    # Same weights, same task stream, same per-rollout sampling seeds: the first step sees the
    # same episodes in both runs, so only the normalization can make the runs differ.
    assert rollout["baseline"] == {**sample["baseline"], "seconds": rollout["baseline"]["seconds"]}
    first_r, first_s = rollout["rows"][0], sample["rows"][0]
    assert first_r["train_reward"] == first_s["train_reward"]
    assert first_r["calls_per_rollout"] == first_s["calls_per_rollout"]
    assert first_r["entropy"] == pytest.approx(first_s["entropy"], abs=1e-5)
    # The default agent makes 1 to 4 fresh-prompt calls, each a sample of its own.
    assert 1.0 <= first_r["calls_per_rollout"] <= 4.0
    assert first_r["samples_per_rollout"] == first_r["calls_per_rollout"]
    assert result["per_step"]["rollout"]["heldout"]["1"]["n"] == 1
    assert result["summary"]["sample"]["entropy_first"]["mean"] == pytest.approx(first_s["entropy"])
    printed = capsys.readouterr().out
    assert "| rollout |" in printed and "| sample |" in printed
    assert (tmp_path / "out" / "normalization_study.png").is_file()
    assert "| step |" in (tmp_path / "out" / "normalization_study.md").read_text()


def test_async_vs_sync_scores_each_policy_by_validation_rounds(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = study("async_vs_sync", tiny_model_dir, tmp_path / "out", "--steps", "2")
    sync, run_async = result["runs"]["sync"]["0"], result["runs"]["async"]["0"]
    for run in (sync, run_async):
        assert [p["step"] for p in run["points"]] == [0, 1, 2]
        assert [p["rollouts"] for p in run["points"]] == [0, 2, 4]  # the same samples per step
        assert all(p["heldout"]["tasks"] == 4 for p in run["points"])
        assert all(1.0 <= p["heldout"]["calls"] <= 2.0 for p in run["points"])
        assert [row["step"] for row in run["rows"]] == [1, 2]
        minutes = [p["minutes"] for p in run["points"]]
        assert minutes == sorted(minutes) and minutes[0] == 0.0
    # Sync trains on-policy; async admits the second batch beside the first (eta 1), so its
    # second step trains rollouts one version old.
    assert [m["staleness_mean"] for m in sync["metrics"]] == [0.0, 0.0]
    assert run_async["metrics"][1]["staleness_mean"] > 0.0
    assert result["summary"]["sync"]["reached"].endswith("/1")
    assert (tmp_path / "out" / "async_vs_sync.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| async |" in (tmp_path / "out" / "async_vs_sync.md").read_text()


def test_async_vs_sync_reads_finished_runs_back(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = study("async_vs_sync", tiny_model_dir, tmp_path / "first", "--modes", "sync")
    # A run of another length is not finished for this study: it runs again; one of the same
    # length is read back from its event log, the same as the study first read it.
    again = study(
        "async_vs_sync", tiny_model_dir, tmp_path / "again", "--modes", "sync",
        "--runs-from", str(tmp_path / "first"),
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert f"read back from {tmp_path / 'first'}" in printed
    assert not (tmp_path / "again" / "sync-seed0").exists()
    ran, read = first["runs"]["sync"]["0"], again["runs"]["sync"]["0"]
    assert read["points"] == ran["points"] and read["rows"] == ran["rows"]
    assert read["reason"].startswith("reached step 1 (read back")
    longer = study(
        "async_vs_sync", tiny_model_dir, tmp_path / "longer", "--modes", "sync", "--steps", "2",
        "--runs-from", str(tmp_path / "first"),
    )  # fmt: skip
    assert (tmp_path / "longer" / "sync-seed0").is_dir()
    assert [p["step"] for p in longer["runs"]["sync"]["0"]["points"]] == [0, 1, 2]


def test_spread_over_seeds_is_mean_sample_std_and_range() -> None:
    from seed_spread import by_step, spread

    s = spread([0.25, 0.5, float("nan"), 0.75])
    assert (s.mean, s.low, s.high, s.n) == (0.5, 0.25, 0.75, 3)
    assert s.std == pytest.approx(0.25)  # sample std (n - 1)
    assert spread([0.4]).std == 0.0 and spread([]).n == 0
    # Only the steps every seed measured.
    assert list(by_step([{0: 0.1, 2: 0.3}, {0: 0.2, 1: 0.5, 2: 0.1}])) == [0, 2]
