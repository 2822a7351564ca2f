"""scripts/bench_proxy.py's rounds: the targets take turns, and a row is the rounds' medians,
with each round's ratios beside it (the figures themselves come from running the script)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "bench_proxy", raising=False)
    import bench_proxy

    return bench_proxy


def run(rate: float, cpu_us: float, latencies_ms: list[float], **failures: int) -> dict[str, Any]:
    return {
        "rate": rate,
        "served": len(latencies_ms),
        "latencies": [x / 1e3 for x in latencies_ms],
        "ttfts": [],
        "failures": dict(failures),
        "cpu_per_call": cpu_us / 1e6,
        "loop_cpu_per_call": cpu_us / 2e6,
    }


def test_rounds_merge_into_medians_with_every_latency(bench: ModuleType) -> None:
    rounds = [run(100, 300, [1, 2], Timeout=1), run(400, 900, [3]), run(200, 500, [4, 5], Timeout=2)]
    merged = bench.merged(rounds)
    assert merged["rate"] == 200 and merged["served"] == 5
    assert merged["cpu_per_call"] == pytest.approx(500e-6)
    assert merged["loop_cpu_per_call"] == pytest.approx(250e-6)
    assert merged["latencies"] == pytest.approx([0.001, 0.002, 0.003, 0.004, 0.005])
    assert merged["failures"] == {"Timeout": 3}
    assert bench.merged(rounds[:1]) is rounds[0]


def test_each_round_is_compared_with_the_others_of_its_round(bench: ModuleType) -> None:
    # The machine slowed down in round 2: every target did, and the round's ratios hold.
    measured = {
        "direct": [run(1000, 50, [1.0]), run(500, 100, [2.0])],
        "appliance": [run(400, 300, [2.0]), run(200, 600, [4.0])],
        "agl": [run(40, 3000, [10.0]), run(25, 6000, [20.0])],
    }
    line = bench.per_round(measured)
    assert "ours/dir 0.40 0.40 (median 0.40)" in line
    assert "ours/agl 10.00 8.00 (median 9.00)" in line
    assert "+p50 ours 1.00 2.00 ms (median 1.50)" in line
