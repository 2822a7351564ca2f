"""A CPU smoke run of scripts/bench_sandbox.py: both ways of running a rollout, side by side,
and a verifier's fresh checkout, each with its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness_adapters.sandbox import bwrap_problem

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
def test_bench_sandbox_measures_both_and_the_checkout() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_sandbox.py"),
            "--runs",
            "4",
            "--files",
            "30",
            "--checkouts",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    figures = json.loads(done.stdout)
    start_stop, checkout = figures["start_stop"], figures["fresh_checkout"]
    assert start_stop["runs"] == 4
    for kind in ("none", "bwrap"):
        assert 0 < start_stop[kind]["median_ms"] <= start_stop[kind]["p90_ms"]
    assert start_stop["added_ms"] == pytest.approx(
        start_stop["bwrap"]["median_ms"] - start_stop["none"]["median_ms"]
    )
    assert checkout["files"] == 30 and checkout["median_ms"] > 0 and checkout["copy_median_ms"] > 0
