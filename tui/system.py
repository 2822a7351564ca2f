"""Machine usage for the overview: GPU memory and utilisation via ``nvidia-smi``, else CPU.

Owns sampling the machine the dashboard runs on (the appliance's, for ``up`` and a local
``tui``). Sampling may block (a subprocess), so the app calls :meth:`SystemSampler.sample` from a
thread. CPU figures come from ``/proc`` (Linux); elsewhere only the GPU line shows. Tests inject
a fixed :class:`Usage` instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Usage:
    #: "GPU 0" / "CPU".
    device: str
    memory_used_gib: float
    memory_total_gib: float
    #: Percent, 0-100.
    utilisation: float

    def text(self) -> str:
        return (
            f"{self.device} mem {self.memory_used_gib:.1f}/{self.memory_total_gib:.1f} GiB  "
            f"util {self.utilisation:.0f}%"
        )


class SystemSampler:
    """Samples the first GPU when ``nvidia-smi`` answers, else CPU and host memory."""

    def __init__(self) -> None:
        self._smi = shutil.which("nvidia-smi")
        self._cpu_before = _cpu_times()

    def sample(self) -> list[Usage]:
        out: list[Usage] = []
        if self._smi:
            out += self._gpus()
        cpu = self._cpu()
        if cpu is not None:
            out.append(cpu)
        return out

    def _cpu(self) -> Usage | None:
        """Host memory in use, and CPU busy time since the previous sample."""
        try:
            fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            total = int(fields["MemTotal"].split()[0]) / 1024**2
            available = int(fields["MemAvailable"].split()[0]) / 1024**2
        except (OSError, KeyError, ValueError):
            return None
        now = _cpu_times()
        busy = 0.0
        if now is not None and self._cpu_before is not None:
            (idle0, total0), (idle1, total1) = self._cpu_before, now
            if total1 > total0:
                busy = 100.0 * (1.0 - (idle1 - idle0) / (total1 - total0))
        self._cpu_before = now
        return Usage(f"CPU x{os.cpu_count() or 1}", total - available, total, busy)

    def _gpus(self) -> list[Usage]:
        assert self._smi is not None
        query = "--query-gpu=index,memory.used,memory.total,utilization.gpu"
        try:
            result = subprocess.run(
                [self._smi, query, "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            self._smi = None  # do not keep trying a broken driver
            return []
        usages: list[Usage] = []
        for line in result.stdout.strip().splitlines():
            try:
                index, used, total, util = (part.strip() for part in line.split(","))
                usages.append(Usage(f"GPU {index}", float(used) / 1024, float(total) / 1024, float(util)))
            except ValueError:
                continue
        return usages


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs, from /proc/stat."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return values[3] + (values[4] if len(values) > 4 else 0), sum(values)
