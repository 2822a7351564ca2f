"""The memory readings of scripts/bench_push.py, taken while a push runs.

Owns the ``/proc`` readers (a process's ``FIELDS`` of ``/proc/<pid>/status``, the machine's
``Shmem`` of ``/proc/meminfo``), ``malloc_trim`` (the heap's free pages handed back before a push,
so that its baseline is not inflated) and ``PeakMemory``, the thread that samples the readers
during a push and gives each field's peak over its value on entry. What is pushed, and how the
figures are reported, is ``bench_push``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

#: The fields of /proc/<pid>/status sampled, in the order they are reported.
FIELDS = ("VmRSS", "RssAnon", "RssShmem")


def read_kb_fields(path: str, fields: Sequence[str]) -> dict[str, int]:
    """``fields`` of a ``/proc`` file of "Name: value kB" lines, in bytes (missing: 0)."""
    values = dict.fromkeys(fields, 0)
    with Path(path).open(encoding="ascii") as lines:
        for line in lines:
            name, _, rest = line.partition(":")
            if name in values:
                values[name] = int(rest.split()[0]) * 1024
    return values


def process(pid: int) -> Callable[[], dict[str, int]]:
    """``FIELDS`` of ``/proc/<pid>/status``."""
    return functools.partial(read_kb_fields, f"/proc/{pid}/status", FIELDS)


def system_shmem() -> dict[str, int]:
    """The machine's shared memory in use (``Shmem`` of ``/proc/meminfo``): a page of the bucket
    file counts once here however many processes map it (and so does anything else on the
    machine that creates shared memory meanwhile)."""
    return read_kb_fields("/proc/meminfo", ("Shmem",))


def malloc_trim() -> None:
    """Hand the heap's free pages back (glibc), so that the baseline before a push is not
    inflated by a previous push's freed copy. A no-op where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Reads ``sources`` (label -> field values) in a thread every ``interval_s`` while in the
    block; ``extra[label][field]``: the peak minus the value on entry, each field on its own."""

    def __init__(self, sources: dict[str, Callable[[], dict[str, int]]], interval_s: float = 0.005) -> None:
        self.sources = sources
        self.interval_s = interval_s
        self.before: dict[str, dict[str, int]] = {}
        self.peak: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        for label, read in self.sources.items():
            peak = self.peak[label]
            for name, value in read().items():
                peak[name] = max(peak[name], value)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self.before = {label: read() for label, read in self.sources.items()}
        self.peak = {label: dict(values) for label, values in self.before.items()}
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def extra(self) -> dict[str, dict[str, int]]:
        return {
            label: {name: peak - self.before[label][name] for name, peak in values.items()}
            for label, values in self.peak.items()
        }
