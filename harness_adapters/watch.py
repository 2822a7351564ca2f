"""The watchdog of a sandboxed run: rollout-wide limits that no single process can be held to.

Owns noticing, while a rollout's processes run, that one of its limits was reached, and ending
the run with the limit's name. Checked every ``TICK_S``:

* the control group (``cgroups.Group.breach``): the kernel refused a fork at ``pids.max`` or
  killed a process at the memory limit. Either ends the run: a fork bomb held at its limit
  would otherwise spin until the rollout's timeout, and an agent that lost a process to the OOM
  killer is not the agent that was started;
* without a control group, the number of processes under the launcher (counted in ``/proc``);
* every ``DISK_EVERY`` ticks (5 s: a large repository takes milliseconds to walk), the
  disk the rollout's directory takes (allocated blocks, walked in a thread), against
  ``SandboxLimits.disk_mb``.

It never raises into the run: ``close`` stops it and returns the breach, or None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness_adapters import _launcher
from harness_adapters.cgroups import Group
from harness_adapters.sandbox import SandboxLimits

log = logging.getLogger(__name__)

TICK_S = 0.25
DISK_EVERY = 20


def disk_usage(root: Path) -> int:
    """Bytes allocated under ``root`` (links not followed; each inode counted once)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for directory, dirs, files in os.walk(root, onerror=lambda _: None):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(directory, name))  # noqa: PTH118 (walk's strings)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


@dataclass
class Watchdog:
    pid: int
    group: Group | None
    limits: SandboxLimits | None
    disk_root: Path | None
    stop: Callable[[], None]
    breach: str | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        pid: int,
        *,
        group: Group | None,
        sandbox: SandboxLimits | None,
        disk_root: Path | None,
        stop: Callable[[], None],
    ) -> Watchdog:
        watchdog = cls(pid, group, sandbox, disk_root, stop)
        if watchdog._needed():
            watchdog._task = asyncio.create_task(watchdog._run(), name=f"watchdog {pid}")
        return watchdog

    def _needed(self) -> bool:
        limits = self.limits
        if limits is None:
            return False
        return self.group is not None or limits.processes is not None or limits.disk_mb is not None

    def _check(self, tick: int) -> str | None:
        limits = self.limits
        assert limits is not None
        if self.group is not None:
            if (found := self.group.breach()) is not None:
                return found
        elif limits.processes is not None and len(_launcher.descendants(self.pid)) > limits.processes + 3:
            # + 3: bwrap, its init and the launcher inside are not the rollout's own.
            return f"process limit reached ({limits.processes} processes)"
        if limits.disk_mb is not None and self.disk_root is not None and tick % DISK_EVERY == 0:
            return self._disk(self.disk_root, limits.disk_mb)
        return None

    @staticmethod
    def _disk(root: Path, disk_mb: int) -> str | None:
        if disk_usage(root) > disk_mb * 1024 * 1024:
            return f"disk limit reached ({disk_mb} MiB in the rollout's directory)"
        return None

    async def _run(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(TICK_S)
            tick += 1
            try:
                found = await asyncio.to_thread(self._check, tick)
            except Exception:  # a check must never break the run
                log.exception("sandbox watchdog of pid %d", self.pid)
                continue
            if found is not None:
                self.breach = found
                if self.group is not None:
                    await asyncio.to_thread(self.group.kill)
                self.stop()
                return

    async def close(self) -> str | None:
        """Stop watching; the limit that was reached (also one reached at the very end, such as
        an OOM kill of the agent itself), or None."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.breach is None and self.group is not None:
            self.breach = await asyncio.to_thread(self.group.breach)
        return self.breach
