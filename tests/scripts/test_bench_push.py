"""CPU smoke runs of scripts/bench_push.py with the tiny model: both push paths into a real
``TorchEngine``, small buckets (so a push is several buckets), one measured push each.

The default suite runs the in-process torch trainer only; the ranked trainers (worker processes
on gloo) and the 1-rank vs 2-rank step take half a minute and run under ``-m slow``. The real
figures come from running the script on smollm2-135m (docs/benchmarks.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "bench_push", raising=False)


def small_run(model: Path, data_dir: Path) -> list[str]:
    return ["--model", str(model), "--data-dir", str(data_dir), "--bucket-mb", "0.25", "--repeats", "1"]


def test_bench_push_compares_both_paths_with_the_torch_trainer(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_push

    assert bench_push.main([*small_run(tiny_model_dir, tmp_path), "--ranks", "", "--skip-step"]) == 0
    printed = capsys.readouterr().out
    old = next(line for line in printed.splitlines() if line.startswith("| torch | old |"))
    new = next(line for line in printed.splitlines() if line.startswith("| torch | new |"))
    assert old.split("|")[6].strip() == "-"  # no buckets on the old path
    assert int(new.split("|")[6]) >= 3  # ~1 MiB of weights in 0.25 MiB buckets
    assert "x**" in new  # the new / old ratio
    assert "torch: new push" in printed and "peak extra RSS" in printed
    assert "rank 0" not in printed.split("targets")[1]


@pytest.mark.slow
def test_bench_push_with_ranked_trainers_and_the_step(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_push

    argv = [*small_run(tiny_model_dir, tmp_path), "--no-torch", "--ranks", "1,2", "--step-repeats", "1"]
    assert bench_push.main(argv) == 0
    printed = capsys.readouterr().out
    for ranks in (1, 2):
        assert f"| verl x{ranks} | old |" in printed and f"| verl x{ranks} | new |" in printed
        assert f"verl x{ranks}: rank 0 peak extra RSS" in printed
    assert "2 ranks / 1 rank per sample:" in printed


def test_bench_push_compares_lora_adapters_with_merged_weights(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_push

    argv = [
        *small_run(tiny_model_dir, tmp_path),
        "--ranks",
        "",
        "--skip-step",
        "--no-torch",
        "--lora-rank",
        "4",
    ]
    assert bench_push.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| verl x1 LoRA r4 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["old", "new"]
    line = next(line for line in printed.splitlines() if "MiB of adapters against" in line)
    ratio = float(line.split("(")[1].split("x)")[0])
    # The tiny model's 14 adapted layers at rank 4 are a few percent of its weights.
    assert 0 < ratio < 0.2
