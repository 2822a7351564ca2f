"""The GPU check's carried wheels: on a machine with PyPI, download the wheels of what the
torch-only mode imports that an image with torch alone lacks (``fetch_wheels``); there, unpack them
onto the path first, with stand-ins for modules imported but never called (``use_wheels``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Distributions the torch-only mode imports that a torch-only image may lack (``--fetch-wheels``).
CARRIED = (
    "verl",
    "tensordict",
    "pyvers",
    "orjson",
    "omegaconf",
    "hydra-core",
    "antlr4-python3-runtime",
    "codetiming",
    "dill",
    "aiosqlite",
    # verl 0.9.1 declares transformers < 5.11: the version tested here, not the image's own.
    "transformers",
    "tokenizers",
)
#: Modules imported at module level that the torch-only path never calls (verl: ray, datasets;
#: the torch engine's grammar constraints: llguidance).
STAND_INS = ("ray", "datasets", "llguidance")


def fetch_wheels(directory: Path, python_version: str) -> int:
    """Download the wheels of ``CARRIED`` at this venv's versions for a Linux x86-64 CPython of
    ``python_version``: what the torch-only mode needs on an image with torch alone."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            print(f"{name} is not installed here; not fetched", file=sys.stderr)
    directory.mkdir(parents=True, exist_ok=True)
    platforms = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(directory),
    ]
    target = [
        f"--python-version={python_version}",
        "--implementation=cp",
        *(f"--platform={p}" for p in platforms),
    ]
    failed = []
    for pin in pins:
        if pin.startswith("antlr4"):
            # Published as a source archive only: built into a pure-Python wheel.
            command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(directory), pin]
        else:
            command = [*download, *target, pin]
        if subprocess.call(command, stdout=subprocess.DEVNULL) != 0:
            failed.append(pin)
    size = sum(f.stat().st_size for f in directory.glob("*.whl"))
    print(f"{len(list(directory.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB, in {directory}")
    if failed:
        print(f"not fetched: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def use_wheels(directory: Path) -> Path:
    """Unpack the wheels in ``directory`` (no dependency resolution) into a temporary directory
    put first on the path (this process's and its children's), with stand-ins for ``STAND_INS``
    where they are missing."""
    import atexit
    import importlib.util
    import shutil

    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    atexit.register(shutil.rmtree, site, True)
    for wheel in sorted(directory.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    sys.path.insert(0, str(site))
    for module in STAND_INS:
        if importlib.util.find_spec(module) is None:
            (site / module).mkdir(exist_ok=True)
            (site / module / "__init__.py").write_text(STAND_IN)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    return site


STAND_IN = '''"""Stand-in: verl imports this module at module level; the check's path never calls it."""


class _Inert(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (_Placeholder,), {})


class _Placeholder(metaclass=_Inert):
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert(name, (_Placeholder,), {})
'''
