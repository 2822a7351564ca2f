"""What ``lightning-appliance doctor`` looks at: this machine and the venvs, gathered once.

Owns :class:`Facts` (the trainer venv's torch, its build and its NCCL, the GPUs and their free
memory, vLLM's venv, its build, its torch and that torch's NCCL, ``/dev/shm``, disk, RAM, CPUs,
the data directory's permissions,
verl, Python, and the config's settings they are measured against) and :func:`gather`, the
only part of ``doctor`` that touches the machine: it imports torch and verl, reads the GPUs and
host RAM as ``plan`` and ``up`` do (``appliance.placement.machine``: ``nvidia-smi`` first, torch's view
only where it does not answer), and probes vLLM's interpreter in a subprocess with a timeout
(the slow part, ~5 s here; ``probe_vllm=False`` skips it), while the rest is measured.

It does not own the checks over the facts nor the report (``appliance.operations.doctor``: pure, tested
with made-up facts), nor how the venvs are built (the Makefile: one torch release per build for
both venvs; ``make bootstrap`` records the torch build it installed in ``.venv/.torch-build``,
``make vllm-cpu`` / ``make vllm-gpu`` leave ``.vllm-cpu`` / ``.vllm-gpu`` in ``.venv-vllm``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import ApplianceConfig, umask_bits
from appliance.placement.machine import GpuInfo, host_ram, inspect_gpus
from appliance.placement.memory_model import MAX_UTILIZATION

__all__ = ["TORCH_STAMP", "VLLM_PROBE_TIMEOUT_S", "VLLM_STAMPS", "Facts", "VllmFacts", "gather"]

#: Seconds the vLLM probe (``import vllm, torch`` in vLLM's interpreter) may take.
VLLM_PROBE_TIMEOUT_S = 60.0
#: The stamps the Makefile leaves in the venvs.
TORCH_STAMP = ".torch-build"
VLLM_STAMPS = {".vllm-cpu": "cpu", ".vllm-gpu": "cuda"}

#: Run by vLLM's interpreter: its vLLM, its torch, and that torch's NCCL (CUDA builds).
_PROBE = """
import json, torch, vllm
try:
    import torch.cuda.nccl as nccl
    version = ".".join(str(part) for part in nccl.version()) if torch.version.cuda else None
except Exception:
    version = None
print(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": version}))
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmFacts:
    """vLLM's own virtualenv (config ``vllm_python``)."""

    python: str
    exists: bool
    #: Which of the Makefile's stamps the venv has (".vllm-cpu", ".vllm-gpu").
    stamps: tuple[str, ...] = ()
    #: Whether its interpreter was asked (False: ``--no-vllm``, or no interpreter there).
    probed: bool = False
    version: str | None = None
    torch_version: str | None = None
    #: "cuda" or "cpu": from the probe, else from the stamp; None: unknown.
    torch_build: str | None = None
    torch_cuda: str | None = None
    #: ``torch.cuda.nccl.version()`` of its torch, "2.30.7" (None: a CPU build, or not probed).
    torch_nccl: str | None = None
    #: Why the probe failed (the import's last error line, or the timeout).
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """Everything the checks look at; :func:`gather` measures it, tests make it up."""

    python_version: str
    python_executable: str
    cpu_count: int
    #: torch in this (the trainer's) interpreter; None when it does not import (``torch_error``).
    torch_version: str | None
    #: "cuda" or "cpu" (``torch.version.cuda`` set or not).
    torch_build: str | None
    torch_cuda: str | None = None
    #: ``torch.cuda.nccl.version()``, "2.30.7": what a weight push's NCCL group checks against
    #: vLLM's (None: a CPU build, or NCCL not loadable).
    torch_nccl: str | None = None
    torch_error: str | None = None
    #: What ``make bootstrap`` recorded in ``<venv>/.torch-build`` (None: no stamp).
    torch_stamp: str | None = None
    cuda_available: bool = False
    #: Whether ``nvidia-smi`` answered, the driver it reports, and the GPUs CUDA shows this
    #: process (``appliance.placement.machine.inspect_gpus``: from ``nvidia-smi``, else from torch).
    nvidia_smi: bool = False
    driver_version: str | None = None
    gpus: tuple[GpuInfo, ...] = ()
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    #: /dev/shm (None: there is none).
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None
    #: The data directory and the disk it is on (its nearest existing parent when it is not there yet).
    data_dir: str = "appliance-data"
    #: Permission bits of the data directory and of its events.sqlite (None: not there yet).
    data_dir_mode: int | None = None
    events_mode: int | None = None
    disk_free_bytes: int | None = None
    disk_total_bytes: int | None = None
    verl_version: str | None = None
    verl_error: str | None = None
    vllm: VllmFacts
    # The config's settings the facts are measured against.
    engine: str = "torch"
    trainer: str = "torch"
    device: str = "cpu"
    model: str = "smollm2-135m"
    push_bucket_mb: int = 256
    min_free_disk_gib: float = 1.0
    #: ``data_umask`` as bits: what the appliance takes away from what it creates.
    data_umask: int = 0o077
    gpu_memory_utilization: float = 0.9
    vllm_url: str | None = None
    #: ``[harness] sandbox`` as the config says it, whether the run's adapter starts agent
    #: processes (the only ones a sandbox holds), why bubblewrap cannot run here (None: it can),
    #: and the line the run would say about where its agents run.
    sandbox: str = "auto"
    process_adapter: bool = False
    bwrap_problem: str | None = None
    agents: str = ""


# --- gathering ---------------------------------------------------------------------------------


def gather(config: ApplianceConfig, *, probe_vllm: bool = True) -> Facts:
    """Measure this machine (and this interpreter, the trainer's venv) for ``config``."""
    python = _vllm_python(config.engine.vllm_python)
    # vLLM's import takes seconds: it runs in its own process while this one looks at the rest.
    probe = _start_probe(python) if probe_vllm and python.is_file() else None
    torch_facts = _torch_facts()
    # Torch's view of the GPUs only where nvidia-smi does not answer (it creates CUDA contexts).
    found = inspect_gpus(ask_torch=torch_facts["cuda_available"])
    ram_total, ram_available = host_ram()
    shm = _statvfs(Path("/dev/shm"))
    disk = _disk(config.data_dir)
    verl_version, verl_error = _verl()
    return Facts(
        python_version=sys.version.split()[0],
        python_executable=_short(Path(sys.executable)),
        cpu_count=os.cpu_count() or 1,
        **torch_facts,
        torch_stamp=_read_stamp(Path(sys.prefix) / TORCH_STAMP) if sys.prefix != sys.base_prefix else None,
        nvidia_smi=found.nvidia_smi,
        driver_version=found.driver_version,
        gpus=found.gpus,
        ram_total_bytes=ram_total,
        ram_available_bytes=ram_available,
        shm_total_bytes=shm[0],
        shm_free_bytes=shm[1],
        data_dir=str(config.data_dir),
        data_dir_mode=_mode(config.data_dir),
        events_mode=_mode(config.db_path),
        disk_free_bytes=disk[0],
        disk_total_bytes=disk[1],
        verl_version=verl_version,
        verl_error=verl_error,
        vllm=_vllm_facts(python, probe),
        engine=config.engine.kind,
        trainer=config.trainer.backend,
        device=config.device,
        model=config.model,
        push_bucket_mb=config.trainer.push_bucket_mb,
        min_free_disk_gib=config.min_free_disk_gib,
        data_umask=umask_bits(config.data_umask),
        gpu_memory_utilization=config.engine.gpu_memory_utilization or MAX_UTILIZATION,
        vllm_url=config.engine.vllm_url,
        **_sandbox_facts(config),
    )


def _sandbox_facts(config: ApplianceConfig) -> dict[str, Any]:
    from appliance.rollouts.sandboxing import describe, runs_processes
    from harness_adapters.sandbox import bwrap_problem

    problem = bwrap_problem()
    kind = config.harness.sandbox
    if kind == "auto":
        kind = "none" if problem is not None else "bwrap"
    return {
        "sandbox": config.harness.sandbox,
        "process_adapter": runs_processes(config.harness),
        "bwrap_problem": problem,
        "agents": describe(config.harness, kind),
    }


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # a broken install raises more than ImportError
        return {
            "torch_version": None,
            "torch_build": None,
            "torch_error": _one_line(exc),
            "cuda_available": False,
        }
    cuda = torch.version.cuda
    return {
        "torch_version": torch.__version__,
        "torch_build": "cuda" if cuda else "cpu",
        "torch_cuda": cuda,
        "torch_nccl": _nccl_version() if cuda else None,
        "cuda_available": bool(torch.cuda.is_available()),
    }


def _nccl_version() -> str | None:
    """The NCCL this (CUDA) torch loads, "2.30.7"; it asks the library, no GPU needed."""
    try:
        import torch.cuda.nccl as nccl

        parts: tuple[object, ...] = nccl.version()  # type: ignore[no-untyped-call]
        return ".".join(str(part) for part in parts)
    except Exception:  # a build without NCCL, or its library missing
        return None


def _statvfs(path: Path) -> tuple[int | None, int | None]:
    """(total, free to an unprivileged user) of the file system at ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _mode(path: Path) -> int | None:
    """The permission bits of ``path`` (None: it is not there or cannot be looked at)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None


def _disk(data_dir: Path) -> tuple[int | None, int | None]:
    """(free, total) of the disk ``data_dir`` is (or will be) on."""
    where = data_dir.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return None, None
    return usage.free, usage.total


def _verl() -> tuple[str | None, str | None]:
    try:
        import verl
    except Exception as exc:  # verl imports ray, tensordict, ...: anything may be missing
        return None, _one_line(exc)
    return str(getattr(verl, "__version__", "?")), None


def _vllm_python(path: Path) -> Path:
    """``vllm_python`` looked up as the engine looks it up; as given when the engine's module
    does not import (a broken torch, which the torch line reports)."""
    try:
        from appliance.engines.vllm_process import vllm_python
    except Exception:
        return path
    return vllm_python(path)


def _read_stamp(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _start_probe(python: Path) -> tuple[subprocess.Popen[str], float]:
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    process = subprocess.Popen(
        [str(python), "-c", _PROBE],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: a timeout kills whatever it started
    )
    return process, time.monotonic() + VLLM_PROBE_TIMEOUT_S


def _vllm_facts(python: Path, probe: tuple[subprocess.Popen[str], float] | None) -> VllmFacts:
    venv = python.parent.parent
    stamps = tuple(name for name in VLLM_STAMPS if (venv / name).exists())
    base = VllmFacts(
        python=_short(python),
        exists=python.is_file(),
        stamps=stamps,
        torch_build=VLLM_STAMPS[stamps[0]] if len(stamps) == 1 else None,
    )
    if probe is None:
        return base
    process, deadline = probe
    # The deadline counts from the probe's start; one that ended meanwhile is read in full.
    timeout = None if process.poll() is not None else max(0.1, deadline - time.monotonic())
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return dataclasses.replace(
            base, probed=True, error=f"import vllm did not finish in {VLLM_PROBE_TIMEOUT_S:g} s"
        )
    answer: dict[str, Any] | None = None
    for line in reversed(stdout.splitlines()):  # vLLM may log to stdout before the answer
        with contextlib.suppress(ValueError):
            parsed = json.loads(line)
            if isinstance(parsed, dict) and "vllm" in parsed:
                answer = parsed
                break
    if process.returncode != 0 or answer is None:
        lines = [line for line in stderr.splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit status {process.returncode}"
        return dataclasses.replace(base, probed=True, error=why[:300])
    cuda, nccl = answer.get("cuda"), answer.get("nccl")
    return dataclasses.replace(
        base,
        probed=True,
        version=str(answer["vllm"]),
        torch_version=str(answer.get("torch")),
        torch_build="cuda" if cuda else "cpu",
        torch_cuda=str(cuda) if cuda else None,
        torch_nccl=str(nccl) if nccl else None,
    )


def _short(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it."""
    with contextlib.suppress(ValueError):
        return str(path.absolute().relative_to(Path.cwd()))
    return str(path)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
