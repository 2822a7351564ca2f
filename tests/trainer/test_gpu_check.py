"""scripts/gpu_check.py and gpu_check.sh, run on CPU with the tiny model: the same code path the
GPU check times (engine sleep/wake, verl FSDP step, offload/onload, bucketed and full weight
pushes, a LoRA trainer, trainer ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--require-verl"]


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
    # Buckets of 0.1 MiB: the tiny model's ~0.4 MB of fp32 weights take several.
    timings = run([*CHECK, "--bucket-mb", "0.1"])
    assert timings["verl_ran"] is True
    assert timings["failed_parts"] == []
    for switch in (
        "engine_sleep",
        "trainer_init",
        "train_step_1",
        "trainer_offload",
        "trainer_state_dict",
        "engine_wake_weights",
        "bucketed_push_s",
        "weight_push",
        "engine_wake_kv_cache",
        "trainer_onload",
        "train_step_2",
        "lora_step_s",
        "lora_push_s",
    ):
        assert isinstance(timings[switch], float), switch
    metrics = timings["train_step_1_metrics"]
    assert isinstance(metrics, dict)
    # The engine's own samples, scored by the trainer: on-policy to float precision.
    assert abs(metrics["is_weight_mean"] - 1.0) < 1e-4
    assert metrics["updated"] == 1.0
    # fp32 on CPU by default: no bf16 step to report.
    assert timings["param_dtype"] == "fp32"
    assert timings["bf16_step_s"] is None
    buckets, changed = timings["buckets"], timings["push_changed"]
    assert isinstance(buckets, int) and buckets > 1
    assert isinstance(changed, int) and changed > 0  # the check compares weights the push changed
    assert timings["push_exact"] is True
    assert timings["lora_push_exact"] is True
    assert timings["memory_after_offload"] is None  # measured on CUDA only
    # No --ranks: the ranks part is skipped, its keys null.
    assert timings["ranks"] == 0
    assert timings["ranked_step_s"] is None and timings["ranked_push_s"] is None


def test_gpu_check_runs_two_trainer_ranks_in_bf16_on_cpu() -> None:
    timings = run([*CHECK, "--ranks", "2", "--param-dtype", "bf16", "--bucket-mb", "0.1"])
    assert timings["failed_parts"] == []
    assert timings["param_dtype"] == "bf16"
    assert isinstance(timings["bf16_step_s"], float)
    assert timings["bf16_step_s"] == timings["train_step_2"]
    for key in ("ranked_step_s", "ranked_push_s", "lora_step_s", "lora_push_s", "bucketed_push_s"):
        assert isinstance(timings[key], float), key
    assert timings["ranked_push_exact"] is True
    assert timings["push_exact"] is True and timings["lora_push_exact"] is True


def test_gpu_check_sh_runs_the_engine_part_without_verl() -> None:
    timings = run(
        [
            "bash",
            "scripts/gpu_check.sh",
            "--",
            "--device",
            "cpu",
            "--tiny",
            "--skip-verl",
            "--bucket-mb",
            "0.1",
        ],
        PYTHON=sys.executable,
    )
    assert timings["verl_ran"] is False
    assert timings["failed_parts"] == []
    assert isinstance(timings["weight_push"], float)
    # The stand-in weights go through the bucketed push too.
    assert isinstance(timings["bucketed_push_s"], float)
    assert timings["push_exact"] is True
    assert timings["param_dtype"] is None and timings["lora_step_s"] is None
