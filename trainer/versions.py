"""A directory of policy versions, whatever one version's format: naming, listing, discarding.

Owns :class:`VersionStore`, the base of every checkpoint store (``trainer.checkpoints``: one
file per version; ``trainer.sharded``: one directory per version): a version's name
``v{version:06d}`` plus the format's suffix, the versions complete on disk, the newest one, and
deleting the versions newer than one; and :func:`fsync_path`, which makes a file's contents or a
rename or deletion in a directory durable. It does not own how a version is written, read or deleted, nor
which versions are kept (each store's ``prune``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar


def fsync_path(path: Path) -> None:
    """fsync a file (its contents) or a directory (its entries, as renamed or deleted), so that
    they survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VersionStore:
    """Versions ``v{version:06d}<suffix>`` in ``directory``; ``keep``: how many a store keeps.

    Stores of different formats may share one directory: each sees only its own names.
    """

    #: What follows ``v{version:06d}`` in a version's name ("" for a directory per version).
    suffix: ClassVar[str] = ""

    def __init__(self, directory: Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def path(self, version: int) -> Path:
        """Absolute path of a version (whether or not it exists)."""
        if version < 0:
            raise ValueError(f"a policy version is >= 0, got {version}")
        return self.directory / f"v{version:06d}{self.suffix}"

    def relative_path(self, version: int, start: Path | None = None) -> Path:
        """A version's path relative to ``start`` (default: the directory holding ``directory``,
        i.e. the run directory when checkpoints live in ``<run>/checkpoints``)."""
        base = start if start is not None else self.directory.parent
        return self.path(version).relative_to(base)

    def versions(self) -> list[int]:
        """Versions complete on disk, ascending."""
        if not self.directory.is_dir():
            return []
        name = re.compile(rf"^v(\d{{6,}}){re.escape(self.suffix)}$")
        found = (name.match(p.name) for p in self.directory.iterdir() if self._is_version(p))
        return sorted(int(m.group(1)) for m in found if m is not None)

    def latest(self) -> int | None:
        """The newest version on disk, or None when there is none."""
        versions = self.versions()
        return versions[-1] if versions else None

    def discard_after(self, version: int) -> list[int]:
        """Delete the versions newer than ``version`` (written by a step that crashed before its
        events became durable: never published, and stale once the step is retried)."""
        newer = [v for v in self.versions() if v > version]
        for stale in newer:
            self._delete(self.path(stale))
        if newer:
            fsync_path(self.directory)
        return newer

    def _is_version(self, path: Path) -> bool:
        """Whether an entry whose name matches is one of this format's versions."""
        return True

    def _delete(self, path: Path) -> None:
        path.unlink(missing_ok=True)
