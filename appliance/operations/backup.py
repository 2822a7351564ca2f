"""``lightning-appliance backup``: a consistent copy of a run, also while it runs.

Owns what a backup holds and how it is taken. A backup is a data directory an appliance can
resume from: the event log (``events.sqlite``, copied with SQLite's online backup API, which
reads one committed snapshot, WAL included, while the appliance keeps appending), the files
that log needs to resume (the weights its last ``PolicyVersionPublished`` names and the last
full checkpoint, whose optimizer state those weights load with) and the admin token. Not the
models cache (rebuilt on start), exports or rollout work directories.

A backup is as private as the run: its directories and files are made owner-only (0700,
0600), or what the ``umask`` given leaves (config ``data_umask``), whatever the source's modes.

Invariant: every file the backed-up log names is in the backup. The appliance writes a file
before the event naming it and prunes old files, so a file the snapshot needs may be pruned
between the snapshot and the copy: then the snapshot is taken again (the new one names newer
files).

It does not own the store (``store.eventstore``), the checkpoint layout (``trainer.checkpoints``:
paths in events are relative to the run directory) nor what resuming does (``appliance.app``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from contracts.errors import ApplianceError, StoreError
from store.eventstore import iter_events_sync, verify_log
from store.projections import RunState

__all__ = ["BackupReport", "backup"]

EVENTS = "events.sqlite"
ADMIN_TOKEN = "admin_token"
#: Snapshots taken at most when files keep vanishing under one (a very fast run pruning).
_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class BackupReport:
    """What :func:`backup` copied."""

    destination: Path
    #: Events in the backed-up log: it ends at this position.
    events: int
    #: The run's policy version and step at that position.
    policy_version: int
    step: int
    #: Files copied besides the log (relative to the run directory).
    files: tuple[str, ...]
    #: Bytes written, the log included.
    bytes: int

    def line(self) -> str:
        return (
            f"backed up {self.events} events (position {self.events}, policy v{self.policy_version},"
            f" step {self.step}) and {len(self.files)} files ({', '.join(self.files) or 'none'}),"
            f" {self.bytes} bytes, to {self.destination}"
        )


def backup(data_dir: Path, destination: Path, umask: int = 0o077) -> BackupReport:
    """Copy the run at ``data_dir`` into ``destination`` (absent, or an empty directory), its
    files and directories with the permissions ``umask`` leaves (default: owner-only)."""
    source = data_dir / EVENTS
    if not source.is_file():
        raise ApplianceError(f"no run at {data_dir} (no {EVENTS}); pass --data-dir DIR")
    _check_destination(destination)
    previous = os.umask(umask)
    try:
        return _backup(data_dir, destination, umask)
    finally:
        os.umask(previous)


def _backup(data_dir: Path, destination: Path, umask: int) -> BackupReport:
    source = data_dir / EVENTS
    missing: list[str] = []
    try:
        destination.mkdir(parents=True, exist_ok=True)
        for _ in range(_ATTEMPTS):
            _empty(destination)
            events, state = _snapshot(source, destination / EVENTS)
            needed = _needed_files(state)
            try:
                copied = [_copy(data_dir, destination, name) for name in needed]
            except FileNotFoundError:  # pruned since the snapshot: take a newer one
                missing = [name for name in needed if not (data_dir / name).exists()]
                continue
            token = data_dir / ADMIN_TOKEN
            if token.is_file():
                shutil.copy2(token, destination / ADMIN_TOKEN)
            _restrict(destination, umask)
            size = sum(p.stat().st_size for p in destination.rglob("*") if p.is_file())
            return BackupReport(destination, events, state.policy_version, state.step, tuple(copied), size)
    except OSError as exc:  # e.g. a full disk, or a destination that cannot be written
        where = f" ({exc.filename})" if exc.filename else ""
        raise ApplianceError(
            f"could not back up {data_dir} to {destination}: {exc.strerror or exc}{where}"
        ) from None
    raise ApplianceError(
        f"could not back up {data_dir}: the files {', '.join(missing)} the log needs kept vanishing"
        " (is something deleting checkpoints?)"
    )


def _restrict(directory: Path, umask: int) -> None:
    """Give ``directory`` and everything in it the modes ``umask`` leaves (``copy2`` copied the
    source's, which may be an older run's 0644)."""
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _check_destination(destination: Path) -> None:
    if destination.is_dir():
        if any(destination.iterdir()):
            raise ApplianceError(f"backup destination {destination} is not empty; pass a new directory")
    elif destination.exists():
        raise ApplianceError(f"backup destination {destination} is a file; pass a new directory")


def _empty(directory: Path) -> None:
    """Remove what an earlier attempt left in ``directory`` (which was empty before it)."""
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _snapshot(source: Path, target: Path) -> tuple[int, RunState]:
    """Copy one committed state of the log at ``source`` to ``target`` (self-contained: no WAL)
    and verify it; returns its event count and the run's state at its end."""
    try:
        with (
            contextlib.closing(sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)) as src,
            contextlib.closing(sqlite3.connect(target)) as dst,
        ):
            src.execute("PRAGMA busy_timeout = 5000")
            src.backup(dst)  # all pages in one step: one read transaction, one snapshot
            dst.execute("PRAGMA journal_mode = DELETE")  # one file; the appliance turns WAL on
    except sqlite3.Error as exc:
        raise StoreError(f"cannot back up event store {source}: {exc}") from exc
    events = verify_log(target).events
    return events, RunState.from_events(iter_events_sync(target))


def _needed_files(state: RunState) -> list[str]:
    """The files resuming at ``state`` loads (see ``TrainingService.restore``)."""
    needed = [state.checkpoint] if state.checkpoint else []
    last = state.last_checkpoint
    if last is not None and last.path not in needed:
        needed.append(last.path)
    return needed


def _copy(data_dir: Path, destination: Path, name: str) -> str:
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise ApplianceError(f"the log names the file {name!r} outside the run directory: not backed up")
    target = destination / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    source = data_dir / relative
    if source.is_dir():  # a sharded checkpoint (one file per rank and a manifest)
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)
    return name
