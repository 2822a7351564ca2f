"""scripts/gpu_check.py and gpu_check.sh, run on CPU with the tiny model: the same code path the
GPU check times (engine sleep/wake, verl FSDP step, offload/onload, weight push)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(command: list[str], **env: str) -> dict[str, object]:
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return summary


def test_gpu_check_runs_on_cpu_with_the_tiny_model() -> None:
    timings = run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--require-verl"])
    assert timings["verl_ran"] is True
    for switch in (
        "engine_sleep",
        "trainer_init",
        "train_step_1",
        "trainer_offload",
        "trainer_state_dict",
        "engine_wake_weights",
        "weight_push",
        "engine_wake_kv_cache",
        "trainer_onload",
        "train_step_2",
    ):
        assert isinstance(timings[switch], float), switch
    metrics = timings["train_step_1_metrics"]
    assert isinstance(metrics, dict)
    # The engine's own samples, scored by the trainer: on-policy to float precision.
    assert abs(metrics["is_weight_mean"] - 1.0) < 1e-4
    assert metrics["updated"] == 1.0


def test_gpu_check_sh_runs_the_engine_part_without_verl() -> None:
    timings = run(
        ["bash", "scripts/gpu_check.sh", "--", "--device", "cpu", "--tiny", "--skip-verl"],
        PYTHON=sys.executable,
    )
    assert timings["verl_ran"] is False
    assert isinstance(timings["weight_push"], float)
