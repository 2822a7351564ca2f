"""CPU smoke runs of scripts/bench_tokenize.py with the tiny model: both encoders on every size,
the same ids from both, and a stop where they differ."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "bench_tokenize", raising=False)


def test_bench_tokenize_prints_both_encoders_per_size(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_tokenize

    argv = ["--model", str(tiny_model_dir), "--data-dir", str(tmp_path), "--words", "1,40", "--texts", "6"]
    assert bench_tokenize.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "us |" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "40"]
    for row in rows:
        library, pieces, ratio = (cell.strip() for cell in row.split("|")[2:5])
        assert float(library.removesuffix(" us")) > 0 and float(pieces.removesuffix(" us")) > 0
        assert ratio.endswith("x") and float(ratio[:-1]) > 0


def test_bench_tokenize_stops_where_the_encoders_disagree() -> None:
    import bench_tokenize

    batch = bench_tokenize.texts(5, 2, random.Random(0), ["a", "b"])
    encoders = {"library": lambda text: [1, 2, 3], "pieces": lambda text: [1, 2]}
    with pytest.raises(RuntimeError, match="disagree"):
        bench_tokenize.measure(encoders, batch, cold=False)
