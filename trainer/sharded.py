"""Stores of sharded checkpoints: :class:`ShardedStore` (full) and :class:`ShardedWeightsStore`.

Owns which versions of a directory of sharded checkpoints are kept: each store names, lists,
prunes and discards versions as :class:`trainer.checkpoints.CheckpointStore` does for its
one-file checkpoints (both are ``trainer.versions.VersionStore``), saves and loads through the
format (``trainer.sharded_format``: one ``v{version:06d}/`` directory per version, written by
every rank, complete or absent) and removes what an interrupted write left. It does not own the
format, what the trainer state means (the trainer) nor the process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.checkpoints import CheckpointError
from trainer.sharded_format import (
    Manifest,
    checkpoint_bytes,
    clean_leftovers,
    current_rank,
    load_sharded,
    on_rank0,
    read_manifest,
    remove_version,
    save_sharded,
)
from trainer.versions import VersionStore


class ShardedStore(VersionStore):
    """Full sharded checkpoints ``v{version:06d}/`` in ``directory``; keeps the newest ``keep``.

    ``save`` and ``load`` are collective (every rank). The rest touches the file system only
    and belongs to one process: rank 0, or the appliance's main process when the workers are
    idle. Constructing a store on rank 0 (or without a process group) runs :meth:`clean`, so
    construct it before, not during, another process's save. May share ``directory`` with a
    :class:`~trainer.checkpoints.CheckpointStore` (``v*.pt`` files): neither sees the other's.
    """

    #: Whether a version holds the optimizer's state (a full checkpoint) or the weights alone.
    full = True

    def __init__(self, directory: Path, keep: int = 3) -> None:
        super().__init__(directory, keep)
        #: The dtype a weights store casts to, and the full checkpoint it takes the optimizer
        #: state from on load (a full store: neither).
        self.dtype: torch.dtype | None = None
        self.optimizer_from: Path | None = None
        if current_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.clean()

    def save(
        self,
        version: int,
        module: nn.Module,
        optimizer: Optimizer | None,
        *,
        step: int,
        trainer_state: dict[str, Any],
    ) -> Path:
        """Collective: write ``version`` (a full checkpoint; a weights store leaves the optimizer
        out and casts to ``dtype``), then (rank 0) prune all but the newest ``keep``; the version
        just written is never pruned."""
        if self.full and optimizer is None:
            raise ValueError("a full checkpoint needs the optimizer")
        path = save_sharded(
            self.path(version),
            module,
            optimizer if self.full else None,
            step=step,
            version=version,
            trainer_state=trainer_state,
            dtype=self.dtype,
        )
        on_rank0(lambda: self.prune(protect=version))
        return path

    def load(self, version: int, module: nn.Module, optimizer: Optimizer | None = None) -> Manifest:
        """Collective: load ``version`` (see :func:`load_sharded`; a weights store takes the
        optimizer state from ``optimizer_from``); ``CheckpointError`` if it is missing, corrupt
        or records another version."""
        manifest = load_sharded(self.path(version), module, optimizer, optimizer_from=self.optimizer_from)
        if manifest.version != version:
            raise CheckpointError(
                f"checkpoint {manifest.path} records version {manifest.version}, not {version}"
            )
        return manifest

    def manifest(self, version: int) -> Manifest:
        """A version's manifest (step, kind, trainer state) without loading any tensor."""
        return read_manifest(self.path(version))

    def prune(self, protect: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` versions, never ``protect``; returns the deleted."""
        stale = [v for v in self.versions()[: -self.keep] if v != protect]
        for version in stale:
            remove_version(self.path(version))
        return stale

    def clean(self) -> None:
        """Remove the leftovers of interrupted writes and deletions; put back a version that a
        crash left renamed aside while it was being written again."""
        clean_leftovers(self.directory)

    def _is_version(self, path: Path) -> bool:
        return path.is_dir()

    def _delete(self, path: Path) -> None:
        remove_version(path)

    def disk_bytes(self) -> int:
        """Disk use of all the versions (for ``status``)."""
        return sum(checkpoint_bytes(self.path(v)) for v in self.versions())


class ShardedWeightsStore(ShardedStore):
    """Per-version weights ``v{version:06d}/``: the model only, optionally cast to ``dtype``.

    ``save`` takes the same arguments as :meth:`ShardedStore.save` and leaves the optimizer
    out; ``load`` takes the optimizer's state from the full checkpoint ``optimizer_from``
    (None: the optimizer starts afresh), as :class:`~trainer.checkpoints.WeightsStore` does.
    """

    full = False

    def __init__(
        self,
        directory: Path,
        keep: int = 3,
        *,
        dtype: torch.dtype | None = None,
        optimizer_from: Path | None = None,
    ) -> None:
        super().__init__(directory, keep)
        self.dtype = dtype
        self.optimizer_from = optimizer_from
