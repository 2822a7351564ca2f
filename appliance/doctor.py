"""``lightning-appliance doctor``: what this machine offers a run, told before one starts.

Owns gathering what a run depends on into one :class:`Facts` (the trainer venv's torch and its
build, the GPUs and their free memory, vLLM's venv and its build, ``/dev/shm``, disk, RAM,
CPUs, verl, Python, and the config's settings they are measured against) and the checks over
it: small pure functions ``Facts -> Check``, each "ok", "warn" or "fail" with, for a problem,
the fix a person can apply. Only :func:`gather` touches the machine: it imports torch and verl,
asks ``nvidia-smi``, and probes vLLM's interpreter in a subprocess with a timeout (the slow
part, ~5 s here; ``probe_vllm=False`` skips it). The checks are tested with made-up facts.

It does not own the start-up checks that refuse a run (``appliance.preflight``: lock, port,
disk, model), nor the config (``appliance.config``), nor how the venvs are built (the
Makefile: ``make bootstrap`` records the torch build it installed in ``.venv/.torch-build``,
``make vllm-cpu`` / ``make vllm-gpu`` leave ``.vllm-cpu`` / ``.vllm-gpu`` in ``.venv-vllm``).

What fails and what only warns: a fail is what makes the run this config describes fail or
silently waste the machine (torch missing, GPUs visible to a CPU build of torch, device =
"cuda" without one, too little disk, verl missing for trainer = "verl", vLLM missing or broken
for engine = "vllm"). vLLM's venv is a warning when the engine is torch: only ``--engine vllm``
needs it, and ``doctor --engine vllm`` makes it a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from appliance.config import ApplianceConfig

__all__ = ["CHECKS", "Check", "Facts", "Gpu", "VllmFacts", "gather", "report", "run", "run_checks"]

Status = Literal["ok", "warn", "fail"]

#: Seconds the vLLM probe (``import vllm, torch`` in vLLM's interpreter) may take.
VLLM_PROBE_TIMEOUT_S = 60.0
#: Available RAM below which a run of a real model (not "tiny") is warned about: SmolLM2-135M
#: peaks at ~3.5 GB while generating and 4-8 GB while training (measured, FINDINGS).
RAM_WARN_BYTES = 4 << 30
#: /dev/shm below which NCCL between several GPUs is warned about (Docker's default is 64 MiB).
SHM_NCCL_BYTES = 1 << 30
#: The stamps the Makefile leaves in the venvs.
TORCH_STAMP = ".torch-build"
VLLM_STAMPS = {".vllm-cpu": "cpu", ".vllm-gpu": "cuda"}

_PROBE = (
    "import json, torch, vllm; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, 'cuda': torch.version.cuda}))"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    index: int
    name: str
    free_bytes: int
    total_bytes: int


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
    torch_error: str | None = None
    #: What ``make bootstrap`` recorded in ``<venv>/.torch-build`` (None: no stamp).
    torch_stamp: str | None = None
    cuda_available: bool = False
    #: Whether ``nvidia-smi`` answered, the driver it reports, and the GPUs (from ``nvidia-smi``,
    #: else from torch when it sees GPUs without it).
    nvidia_smi: bool = False
    driver_version: str | None = None
    gpus: tuple[Gpu, ...] = ()
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    #: /dev/shm (None: there is none).
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None
    #: The data directory and the disk it is on (its nearest existing parent when it is not there yet).
    data_dir: str = "appliance-data"
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
    gpu_memory_utilization: float = 0.9
    vllm_url: str | None = None


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    summary: str
    #: What to do about it (None when there is nothing to do).
    fix: str | None = None

    def line(self) -> str:
        fix = f" -> {self.fix}" if self.fix else ""
        return f"{self.status:<4}  {self.name:<6}  {self.summary}{fix}"


# --- the checks: pure functions of the facts ------------------------------------------------


def check_python(f: Facts) -> Check:
    return Check("python", "ok", f"Python {f.python_version} ({f.python_executable})")


def check_torch(f: Facts) -> Check:
    if f.torch_version is None:
        return Check(
            "torch", "fail", f"torch does not import: {f.torch_error}", "rm -rf .venv && make bootstrap"
        )
    build = _build_text(f.torch_build, f.torch_cuda)
    if f.torch_stamp is not None and f.torch_stamp != f.torch_build:
        return Check(
            "torch",
            "warn",
            f"torch {f.torch_version} ({build}), but make bootstrap installed the {f.torch_stamp} build",
            "torch was changed after make bootstrap; rm -rf .venv && make bootstrap installs the build "
            "for this machine",
        )
    stamp = f", stamp {TORCH_STAMP}: {f.torch_stamp}" if f.torch_stamp else ""
    return Check("torch", "ok", f"torch {f.torch_version} ({build}){stamp}")


def check_gpus(f: Facts) -> Check:
    n = len(f.gpus)
    if not n:
        why = "nvidia-smi lists none" if f.nvidia_smi else "nvidia-smi does not answer"
        return Check("gpu", "ok", f"no GPU ({why}): the appliance runs on CPU")
    if f.torch_build == "cpu":
        return Check(
            "gpu",
            "fail",
            f"{_gpu_count(n)} visible but torch is a CPU build",
            "rm -rf .venv && make bootstrap on this machine (where nvidia-smi answers it installs the "
            "CUDA build)",
        )
    if f.torch_version is not None and not f.cuda_available:
        driver = f" (driver {f.driver_version})" if f.driver_version else ""
        return Check(
            "gpu",
            "fail",
            f"nvidia-smi lists {_gpu_count(n)}{driver} but torch (CUDA {f.torch_cuda}) sees none",
            f"a driver too old for CUDA {f.torch_cuda} (CUDA 13 needs driver >= 580), or "
            "CUDA_VISIBLE_DEVICES hides them",
        )
    listing = _gpu_listing(f.gpus)
    if f.engine == "vllm" and f.device.startswith("cuda"):
        short = [g for g in f.gpus if g.free_bytes < f.gpu_memory_utilization * g.total_bytes]
        if short:
            least = min(g.free_bytes / g.total_bytes for g in short if g.total_bytes)
            return Check(
                "gpu",
                "warn",
                f"{listing}; vLLM takes gpu_memory_utilization = {f.gpu_memory_utilization:g} of each "
                f"GPU but GPU {', '.join(str(g.index) for g in short)} has less free",
                "another process holds GPU memory (nvidia-smi shows which): stop it, or set "
                f"gpu_memory_utilization <= {int(least * 100) / 100:.2f}",
            )
    return Check("gpu", "ok", listing)


def check_device(f: Facts) -> Check:
    if f.device.startswith("cuda") and not f.cuda_available:
        return Check(
            "device",
            "fail",
            f"device = {f.device} but torch sees no CUDA GPU",
            'set device = "auto" (the default: cuda where torch sees a GPU) or "cpu"',
        )
    if f.device == "cpu" and f.cuda_available:
        return Check("device", "ok", 'cpu, although torch sees a GPU (device = "auto" would use it)')
    return Check("device", "ok", f.device)


def check_verl(f: Facts) -> Check:
    if f.verl_version is None:
        needed = f.trainer == "verl"
        return Check(
            "verl",
            "fail" if needed else "warn",
            f"verl does not import: {f.verl_error}" + ("" if needed else " (only --trainer verl needs it)"),
            "make bootstrap (it installs verl 0.9.1 without its dependencies)",
        )
    return Check("verl", "ok", f"verl {f.verl_version}")


def check_vllm(f: Facts) -> Check:
    v = f.vllm
    needed = f.engine == "vllm"
    if needed and f.vllm_url:
        return Check("vllm", "ok", f"attaches to the server at {f.vllm_url} (vllm_url); no venv needed")
    bad: Status = "fail" if needed else "warn"
    only = "" if needed else " (only --engine vllm needs it)"
    if not v.exists:
        return Check(
            "vllm",
            bad,
            f"no vLLM venv at {v.python}{only}",
            "make vllm (the CUDA build where nvidia-smi answers, else make vllm-cpu), or point "
            "vllm_python at one",
        )
    if v.error is not None:
        return Check(
            "vllm", bad, f"vLLM at {v.python} does not import: {v.error}", "make clean-vllm && make vllm"
        )
    stamp = f"stamp {', '.join(v.stamps)}" if v.stamps else "no stamp"
    build = _build_text(v.torch_build, v.torch_cuda)
    if v.version is not None:
        summary = f"vLLM {v.version}, torch {v.torch_version} ({build}) at {v.python}, {stamp}"
    else:
        summary = f"{v.python}, {stamp} ({build}), not probed (--no-vllm)"
    gpus = len(f.gpus)
    if v.torch_build == "cpu" and gpus:
        return Check(
            "vllm",
            bad,
            f"{summary}: the CPU build on a machine with {_gpu_count(gpus)}",
            "make vllm (it rebuilds .venv-vllm with the CUDA build where nvidia-smi answers)",
        )
    if v.torch_build == "cuda" and not gpus:
        return Check(
            "vllm",
            bad,
            f"{summary}: a CUDA build on a machine without a GPU",
            "make vllm (it rebuilds .venv-vllm with the CPU build where nvidia-smi does not answer)",
        )
    if not v.stamps:
        return Check(
            "vllm", "warn", f"{summary}: not built by make", "make clean-vllm && make vllm, if it misbehaves"
        )
    return Check("vllm", "ok", summary)


def check_ram(f: Facts) -> Check:
    if f.ram_total_bytes is None or f.ram_available_bytes is None:
        return Check(
            "ram", "warn", "unknown (no /proc/meminfo)", "check it by hand: a real model needs 4-8 GB"
        )
    summary = f"{_gib(f.ram_available_bytes)} available of {_gib(f.ram_total_bytes)}"
    if f.model != "tiny" and f.ram_available_bytes < RAM_WARN_BYTES:
        return Check(
            "ram",
            "warn",
            f"{summary}: model {f.model} peaks at 4-8 GB while training",
            "close other programs, give the machine (container) more memory, or run --model tiny",
        )
    return Check("ram", "ok", summary)


def check_cpu(f: Facts) -> Check:
    return Check("cpu", "ok", f"{f.cpu_count} CPU core{'s' if f.cpu_count != 1 else ''}")


def check_shm(f: Facts) -> Check:
    if f.shm_total_bytes is None or f.shm_free_bytes is None:
        return Check(
            "shm",
            "warn",
            "no /dev/shm: weight pushes stage their buckets in the temporary directory instead",
            "mount a tmpfs at /dev/shm (docker run --shm-size=16g)",
        )
    summary = f"/dev/shm is {_size(f.shm_total_bytes)} ({_size(f.shm_free_bytes)} free)"
    bucket = f.push_bucket_mb << 20
    if f.shm_free_bytes < 2 * bucket:  # one bucket in flight, and room for anything else there
        fits = _power_of_two_at_most(f.shm_free_bytes // 2 >> 20)
        smaller = f" or set push_bucket_mb <= {fits}" if fits else ""
        return Check(
            "shm",
            "warn",
            f"{summary}: weight pushes stage buckets of push_bucket_mb = {f.push_bucket_mb} MiB there",
            f"run the container with --shm-size=16g{smaller}",
        )
    if len(f.gpus) > 1 and f.shm_total_bytes < SHM_NCCL_BYTES:
        return Check(
            "shm",
            "warn",
            f"{summary}: NCCL between the {len(f.gpus)} GPUs needs more",
            "run the container with --shm-size=16g",
        )
    return Check("shm", "ok", summary)


def check_disk(f: Facts) -> Check:
    if f.disk_free_bytes is None or f.disk_total_bytes is None:
        return Check("disk", "warn", f"cannot tell the free space at {f.data_dir}", "check it by hand: df -h")
    summary = f"{_gib(f.disk_free_bytes)} free of {_gib(f.disk_total_bytes)} at {f.data_dir}"
    if f.disk_free_bytes < f.min_free_disk_gib * (1 << 30):
        return Check(
            "disk",
            "fail",
            f"{summary}: the appliance needs {f.min_free_disk_gib:g} GiB (min_free_disk_gib)",
            "free space or use another --data-dir",
        )
    return Check("disk", "ok", summary)


#: Every check, in the order they are printed.
CHECKS: tuple[Callable[[Facts], Check], ...] = (
    check_python,
    check_torch,
    check_gpus,
    check_device,
    check_verl,
    check_vllm,
    check_ram,
    check_cpu,
    check_shm,
    check_disk,
)


def run_checks(facts: Facts) -> list[Check]:
    return [check(facts) for check in CHECKS]


def report(facts: Facts, checks: Sequence[Check]) -> dict[str, Any]:
    """What ``doctor --json`` prints: ``ok`` (nothing failed), the checks, and the facts."""
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
        "facts": dataclasses.asdict(facts),
    }


def run(
    config: ApplianceConfig, *, probe_vllm: bool = True, as_json: bool = False, out: TextIO = sys.stdout
) -> int:
    """Gather, check, print; 1 when a check failed, else 0 (warnings do not fail)."""
    facts = gather(config, probe_vllm=probe_vllm)
    checks = run_checks(facts)
    if as_json:
        print(json.dumps(report(facts, checks), indent=2), file=out)
    else:
        for check in checks:
            print(check.line(), file=out)
        failed = sum(c.status == "fail" for c in checks)
        warned = sum(c.status == "warn" for c in checks)
        print(f"{failed} failed, {warned} warning{'s' if warned != 1 else ''}", file=out)
    return 1 if any(c.status == "fail" for c in checks) else 0


# --- gathering: the only part that touches the machine -------------------------------------


def gather(config: ApplianceConfig, *, probe_vllm: bool = True) -> Facts:
    """Measure this machine (and this interpreter, the trainer's venv) for ``config``."""
    python = _vllm_python(config.vllm_python)
    # vLLM's import takes seconds: it runs in its own process while this one looks at the rest.
    probe = _start_probe(python) if probe_vllm and python.is_file() else None
    torch_facts = _torch_facts()
    smi = _nvidia_smi()
    gpus = smi[1] if smi is not None else _torch_gpus(torch_facts["cuda_available"])
    ram = _meminfo()
    shm = _statvfs(Path("/dev/shm"))
    disk = _disk(config.data_dir)
    verl_version, verl_error = _verl()
    return Facts(
        python_version=sys.version.split()[0],
        python_executable=_short(Path(sys.executable)),
        cpu_count=os.cpu_count() or 1,
        **torch_facts,
        torch_stamp=_read_stamp(Path(sys.prefix) / TORCH_STAMP) if sys.prefix != sys.base_prefix else None,
        nvidia_smi=smi is not None,
        driver_version=smi[0] if smi is not None else None,
        gpus=gpus,
        ram_total_bytes=ram[0],
        ram_available_bytes=ram[1],
        shm_total_bytes=shm[0],
        shm_free_bytes=shm[1],
        data_dir=str(config.data_dir),
        disk_free_bytes=disk[0],
        disk_total_bytes=disk[1],
        verl_version=verl_version,
        verl_error=verl_error,
        vllm=_vllm_facts(python, probe),
        engine=config.engine,
        trainer=config.trainer,
        device=config.device,
        model=config.model,
        push_bucket_mb=config.push_bucket_mb,
        min_free_disk_gib=config.min_free_disk_gib,
        gpu_memory_utilization=config.gpu_memory_utilization,
        vllm_url=config.vllm_url,
    )


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
        "cuda_available": bool(torch.cuda.is_available()),
    }


def _nvidia_smi() -> tuple[str | None, tuple[Gpu, ...]] | None:
    """(driver version, GPUs) from ``nvidia-smi``; None when it is absent or does not answer.
    It creates no CUDA context, unlike asking torch for free memory."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = "--query-gpu=index,name,memory.free,memory.total,driver_version"
    try:
        result = subprocess.run(
            [smi, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    gpus: list[Gpu] = []
    driver: str | None = None
    for row in result.stdout.strip().splitlines():
        fields = [field.strip() for field in row.split(",")]
        if len(fields) < 5:
            continue
        driver = fields[-1]
        with contextlib.suppress(ValueError):  # "[N/A]" where a MIG device has no figure
            gpus.append(
                Gpu(
                    index=int(fields[0]),
                    name=", ".join(fields[1:-3]),  # a name may hold a comma
                    free_bytes=int(fields[-3]) << 20,
                    total_bytes=int(fields[-2]) << 20,
                )
            )
    return driver, tuple(gpus)


def _torch_gpus(cuda_available: bool) -> tuple[Gpu, ...]:
    """The GPUs torch sees, where ``nvidia-smi`` is not there to ask (this creates CUDA contexts)."""
    if not cuda_available:
        return ()
    import torch

    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(
            Gpu(index=index, name=torch.cuda.get_device_name(index), free_bytes=free, total_bytes=total)
        )
    return tuple(gpus)


def _meminfo() -> tuple[int | None, int | None]:
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(fields["MemTotal"].split()[0]) << 10, int(fields["MemAvailable"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        return None, None


def _statvfs(path: Path) -> tuple[int | None, int | None]:
    """(total, free to an unprivileged user) of the file system at ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


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
    cuda = answer.get("cuda")
    return dataclasses.replace(
        base,
        probed=True,
        version=str(answer["vllm"]),
        torch_version=str(answer.get("torch")),
        torch_build="cuda" if cuda else "cpu",
        torch_cuda=str(cuda) if cuda else None,
    )


# --- formatting -----------------------------------------------------------------------------


def _build_text(build: str | None, cuda: str | None) -> str:
    if build == "cuda":
        return f"CUDA {cuda} build" if cuda else "CUDA build"
    return "CPU build" if build == "cpu" else "build unknown"


def _gpu_count(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def _gpu_listing(gpus: Sequence[Gpu]) -> str:
    names = {g.name for g in gpus}
    memory = ", ".join(f"{g.index}: {_gib(g.free_bytes)} free of {_gib(g.total_bytes)}" for g in gpus)
    kind = f"{len(gpus)} x {names.pop()}" if len(names) == 1 else _gpu_count(len(gpus))
    return f"{kind} ({memory})"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _size(n: int) -> str:
    return _gib(n) if n >= 1 << 30 else f"{n >> 20} MiB"


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (0 for n < 1)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def _short(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it."""
    with contextlib.suppress(ValueError):
        return str(path.absolute().relative_to(Path.cwd()))
    return str(path)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
