"""Rollout directories: a fresh place on disk for each rollout, and its removal.

Owns the layout of one rollout's directory and its lifetime. It knows nothing about what runs
there. Layout (``<root>/<rollout id>-<random>/``)::

    work/           the agent's working directory: a copy of the task's repo snapshot (a
                    directory, or a .tar/.tar.gz/.zip archive unpacked), else empty
    home/  tmp/     HOME and TMPDIR of every process of the rollout; ``home`` starts with
                    copies of the files and directories the config names (``home_files``: a
                    harness's own config, which a fresh HOME would otherwise hide)
    task.json       {"id": ..., "data": {...}}: the whole task, for agents that want it
    reward          an agent may write its reward here (a float), see ``LA_REWARD_FILE``
    agent.stdout    agent.stderr    verifier.stdout    verifier.stderr

Creating one is blocking file I/O (a repo copy), so it runs in a thread. A failure to create
it is an ``InfraError``: nothing has started yet, so the rollout can be retried as it is.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harness_adapters.base import InfraError, Task

KeepPolicy = Literal["never", "failed", "always"]
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "lightning-appliance" / "rollouts"


class _Part:
    """A path of the layout: read on a ``RolloutDir``, its ``name`` under the directory's root."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, rdir: RolloutDir, owner: type | None = None) -> Path:
        return rdir.root / self.name


@dataclass(frozen=True, slots=True)
class RolloutDir:
    root: Path

    # The layout (see the module's docstring), each part by its name under ``root``.
    work = _Part("work")
    home = _Part("home")
    tmp = _Part("tmp")
    task_json = _Part("task.json")
    reward_file = _Part("reward")

    def log(self, name: str, stream: Literal["stdout", "stderr"]) -> Path:
        return self.root / f"{name}.{stream}"


def _safe_name(rollout_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", rollout_id)[:80] or "rollout"


def copy_snapshot(source: Path, dest: Path) -> None:
    """Copy a directory, or unpack an archive, into ``dest`` (which must not exist yet)."""
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True)
    elif source.is_file() and source.name.endswith(ARCHIVE_SUFFIXES):
        dest.mkdir()
        shutil.unpack_archive(source, dest, filter="data")
    else:
        raise FileNotFoundError(f"repo snapshot {str(source)!r} is neither a directory nor an archive")


def _home_target(home: Path, relative: str) -> Path:
    """``relative`` inside ``home``; a path that would leave it is refused."""
    target = (home / relative).resolve()
    if Path(relative).is_absolute() or not target.is_relative_to(home.resolve()):
        raise ValueError(f"home_files target {relative!r} must be a path inside HOME")
    return target


def _create(
    root: Path, task: Task, rollout_id: str, source: Path | None, home_files: Mapping[str, Path]
) -> RolloutDir:
    root.mkdir(parents=True, exist_ok=True)
    rdir = RolloutDir(Path(tempfile.mkdtemp(prefix=_safe_name(rollout_id) + "-", dir=root)))
    try:
        if source is not None:
            copy_snapshot(source, rdir.work)
        else:
            rdir.work.mkdir()
        rdir.home.mkdir()
        for relative, origin in home_files.items():
            target = _home_target(rdir.home, relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, target, symlinks=True)
            else:
                shutil.copy2(origin, target)
        rdir.tmp.mkdir()
        rdir.task_json.write_text(json.dumps({"id": task.id, "data": task.data}, default=str))
    except BaseException:
        shutil.rmtree(rdir.root, ignore_errors=True)
        raise
    return rdir


async def create_rollout_dir(
    root: Path,
    task: Task,
    rollout_id: str,
    *,
    source: Path | None = None,
    home_files: Mapping[str, Path] | None = None,
) -> RolloutDir:
    """A new rollout directory (with the task's snapshot copied in, and ``home_files``: HOME
    path -> file or directory copied there); ``InfraError`` on failure."""
    try:
        return await asyncio.to_thread(_create, root, task, rollout_id, source, home_files or {})
    except (OSError, ValueError) as exc:
        raise InfraError(f"could not create the rollout directory under {str(root)!r}: {exc}") from exc


async def release_rollout_dir(rdir: RolloutDir, *, failed: bool, keep: KeepPolicy) -> None:
    """Remove the directory unless the policy keeps it (failed rollouts, by default)."""
    if keep == "always" or (keep == "failed" and failed):
        return
    await asyncio.to_thread(shutil.rmtree, rdir.root, True)
