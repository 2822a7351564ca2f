"""``lightning-appliance doctor``: the checks over made-up facts (one table), the probe of vLLM's
interpreter against fake interpreters, and the real command on this machine."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance.config import load_config
from appliance.operations import doctor, doctor_facts
from appliance.operations.doctor import Check
from appliance.operations.doctor_facts import Facts, VllmFacts
from appliance.placement.machine import GpuInfo
from tests.appliance.appliance_process import ROOT, cli

GIB = 1 << 30
MIB = 1 << 20

#: A healthy CPU machine: every check passes.
CPU_BOX = Facts(
    python_version="3.11.7",
    python_executable=".venv/bin/python",
    cpu_count=2,
    torch_version="2.13.0+cpu",
    torch_build="cpu",
    torch_stamp="cpu",
    ram_total_bytes=24 * GIB,
    ram_available_bytes=20 * GIB,
    shm_total_bytes=12 * GIB,
    shm_free_bytes=12 * GIB,
    disk_free_bytes=50 * GIB,
    disk_total_bytes=250 * GIB,
    verl_version="0.9.1",
    vllm=VllmFacts(
        python=".venv-vllm/bin/python",
        exists=True,
        stamps=(".vllm-cpu",),
        probed=True,
        version="0.32.0",
        torch_version="2.13.0+cpu",
        torch_build="cpu",
    ),
)
H200 = GpuInfo(index=0, name="NVIDIA H200", free_bytes=139 * GIB, total_bytes=140 * GIB)
#: A healthy GPU machine (two GPUs, CUDA builds everywhere, the torch vLLM 0.33.0 pins in both).
GPU_BOX = dataclasses.replace(
    CPU_BOX,
    torch_version="2.14.0",
    torch_build="cuda",
    torch_cuda="13.0",
    torch_nccl="2.30.7",
    torch_stamp="cuda",
    cuda_available=True,
    nvidia_smi=True,
    driver_version="580.65.06",
    gpus=(H200, dataclasses.replace(H200, index=1)),
    device="cuda",
    vllm=dataclasses.replace(
        CPU_BOX.vllm,
        stamps=(".vllm-gpu",),
        version="0.33.0",
        torch_version="2.14.0",
        torch_build="cuda",
        torch_cuda="13.0",
        torch_nccl="2.30.7",
    ),
)


def with_vllm(base: Facts, **changes: Any) -> Facts:
    return dataclasses.replace(base, vllm=dataclasses.replace(base.vllm, **changes))


def only(facts: Facts, name: str) -> Check:
    (check,) = [c for c in doctor.run_checks(facts) if c.name == name]
    return check


@pytest.mark.parametrize("box", [CPU_BOX, GPU_BOX], ids=["cpu", "gpu"])
def test_a_healthy_machine_passes_every_check(box: Facts) -> None:
    checks = doctor.run_checks(box)
    assert [c.name for c in checks] == [
        "python", "torch", "gpu", "device", "verl", "vllm", "venvs", "ram", "cpu", "shm", "disk", "data",
        "sandbox",
    ]  # fmt: skip
    assert [c for c in checks if c.status != "ok"] == []
    assert all(c.fix is None for c in checks)
    assert doctor.report(box, checks)["ok"] is True


# (case, facts, check, status, words its line must hold: the problem and its fix)
CASES: list[tuple[str, Facts, str, str, tuple[str, ...]]] = [
    (
        "docker's 64 MiB /dev/shm",
        dataclasses.replace(CPU_BOX, shm_total_bytes=64 * MIB, shm_free_bytes=64 * MIB),
        "shm",
        "warn",
        ("/dev/shm is 64 MiB", "push_bucket_mb = 256", "--shm-size=16g", "push_bucket_mb <= 32"),
    ),
    (
        "a full /dev/shm: no bucket size fits",
        dataclasses.replace(CPU_BOX, shm_total_bytes=64 * MIB, shm_free_bytes=MIB),
        "shm",
        "warn",
        ("--shm-size=16g",),
    ),
    (
        "buckets fit, but NCCL between GPUs wants more",
        dataclasses.replace(GPU_BOX, shm_total_bytes=512 * MIB, shm_free_bytes=512 * MIB, push_bucket_mb=64),
        "shm",
        "warn",
        ("NCCL", "--shm-size=16g"),
    ),
    (
        "no /dev/shm",
        dataclasses.replace(CPU_BOX, shm_total_bytes=None, shm_free_bytes=None),
        "shm",
        "warn",
        ("tmpfs",),
    ),
    (
        "GPUs but a CPU build of torch",
        dataclasses.replace(
            GPU_BOX, torch_version="2.13.0+cpu", torch_build="cpu", torch_cuda=None, cuda_available=False
        ),
        "gpu",
        "fail",
        ("2 GPUs visible but torch is a CPU build", "rm -rf .venv && make bootstrap"),
    ),
    (
        "CUDA torch that sees no GPU (an old driver)",
        dataclasses.replace(GPU_BOX, cuda_available=False, driver_version="535.104"),
        "gpu",
        "fail",
        ("driver 535.104", "torch (CUDA 13.0) sees none", "driver >= 580"),
    ),
    (
        "vLLM cannot take its share of a busy GPU",
        dataclasses.replace(
            GPU_BOX,
            engine="vllm",
            gpus=(dataclasses.replace(H200, free_bytes=70 * GIB), dataclasses.replace(H200, index=1)),
        ),
        "gpu",
        "warn",
        ("GPU 0 has less free", "gpu_memory_utilization <= 0.50"),
    ),
    (
        "device cuda without a GPU",
        dataclasses.replace(CPU_BOX, device="cuda"),
        "device",
        "fail",
        ("device = cuda", 'device = "auto"'),
    ),
    (
        "torch missing",
        dataclasses.replace(
            CPU_BOX, torch_version=None, torch_build=None, torch_error="ModuleNotFoundError: torch"
        ),
        "torch",
        "fail",
        ("does not import", "make bootstrap"),
    ),
    (
        "torch swapped after bootstrap",
        dataclasses.replace(CPU_BOX, torch_stamp="cuda"),
        "torch",
        "warn",
        ("installed the cuda build", "rm -rf .venv && make bootstrap"),
    ),
    (
        "verl missing, torch trainer",
        dataclasses.replace(CPU_BOX, verl_version=None, verl_error="ModuleNotFoundError: ray"),
        "verl",
        "warn",
        ("only --trainer verl needs it", "make bootstrap"),
    ),
    (
        "verl missing, verl trainer",
        dataclasses.replace(
            CPU_BOX, trainer="verl", verl_version=None, verl_error="ModuleNotFoundError: ray"
        ),
        "verl",
        "fail",
        ("ModuleNotFoundError: ray", "make bootstrap"),
    ),
    (
        "no vLLM venv, torch engine: only a warning",
        with_vllm(
            CPU_BOX, exists=False, stamps=(), probed=False, version=None, torch_version=None, torch_build=None
        ),
        "vllm",
        "warn",
        ("no vLLM venv at .venv-vllm/bin/python", "only --engine vllm", "make vllm", "make vllm-cpu"),
    ),
    (
        "no vLLM venv, vLLM engine: a failure",
        dataclasses.replace(
            with_vllm(CPU_BOX, exists=False, stamps=(), probed=False, version=None, torch_build=None),
            engine="vllm",
        ),
        "vllm",
        "fail",
        ("no vLLM venv", "make vllm"),
    ),
    (
        "vLLM engine attached to a server: no venv needed",
        dataclasses.replace(
            with_vllm(CPU_BOX, exists=False), engine="vllm", vllm_url="http://127.0.0.1:8000"
        ),
        "vllm",
        "ok",
        ("http://127.0.0.1:8000",),
    ),
    (
        "a vLLM venv that does not import",
        with_vllm(CPU_BOX, version=None, error="ImportError: libcudart.so.13"),
        "vllm",
        "warn",
        ("libcudart.so.13", "make clean-vllm && make vllm"),
    ),
    (
        "the CPU build of vLLM on a GPU box",
        dataclasses.replace(GPU_BOX, vllm=CPU_BOX.vllm),
        "vllm",
        "warn",
        ("vLLM 0.32.0", "CPU build on a machine with 2 GPUs", "make vllm"),
    ),
    (
        "the CUDA build of vLLM on a CPU box, engine vllm",
        dataclasses.replace(CPU_BOX, engine="vllm", vllm=GPU_BOX.vllm),
        "vllm",
        "fail",
        ("CUDA build on a machine without a GPU", "make vllm"),
    ),
    (
        "the CPU build by its stamp, not probed, on a GPU box",
        dataclasses.replace(
            GPU_BOX,
            vllm=VllmFacts(python="v/bin/python", exists=True, stamps=(".vllm-cpu",), torch_build="cpu"),
        ),
        "vllm",
        "warn",
        ("not probed", "make vllm"),
    ),
    (
        "a vLLM venv not built by make",
        with_vllm(CPU_BOX, stamps=()),
        "vllm",
        "warn",
        ("not built by make",),
    ),
    (
        "the trainer's torch 2.13.0 (NCCL 2.29.7) beside vLLM 0.33.0's 2.14.0 (NCCL 2.30.7)",
        dataclasses.replace(GPU_BOX, torch_version="2.13.0", torch_nccl="2.29.7"),
        "venvs",
        "fail",
        ("torch 2.13.0 at .venv/bin/python", "2.14.0 at .venv-vllm/bin/python", "NCCL refuses", "make vllm"),
    ),
    (
        "different torch releases fail whatever the engine (here torch, on CPU)",
        with_vllm(CPU_BOX, torch_version="2.12.0+cpu"),
        "venvs",
        "fail",
        ("torch 2.13.0+cpu", "2.12.0+cpu", "rm -rf .venv && make bootstrap", "make clean-vllm && make vllm"),
    ),
    (
        "one torch release from two indexes: different NCCL",
        dataclasses.replace(GPU_BOX, torch_version="2.14.0+cu128", torch_cuda="12.8", torch_nccl="2.28.3"),
        "venvs",
        "fail",
        ("NCCL 2.28.3", "2.30.7", "NCCL refuses", "TORCH_PIP_ARGS"),
    ),
    (
        "CPU builds: one release, labels apart",
        with_vllm(CPU_BOX, torch_version="2.13.0"),
        "venvs",
        "ok",
        ("torch 2.13.0 in both venvs",),
    ),
    (
        "no vLLM venv: nothing to compare",
        with_vllm(CPU_BOX, exists=False, stamps=(), probed=False, version=None, torch_version=None),
        "venvs",
        "ok",
        ("nothing to compare",),
    ),
    (
        "vLLM's venv not probed: not compared",
        with_vllm(GPU_BOX, probed=False, version=None, torch_version=None, torch_nccl=None),
        "venvs",
        "ok",
        ("not compared", "--no-vllm"),
    ),
    (
        "little RAM for a real model",
        dataclasses.replace(CPU_BOX, ram_available_bytes=2 * GIB),
        "ram",
        "warn",
        ("2.0 GiB available", "--model tiny"),
    ),
    (
        "little RAM is plenty for the tiny model",
        dataclasses.replace(CPU_BOX, ram_available_bytes=2 * GIB, model="tiny"),
        "ram",
        "ok",
        (),
    ),
    (
        "a full disk",
        dataclasses.replace(CPU_BOX, disk_free_bytes=GIB // 2),
        "disk",
        "fail",
        ("0.5 GiB free", "min_free_disk_gib", "another --data-dir"),
    ),
    (
        "a data dir other users can read",
        dataclasses.replace(CPU_BOX, data_dir="run", data_dir_mode=0o755, events_mode=0o644),
        "data",
        "warn",
        ("run is 0755, events.sqlite is 0644", "other users", "chmod -R go-rwx run"),
    ),
    (
        "a private dir with a readable events.sqlite",
        dataclasses.replace(CPU_BOX, data_dir="run", data_dir_mode=0o700, events_mode=0o644),
        "data",
        "warn",
        ("events.sqlite is 0644", "chmod -R go-rwx run"),
    ),
    (
        "a data dir its group may read, as data_umask allows",
        dataclasses.replace(
            CPU_BOX, data_dir="run", data_dir_mode=0o750, events_mode=0o640, data_umask=0o027
        ),
        "data",
        "ok",
        ("run is 0750",),
    ),
    (
        "a group-readable dir where data_umask = 027 takes more",
        dataclasses.replace(CPU_BOX, data_dir="run", data_dir_mode=0o775, data_umask=0o027),
        "data",
        "warn",
        ("run is 0775", "chmod -R g-w,o-rwx run"),
    ),
]


@pytest.mark.parametrize(("case", "facts", "name", "status", "words"), CASES, ids=[case[0] for case in CASES])
def test_each_problem_is_named_with_its_fix(
    case: str, facts: Facts, name: str, status: str, words: tuple[str, ...]
) -> None:
    check = only(facts, name)
    assert check.status == status, check.line()
    for word in words:
        assert word in check.line(), (word, check.line())
    assert (check.fix is not None) == (status != "ok"), check.line()
    assert "\n" not in check.line()


def test_exit_status_fails_only_on_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(env={})
    for facts, code in (
        (CPU_BOX, 0),
        (dataclasses.replace(CPU_BOX, shm_total_bytes=64 * MIB, shm_free_bytes=64 * MIB), 0),  # a warning
        (dataclasses.replace(CPU_BOX, device="cuda"), 1),
    ):
        monkeypatch.setattr(doctor, "gather", lambda config, probe_vllm, facts=facts: facts)
        out = io.StringIO()
        assert doctor.run(config, out=out) == code
        lines = out.getvalue().splitlines()
        assert len(lines) == len(doctor.CHECKS) + 1
        assert lines[-1].startswith(f"{code} failed")
        out = io.StringIO()
        assert doctor.run(config, as_json=True, out=out) == code
        assert json.loads(out.getvalue())["ok"] is (code == 0)


def test_doctor_reads_the_data_dirs_permissions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = load_config(overrides={"data_dir": run}, env={})
    assert only(doctor_facts.gather(config, probe_vllm=False), "data").status == "ok"  # not there yet
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    (run / "events.sqlite").write_bytes(b"")
    (run / "events.sqlite").chmod(0o644)
    check = only(doctor_facts.gather(config, probe_vllm=False), "data")
    assert (check.status, check.fix) == ("warn", f"chmod -R go-rwx {run}"), check.line()
    subprocess.run(["chmod", "-R", "go-rwx", str(run)], check=True)  # the fix, as printed
    assert only(doctor_facts.gather(config, probe_vllm=False), "data").status == "ok"


def fake_interpreter(tmp_path: Path, script: str, stamp: str | None = ".vllm-gpu") -> Path:
    """``<tmp>/venv/bin/python``: a shell script standing in for vLLM's interpreter."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\n{script}\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    if stamp is not None:
        (tmp_path / "venv" / stamp).touch()
    return python


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "echo 'INFO vllm logs to stdout first'\n"
            'echo \'{"vllm": "0.33.0", "torch": "2.14.0", "cuda": "13.0", "nccl": "2.30.7"}\'',
            {
                "probed": True,
                "version": "0.33.0",
                "torch_build": "cuda",
                "torch_cuda": "13.0",
                "torch_nccl": "2.30.7",
                "error": None,
            },
        ),
        (
            "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1",
            {"probed": True, "version": None, "error": "ModuleNotFoundError: No module named 'vllm'"},
        ),
        ("exec sleep 30", {"probed": True, "version": None, "error": "import vllm did not finish in 0.5 s"}),
    ],
    ids=["answers", "fails", "hangs"],
)
def test_the_vllm_probe_reads_its_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, expected: dict[str, Any]
) -> None:
    monkeypatch.setattr(doctor_facts, "VLLM_PROBE_TIMEOUT_S", 0.5)
    python = fake_interpreter(tmp_path, script)
    facts = doctor_facts.gather(load_config(overrides={"vllm_python": python, "data_dir": tmp_path}, env={}))
    assert facts.vllm.exists and facts.vllm.stamps == (".vllm-gpu",)
    assert {key: getattr(facts.vllm, key) for key in expected} == expected
    skipped = doctor_facts.gather(
        load_config(overrides={"vllm_python": python, "data_dir": tmp_path}, env={}), probe_vllm=False
    )
    assert not skipped.vllm.probed and skipped.vllm.torch_build == "cuda"  # by its stamp


def test_a_vllm_venv_on_another_torch_fails_doctor(tmp_path: Path) -> None:
    """This venv's real torch against a vLLM interpreter that answers with another release."""
    import torch

    other = "2.13.0" if torch.__version__.split("+")[0] != "2.13.0" else "2.14.0"
    answer = json.dumps({"vllm": "0.33.0", "torch": other, "cuda": None, "nccl": None})
    python = fake_interpreter(tmp_path, f"echo '{answer}'", stamp=".vllm-cpu")
    config = load_config(overrides={"vllm_python": python, "data_dir": tmp_path}, env={})
    facts = doctor_facts.gather(config)
    assert facts.torch_version == torch.__version__ and facts.vllm.torch_version == other
    check = only(facts, "venvs")
    assert check.status == "fail", check.line()
    assert f"torch {torch.__version__}" in check.line() and f"{other} at " in check.line()
    assert check.fix is not None and "make bootstrap" in check.fix and "\n" not in check.line()
    out = io.StringIO()
    assert doctor.run(config, out=out) == 1
    assert any(line.startswith("fail  venvs") for line in out.getvalue().splitlines()), out.getvalue()


def test_gpus_are_read_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        "#!/bin/sh\n"
        "echo '0, GPU-aaaa, 143771, 143000, 580.65.06, NVIDIA H200'\n"
        "echo '1, GPU-bbbb, 143771, 1000, 580.65.06, NVIDIA H200'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU nvidia-smi lists
    facts = doctor_facts.gather(load_config(overrides={"data_dir": tmp_path}, env={}), probe_vllm=False)
    assert facts.nvidia_smi and facts.driver_version == "580.65.06"
    assert facts.gpus == (
        GpuInfo(index=0, name="NVIDIA H200", free_bytes=143000 * MIB, total_bytes=143771 * MIB),
        GpuInfo(index=1, name="NVIDIA H200", free_bytes=1000 * MIB, total_bytes=143771 * MIB),
    )
    if not torch.version.cuda:  # this machine's torch: GPUs it cannot use
        assert only(facts, "gpu").status == "fail"


def test_a_venv_without_torch_is_reported_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(overrides={"data_dir": tmp_path}, env={})
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    facts = doctor_facts.gather(config, probe_vllm=False)
    assert (facts.torch_version, facts.torch_build, facts.cuda_available) == (None, None, False)
    assert facts.torch_error is not None and "torch" in facts.torch_error
    assert only(facts, "torch").status == "fail"
    assert facts.ram_total_bytes is not None and facts.ram_total_bytes > 0  # the rest is still measured


def test_doctor_on_this_machine(tmp_path: Path) -> None:
    import torch

    done = cli("doctor", "--json", "--no-vllm", "--data-dir", str(tmp_path / "run"), timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == (0 if report["ok"] else 1), done.stderr
    facts = report["facts"]
    assert facts["torch_build"] == ("cuda" if torch.version.cuda else "cpu")
    assert facts["torch_version"] == torch.__version__
    assert facts["ram_total_bytes"] > 0 and facts["ram_available_bytes"] > 0
    assert facts["cpu_count"] >= 1 and facts["disk_free_bytes"] > 0
    assert facts["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # "auto", resolved
    assert facts["vllm"]["probed"] is False
    assert facts["verl_version"] is not None, facts["verl_error"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["torch"]["status"] == "ok" and checks["verl"]["status"] == "ok"
    if not torch.version.cuda:
        assert facts["torch_build"] == "cpu" and checks["device"]["summary"] == "cpu"


@pytest.mark.vllm
@pytest.mark.skipif(
    not (ROOT / ".venv-vllm" / "bin" / "python").is_file(), reason="no .venv-vllm (make vllm-cpu builds it)"
)
def test_doctor_probes_the_real_vllm_venv(tmp_path: Path) -> None:
    done = cli("doctor", "--json", "--data-dir", str(tmp_path / "run"), timeout=180)
    report = json.loads(done.stdout)
    vllm = report["facts"]["vllm"]
    assert vllm["probed"] and vllm["error"] is None, vllm
    if ".vllm-cpu" in vllm["stamps"]:
        assert (vllm["version"], vllm["torch_build"]) == ("0.32.0", "cpu")
    checks = {c["name"]: c for c in report["checks"]}
    assert f"vLLM {vllm['version']}" in checks["vllm"]["summary"]
    # make builds both venvs on one torch release (the Makefile's "One torch in both venvs").
    trainer_torch = report["facts"]["torch_version"].split("+")[0]
    assert vllm["torch_version"].split("+")[0] == trainer_torch
    assert (checks["venvs"]["status"], checks["venvs"]["summary"]) == (
        "ok",
        f"torch {trainer_torch} in both venvs"
        + (f", NCCL {report['facts']['torch_nccl']}" if vllm["torch_nccl"] else ""),
    ), checks["venvs"]
    text = cli("doctor", "--engine", "vllm", "--data-dir", str(tmp_path / "run"), timeout=180)
    assert any(line.startswith("ok    vllm  ") for line in text.stdout.splitlines()), text.stdout


def test_sandbox_check() -> None:
    from appliance.operations.doctor import check_sandbox

    missing = "bubblewrap is not installed (apt-get install bubblewrap, or dnf install bubblewrap)"
    refused = check_sandbox(
        dataclasses.replace(CPU_BOX, sandbox="auto", process_adapter=True, bwrap_problem=missing)
    )
    assert refused.status == "fail" and "apt-get install bubblewrap" in (refused.fix or "")
    in_process = check_sandbox(
        dataclasses.replace(
            CPU_BOX,
            process_adapter=False,
            bwrap_problem=missing,
            agents="agents run unsandboxed: the python adapter runs agents inside the appliance's process",
        )
    )
    assert in_process.status == "warn" and in_process.fix is None, "no bubblewrap needed for it"
    chosen = check_sandbox(
        dataclasses.replace(
            CPU_BOX, sandbox="none", process_adapter=True, agents='agents run unsandboxed (sandbox = "none")'
        )
    )
    assert chosen.status == "warn" and "auto" in (chosen.fix or "")
    boxed = check_sandbox(
        dataclasses.replace(CPU_BOX, process_adapter=True, agents="agents run sandboxed (bwrap; no network)")
    )
    assert boxed.status == "ok"
