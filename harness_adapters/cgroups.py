"""Control groups for sandboxed rollouts: one per rollout, its limits, its breaches, its end.

Owns finding where this process may make control groups and using them for one rollout: the
rollout's memory (swap included), its number of processes and its CPU share are bounded for the
whole rollout, not per process, and what the kernel did about a limit (an OOM kill, a refused
fork) is read back as the limit's name. It knows nothing about sandboxes or agents: the launcher
joins the group before it starts anything, so every process of the rollout is in it.

Where: cgroup v2 where this process's own group (``/proc/self/cgroup``'s ``0::`` line, under
the ``cgroup2`` mount) lets it make a child with the ``memory`` and ``pids`` controllers (a
delegated subtree, e.g. ``systemd-run --user -p Delegate=yes``); else cgroup v1, where the
``memory``, ``pids`` and ``cpu`` hierarchies are writable (root, or a delegated v1 tree). Else
none: the caller falls back to per-process rlimits and its own watchdog. The search runs once
per process (``find``).

Layout: ``<own group>/lightning-appliance-<pid>/<rollout>`` in each hierarchy used. A group is
killed (``cgroup.kill`` on v2, else SIGKILL to each member until none is left) and removed by
``close``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

#: The v1 hierarchies used, by controller name.
V1_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class GroupLimits:
    memory_bytes: int | None = None
    processes: int | None = None
    cpus: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.memory_bytes, self.processes, self.cpus))


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
    except OSError:
        return False
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _counter(text: str, key: str) -> int:
    """``key N`` from a flat-keyed cgroup file (``memory.events``, ``pids.events``)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, file system type, super options) of every cgroup mount."""
    found = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        parts, tail = left.split(), right.split()
        if len(parts) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((parts[4], tail[0], tail[2]))
    return found


def _own_paths() -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's group path, from ``/proc/self/cgroup``."""
    paths: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


@dataclass(frozen=True, slots=True)
class Group:
    """One rollout's group: a directory per hierarchy (one on v2)."""

    version: int
    #: Controller -> the group's directory in its hierarchy (v2: ``""`` -> the one directory).
    by_controller: dict[str, Path]
    limits: GroupLimits

    @property
    def dirs(self) -> list[Path]:
        return list(self.by_controller.values())

    def procs_files(self) -> list[str]:
        """The files the launcher writes its pid to, to join the group (each hierarchy)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def _dir(self, controller: str) -> Path | None:
        return self.by_controller.get("" if self.version == 2 else controller)

    def breach(self) -> str | None:
        """Which limit the kernel enforced on the group, in words; None if none was reached."""
        pids, memory = self._dir("pids"), self._dir("memory")
        limited = self.limits.processes is not None and pids is not None
        if limited and pids is not None and _counter(_read(pids / "pids.events"), "max") > 0:
            return f"process limit reached ({self.limits.processes} processes)"
        if self.limits.memory_bytes is not None and memory is not None:
            events = memory / ("memory.events" if self.version == 2 else "memory.oom_control")
            if _counter(_read(events), "oom_kill") > 0:
                return f"memory limit reached ({self.limits.memory_bytes // 2**20} MiB)"
        return None

    def members(self) -> set[int]:
        pids: set[int] = set()
        for directory in self.dirs:
            pids.update(int(p) for p in _read(directory / "cgroup.procs").split() if p.isdigit())
        return pids

    def kill(self) -> None:
        """SIGKILL every member, until none is left (2 s at most)."""
        if self.version == 2 and _write(self.dirs[0] / "cgroup.kill", "1"):
            return
        deadline = time.monotonic() + 2.0
        while (members := self.members()) and time.monotonic() < deadline:
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def close(self) -> None:
        """Kill what is left and remove the group's directories."""
        self.kill()
        deadline = time.monotonic() + 2.0
        for directory in self.dirs:
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


@dataclass(frozen=True, slots=True)
class Cgroups:
    """Where this process makes its rollouts' groups: its own parent directories."""

    version: int
    #: Controller -> parent directory (v2: ``""`` -> the one parent; v1: one per writable
    #: controller of ``V1_CONTROLLERS``).
    parents: dict[str, Path]

    def create(self, name: str, limits: GroupLimits) -> Group:
        """A new group for one rollout with ``limits``; ``OSError`` if it cannot be made."""
        safe = _SAFE.sub("_", name)[:100] or "rollout"
        made: dict[str, Path] = {}
        # Only the hierarchies a limit needs: on v1 each one the launcher joins costs it a
        # migration (milliseconds each).
        needed = {
            "": True,
            "memory": limits.memory_bytes is not None,
            "pids": limits.processes is not None,
            "cpu": limits.cpus is not None,
        }
        try:
            for controller, parent in self.parents.items():
                if not needed[controller]:
                    continue
                parent.mkdir(exist_ok=True)
                directory = parent / safe
                directory.mkdir()
                made[controller] = directory
            group = Group(self.version, made, limits)
            _apply(group, limits)
        except BaseException:
            for directory in made.values():
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
        return group


def _apply(group: Group, limits: GroupLimits) -> None:
    """Write ``limits`` into the group's control files; ``OSError`` if one is refused."""

    def put(controller: str, name: str, value: str) -> None:
        directory = group._dir(controller)
        if directory is None:
            raise OSError(f"no {controller} controller for the sandbox's control group")
        (directory / name).write_text(value)

    if limits.memory_bytes is not None:
        if group.version == 2:
            put("memory", "memory.max", str(limits.memory_bytes))
            with contextlib.suppress(OSError):
                put("memory", "memory.swap.max", "0")
        else:
            put("memory", "memory.limit_in_bytes", str(limits.memory_bytes))
            with contextlib.suppress(OSError):  # only where swap accounting is on
                put("memory", "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    if limits.processes is not None:
        put("pids", "pids.max", str(limits.processes))
    if limits.cpus is not None:
        quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
        if group.version == 2:
            put("cpu", "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            put("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US))
            put("cpu", "cpu.cfs_quota_us", str(quota))


def _try_v2(mount: str, own: str, leaf: str) -> Cgroups | None:
    base = Path(mount) / own.lstrip("/")
    parent = base / leaf
    try:
        parent.mkdir(exist_ok=True)
    except OSError:
        return None
    wanted = {"memory", "pids"}
    enabled = set(_read(parent / "cgroup.controllers").split())
    if not wanted <= enabled or not _write(parent / "cgroup.subtree_control", "+memory +pids"):
        with contextlib.suppress(OSError):
            parent.rmdir()
        return None
    if "cpu" in enabled:
        _write(parent / "cgroup.subtree_control", "+cpu")
    return Cgroups(2, {"": parent})


def _try_v1(mounts: list[tuple[str, str, str]], own: dict[str, str], leaf: str) -> Cgroups | None:
    parents: dict[str, Path] = {}
    for controller in V1_CONTROLLERS:
        mount = next(
            (m for m, kind, opts in mounts if kind == "cgroup" and controller in opts.split(",")), None
        )
        if mount is None or controller not in own:
            continue
        parent = Path(mount) / own[controller].lstrip("/") / leaf
        try:
            parent.mkdir(exist_ok=True)
        except OSError:
            continue
        parents[controller] = parent
    if not {"memory", "pids"} <= parents.keys():
        for parent in parents.values():
            with contextlib.suppress(OSError):
                parent.rmdir()
        return None
    return Cgroups(1, parents)


_FOUND: list[Cgroups | None] = []


def find() -> Cgroups | None:
    """Where this process can make its rollouts' groups (looked for once); None: nowhere."""
    if not _FOUND:
        found = _search()
        _FOUND.append(found)
        if found is not None:
            atexit.register(_remove_parents, found)
            with contextlib.suppress(OSError):
                _remove_stale(found)
    return _FOUND[0]


def _remove_parents(found: Cgroups) -> None:
    for parent in found.parents.values():
        with contextlib.suppress(OSError):
            parent.rmdir()


def _remove_stale(found: Cgroups) -> None:
    """The empty groups an appliance that did not exit cleanly left beside ours (a process gone,
    its groups empty: the kernel refuses to remove one that still holds a process)."""
    for parent in found.parents.values():
        for sibling in parent.parent.glob("lightning-appliance-*"):
            pid = sibling.name.rsplit("-", 1)[-1]
            if sibling == parent or not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            for group in [p for p in sibling.iterdir() if p.is_dir()]:
                with contextlib.suppress(OSError):
                    group.rmdir()
            with contextlib.suppress(OSError):
                sibling.rmdir()


def _search() -> Cgroups | None:
    if os.environ.get("APPLIANCE_SANDBOX_CGROUPS", "") == "off":
        return None
    leaf = f"lightning-appliance-{os.getpid()}"
    mounts, own = _mounts(), _own_paths()
    v2 = next((m for m, kind, _ in mounts if kind == "cgroup2"), None)
    if v2 is not None and "" in own:
        found = _try_v2(v2, own[""], leaf)
        if found is not None:
            return found
    return _try_v1(mounts, own, leaf)
