"""The sharded checkpoint format: every rank of a multi-rank FSDP2 trainer writes its own shards.

Owns one version's directory: :func:`save_sharded` and :func:`load_sharded` (collective: every
rank calls them), :func:`read_manifest`, :func:`checkpoint_bytes`, and the write protocol's
hidden names (:func:`remove_version`, :func:`clean_leftovers`). It does not own which versions
are kept (``trainer.sharded``'s stores), what the trainer state means (the trainer), the process
group (``trainer.verl_runtime`` or the worker launcher), nor the one-file ``v*.pt`` format.

A checkpoint is a directory ``v{version:06d}/``: torch.distributed.checkpoint (DCP) files, one
per rank plus DCP's ``.metadata``, under the keys ``model`` (and ``optimizer`` in a full
checkpoint), and ``manifest.json`` (version, step, kind, dtype, the saving world size and the
trainer's small JSON state). Nothing is gathered: each rank writes the shards of the DTensors
it holds, and DCP reshards on load, so a run saved by N ranks resumes on M. Two kinds:

- "full": model + optimizer (moments and param groups) + trainer state; the model in its own
  dtype, so a resume is exact.
- "weights": the model only (no optimizer, which for Adam is two more copies of the model),
  optionally cast to ``dtype`` (e.g. bf16, half the bytes). Loading casts back to the module's
  dtype (bf16-rounded values) and takes the optimizer from an earlier full checkpoint
  (``optimizer_from``) or starts it afresh.

Invariant: a directory named ``v*`` is always complete. Ranks write into ``.v*.partial``; then
rank 0 writes the manifest, fsyncs it and the directory, renames it into place and fsyncs the
parent. A version written again is first renamed aside to ``.v*.replaced`` (restored by
:func:`clean_leftovers` if a crash comes between the two renames), and a removed one is renamed
to ``.v*.discarded`` before it is deleted. Leftovers of interrupted writes never look like
versions, and the stores remove them. Files are shared: all ranks see one directory (one
machine, or a shared file system).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer

from trainer.checkpoints import CheckpointError
from trainer.versions import fsync_path

Kind = Literal["weights", "full"]

MANIFEST = "manifest.json"
FORMAT = "lightning-appliance/sharded-checkpoint"
FORMAT_VERSION = 1

_NAME = re.compile(r"^v(\d{6,})$")
# Hidden names that are never versions; none ends in ".tmp", which CheckpointStore unlinks.
_PARTIAL = ".partial"  # a write in progress
_REPLACED = ".replaced"  # a complete older copy of a version being written again
_DISCARDED = ".discarded"  # a version being deleted
# Sharded (local) state dicts: DTensors as they are, on their device, no gather.
_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)
#: The same, without the frozen parameters (LoRA's base model: they are ``model_dir``'s own).
_TRAINABLE = StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=True)
_TRAINABLE_LOAD = StateDictOptions(
    full_state_dict=False, cpu_offload=False, ignore_frozen_params=True, strict=False
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` records about a sharded checkpoint."""

    #: The checkpoint directory it was read from.
    path: Path
    version: int
    step: int
    kind: Kind
    #: The dtype floating-point weights were stored in ("bfloat16", ...); None: the module's own.
    dtype: str | None
    #: How many ranks wrote it (any number may load it).
    world_size: int
    #: The trainer's small state (rank 0's), as JSON gave it back.
    trainer_state: dict[str, Any]
    #: Only the trainable parameters were stored: the frozen ones (LoRA's base weights) are the
    #: model directory's, which the loading trainer was built from.
    trainable_only: bool = False


# --- process group helpers ------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def current_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result; a failure raises on every
    rank (``CheckpointError`` on the others), so no rank waits for one that gave up. Also a
    barrier: no rank returns before rank 0 has finished ``fn``."""
    if not _distributed():
        return fn()
    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as exc:
            error = exc
            box[0] = (False, str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    ok, value = box[0]
    if not ok:
        raise CheckpointError(f"on rank 0: {value}")
    result: T = value
    return result


# --- files ----------------------------------------------------------------------------------------


def _aside(directory: Path, suffix: str) -> Path:
    """The hidden sibling ``.<name><suffix>`` of a version directory."""
    return directory.with_name(f".{directory.name}{suffix}")


def remove_version(directory: Path) -> None:
    """Delete a version directory so that a crash midway never leaves a partial ``v*``: rename
    it aside (atomic), fsync the parent, then delete the renamed copy."""
    trash = _aside(directory, _DISCARDED)
    shutil.rmtree(trash, ignore_errors=True)
    directory.replace(trash)
    fsync_path(directory.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(directory: Path) -> None:
    """Remove the leftovers of interrupted writes and deletions in a directory of versions; put
    back a version that a crash left renamed aside while it was being written again."""
    if not directory.is_dir():
        return
    for leftover in directory.glob(f".v*{_REPLACED}"):
        original = directory / leftover.name[1 : -len(_REPLACED)]
        if _NAME.match(original.name) and not original.exists():
            leftover.replace(original)  # complete: it was renamed aside whole
        else:
            shutil.rmtree(leftover, ignore_errors=True)
    for suffix in (_PARTIAL, _DISCARDED):
        for leftover in directory.glob(f".v*{suffix}"):
            shutil.rmtree(leftover, ignore_errors=True)
    fsync_path(directory)


def checkpoint_bytes(path: Path) -> int:
    """Bytes on disk of a checkpoint: the files under a directory, or one file (a ``v*.pt``);
    0 when it does not exist."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                total += Path(root, name).lstat().st_size
    return total


def read_manifest(directory: Path) -> Manifest:
    """The manifest of a complete sharded checkpoint; ``CheckpointError`` if it is missing,
    unreadable or not one of ours."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"sharded checkpoint {directory} does not exist (no {MANIFEST})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"sharded checkpoint {directory}: {MANIFEST} is unreadable: {exc}") from exc
    try:
        if raw["format"] != FORMAT or raw["format_version"] != FORMAT_VERSION:
            raise ValueError(f"format {raw['format']!r} v{raw['format_version']}")
        manifest = Manifest(
            path=directory,
            version=int(raw["version"]),
            step=int(raw["step"]),
            kind=raw["kind"],
            dtype=raw["dtype"],
            world_size=int(raw["world_size"]),
            trainer_state=raw["trainer_state"],
            trainable_only=bool(raw.get("trainable_only", False)),
        )
        if manifest.kind not in ("weights", "full") or not isinstance(manifest.dtype, str | None):
            raise ValueError(f"kind {manifest.kind!r}, dtype {manifest.dtype!r}")
        if not isinstance(manifest.trainer_state, dict):
            raise TypeError(f"trainer_state is a {type(manifest.trainer_state).__name__}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"sharded checkpoint {directory} is not one of ours: {exc!r}") from exc
    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"sharded checkpoint {directory} lacks DCP's .metadata")
    return manifest


# --- save and load (collective) -------------------------------------------------------------------


def save_sharded(
    directory: Path,
    module: nn.Module,
    optimizer: Optimizer | None,
    *,
    step: int,
    version: int,
    trainer_state: dict[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a sharded checkpoint at ``directory``; every rank calls it (collective).

    With ``optimizer`` it is a "full" checkpoint (``dtype`` must then be None: the master
    weights stay exact); without, a "weights" one, its floating-point tensors cast to ``dtype``
    when given. ``trainer_state`` must be JSON-serializable and the same on every rank (rank
    0's is stored). An existing ``directory`` is replaced. Returns ``directory`` once it is
    complete and durable, on every rank.
    """
    directory = Path(directory)
    # A module with frozen parameters (LoRA) stores only what training changes: its adapters.
    trainable_only = any(not param.requires_grad for param in module.parameters())
    if dtype is not None and (optimizer is not None or not dtype.is_floating_point):
        raise ValueError(f"dtype {dtype}: only a weights checkpoint (no optimizer) is cast, to a float dtype")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": version,
        "step": step,
        "kind": "full" if optimizer is not None else "weights",
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "world_size": dist.get_world_size() if _distributed() else 1,
        "trainer_state": trainer_state,
        "trainable_only": trainable_only,
    }
    text = json.dumps(manifest, indent=2, sort_keys=True)  # TypeError on every rank alike
    partial = _aside(directory, _PARTIAL)

    def prepare() -> None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()

    def publish() -> None:
        (partial / MANIFEST).write_text(text, encoding="utf-8")
        fsync_path(partial / MANIFEST)
        fsync_path(partial)  # the entries of every rank's files (DCP fsyncs their contents)
        replaced = _aside(directory, _REPLACED)
        if directory.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            directory.replace(replaced)
        partial.replace(directory)
        fsync_path(directory.parent)
        shutil.rmtree(replaced, ignore_errors=True)

    on_rank0(prepare)
    model_state = get_model_state_dict(module, options=_TRAINABLE if trainable_only else _SHARDED)
    if dtype is not None:
        # DTensor.to keeps the placements: each rank casts only its own shard.
        model_state = {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in model_state.items()
        }
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_SHARDED)
    try:
        dcp_save(state, storage_writer=FileSystemWriter(partial, sync_files=True))
    except CheckpointException as exc:  # a BaseException: raised on every rank by DCP
        raise CheckpointError(f"writing sharded checkpoint {directory} failed: {exc}") from exc
    on_rank0(publish)
    return directory


def _load(directory: Path, state: dict[str, Any]) -> None:
    try:
        dcp_load(state, storage_reader=FileSystemReader(directory))
    except CheckpointException as exc:
        raise CheckpointError(f"loading {list(state)} from {directory} failed: {exc}") from exc


def load_sharded(
    directory: Path,
    module: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    optimizer_from: Path | None = None,
) -> Manifest:
    """Load a sharded checkpoint into ``module`` (and ``optimizer``); every rank calls it.

    Any world size may load what any other wrote (DCP reshards). The model comes from
    ``directory``, cast to the module's dtypes. The optimizer, when given, comes from
    ``directory`` if it is a full checkpoint, else from the full checkpoint ``optimizer_from``
    (its moments under these weights), else its state is cleared (a fresh start; the param
    groups, e.g. the learning rate, stay as they are). Raises ``CheckpointError`` on every
    rank if a checkpoint is missing, not ours, or does not fit the module.
    """
    directory = Path(directory)
    manifest = on_rank0(lambda: read_manifest(directory))
    if manifest.trainable_only:  # the frozen parameters stay as the module was built
        model_state = get_model_state_dict(module, options=_TRAINABLE)
        _load(directory, {"model": model_state})
        set_model_state_dict(module, model_state, options=_TRAINABLE_LOAD)
    else:
        model_state = get_model_state_dict(module, options=_SHARDED)
        _load(directory, {"model": model_state})
        set_model_state_dict(module, model_state, options=_SHARDED)
    if optimizer is None:
        return manifest
    source = directory
    if manifest.kind != "full":
        if optimizer_from is None:
            optimizer.state.clear()
            return manifest
        source = Path(optimizer_from)
        base = on_rank0(lambda: read_manifest(source))
        if base.kind != "full":
            raise CheckpointError(f"optimizer_from {source} is a {base.kind} checkpoint, not a full one")
    # An optimizer without state gets its moments initialized here (a zero-lr step) for DCP to
    # load into, but only if no parameter has a gradient (else it would load none, silently).
    if not optimizer.state:
        optimizer.zero_grad(set_to_none=True)
    optim_state = get_optimizer_state_dict(module, optimizer, options=_SHARDED)
    _load(source, {"optimizer": optim_state})
    set_optimizer_state_dict(module, optimizer, optim_state, options=_SHARDED)
    return manifest
