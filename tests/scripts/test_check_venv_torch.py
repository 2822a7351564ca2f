"""scripts/check_venv_torch.py, the check ``make vllm-cpu`` / ``make vllm-gpu`` run: the torch a
vLLM wheel pins read from its requirements (markers evaluated), and the cases the make-level
tests (tests/test_makefile.py) do not reach."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.test_makefile import fake_vllm_venv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "check_venv_torch", raising=False)


#: vllm-cpu 0.32.0's torch requirements, as its metadata lists them.
VLLM_CPU_REQUIRES = [
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or '
    'platform_machine == "aarch64"',
    'torch==2.13.0; platform_system == "Darwin" or platform_machine == "ppc64le" or '
    'platform_machine == "riscv64"',
    'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"',
]


def test_the_pin_that_applies_here_is_read() -> None:
    import platform

    import check_venv_torch

    expected = "2.13.0+cpu" if platform.machine() in ("x86_64", "s390x", "aarch64") else "2.13.0"
    assert check_venv_torch.torch_pin(VLLM_CPU_REQUIRES) == expected
    assert check_venv_torch.torch_pin(["torch==2.14.0", "torchvision==0.29.0"]) == "2.14.0"
    assert check_venv_torch.torch_pin(["torchaudio==2.14.0", "torch>=2.6"]) is None  # no exact pin
    assert check_venv_torch.release("2.13.0+cpu") == "2.13.0"


def test_before_the_trainer_venv_exists_vllm_is_checked_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import check_venv_torch

    python = fake_vllm_venv(tmp_path / "vv", "vllm==0.33.0", "2.14.0", "torch==2.14.0")
    args = ["--build", "cuda", "--vllm", "vllm==0.33.0", "--torch", "2.14.0", "--vllm-python", str(python)]
    assert check_venv_torch.main([*args, "--trainer-python", str(tmp_path / "none" / "bin" / "python")]) == 0
    assert "holds torch 2.14.0 (vllm 0.33.0 pins it)" in capsys.readouterr().out


def test_a_vllm_venv_whose_torch_was_changed_is_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import check_venv_torch

    python = fake_vllm_venv(tmp_path / "vv", "vllm==0.33.0", "2.13.0", "torch==2.14.0")
    args = ["--build", "cuda", "--vllm", "vllm==0.33.0", "--torch", "2.14.0", "--vllm-python", str(python)]
    assert check_venv_torch.main([*args, "--trainer-python", sys.executable]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "holds torch 2.13.0, vllm 0.33.0 pins 2.14.0: make clean-vllm && make vllm" in line
