"""Checkpoints: trainer state (model + optimizer + step) on disk, one file per policy version.

Owns the checkpoint directory: the file format (``torch.save`` of a dict ``{version, step,
model, optimizer}``, plus an optional ``trainer`` dict of backend state such as which backend
wrote it), the names (``v{version:06d}.pt``; listed as ``trainer.versions.VersionStore`` lists
any store's), atomic writes and pruning; and the export of a final Hugging Face model directory
(:func:`export_hf_model`). It does not own what is in the state dicts (the trainers) nor the
event that announces a version (``PolicyVersionPublished``, whose ``checkpoint`` field is
:meth:`CheckpointStore.relative_path`).

Three kinds of files. Two in the trainers' own format, fp32, so a trainer's ``save``/``load``
serve both: full checkpoints (:class:`CheckpointStore`, ``checkpoints/v*.pt``) and per-version
weights (:class:`WeightsStore`, ``checkpoints/weights/v*.pt``), which leave out the optimizer's
per-parameter state (for Adam, two more copies of the model). Loading from a ``WeightsStore``
puts a full checkpoint's optimizer state under the version's weights. These are what training
resumes from. The third, :class:`PublishedWeights` (``checkpoints/published/v*.safetensors``),
holds each published version's weights in bf16 safetensors (a quarter of a full checkpoint's
size), for serving, loading into an engine or another tool, and backups; a store given one
writes it beside each version it saves.

What is kept is the training service's decision (``appliance.training.service``): a store never prunes
a version in :attr:`CheckpointStore.needed` (the ones a restart of the run loads), so a version
written by a step whose events are not durable yet never costs the one the log names.

Invariant: a file named ``v*.pt`` is always complete. It is written to a temporary file in the
same directory, flushed and fsynced, renamed over its final name (``os.replace`` is atomic on
POSIX) and the directory is fsynced so the rename itself survives a power cut. A crash leaves at
worst a ``.tmp`` file, which the next :class:`CheckpointStore` removes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from contracts.errors import ApplianceError
from trainer.versions import VersionStore, fsync_path

if TYPE_CHECKING:
    from trainer.buckets import WeightBucket

_TMP_SUFFIX = ".tmp"
_KEYS = ("version", "step", "model", "optimizer")
#: Size of the safetensors shards of an export written from buckets (``buckets_to_hf``).
EXPORT_BUCKET_BYTES = 2 << 30


class CheckpointError(ApplianceError):
    """A checkpoint is missing, unreadable or not one of ours."""

    code = "checkpoint_error"


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` the file it is given, a temporary sibling of ``path``, then fsync it and rename
    it over ``path`` (see the module docstring); nothing is left behind if it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{_TMP_SUFFIX}")
    try:
        write(tmp)
        fsync_path(tmp)
        tmp.replace(path)  # os.replace: atomic on POSIX
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def _open_directory(directory: Path) -> None:
    """Create a store's directory; remove the leftovers of a write interrupted by a crash (never
    complete, never referenced)."""
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(f".v*{_TMP_SUFFIX}"):
        leftover.unlink(missing_ok=True)


def write_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` with ``torch.save`` to ``path`` atomically (see the module docstring)."""

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            torch.save(payload, f)

    _write_atomically(path, write)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_checkpoint`; raise ``CheckpointError`` if bad."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        # weights_only: a checkpoint is data (tensors, numbers, dicts), never code to unpickle.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: {exc}") from exc
    if not isinstance(payload, dict) or any(key not in payload for key in _KEYS):
        raise CheckpointError(f"checkpoint {path} lacks the keys {list(_KEYS)}; not a trainer checkpoint")
    return payload


class CheckpointStore(VersionStore):
    """A directory of checkpoints ``v{version:06d}.pt``; keeps the newest ``keep`` versions and
    every version in :attr:`needed`. With ``published``, each version saved is also written
    there, in bf16 safetensors."""

    suffix = ".pt"

    def __init__(self, directory: Path, keep: int = 3, *, published: PublishedWeights | None = None) -> None:
        super().__init__(directory, keep)
        self.published = published
        #: Versions never pruned (those a restart loads; set by the training service).
        self.needed: set[int] = set()
        _open_directory(self.directory)

    def save(
        self,
        version: int,
        step: int,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        trainer_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write a version atomically, then prune all but the newest ``keep`` versions.

        ``trainer_state`` (optional) is stored under ``"trainer"``. The version just written is
        never pruned, even if older versions sort after it.
        """
        path = self.path(version)
        payload: dict[str, Any] = {
            "version": version,
            "step": step,
            "model": model_state,
            "optimizer": self._kept_optimizer_state(optimizer_state),
        }
        if trainer_state is not None:
            payload["trainer"] = trainer_state
        write_checkpoint(path, payload)
        if self.published is not None:
            self.published.save(version, model_state)
        self._prune(protect=version)
        return path

    def _kept_optimizer_state(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """What of the optimizer's state dict a version stores: all of it."""
        return optimizer_state

    def load(self, version: int) -> dict[str, Any]:
        """The ``{version, step, model, optimizer}`` dict of a version; ``CheckpointError`` if
        it is missing, corrupt or records another version."""
        path = self.path(version)
        payload = read_checkpoint(path)
        if payload["version"] != version:
            raise CheckpointError(f"checkpoint {path} records version {payload['version']}, not {version}")
        return payload

    def prune(self, keep: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` (None: :attr:`keep`; 0: none) versions and those
        in :attr:`needed`; returns the deleted."""
        return self._prune(protect=None, keep=keep)

    def _prune(self, protect: int | None, keep: int | None = None) -> list[int]:
        versions = self.versions()
        older = versions[: max(len(versions) - (self.keep if keep is None else keep), 0)]
        stale = [v for v in older if v != protect and v not in self.needed]
        for version in stale:
            self.path(version).unlink(missing_ok=True)
        if stale:
            fsync_path(self.directory)
        return stale


class WeightsStore(CheckpointStore):
    """Per-version policy weights: what a trainer's ``save`` writes, minus the optimizer's
    per-parameter state (its ``param_groups`` and the trainer state stay; both are small).

    ``load`` returns the version's weights with the optimizer state of the full checkpoint
    ``optimizer_from`` (the run's last one; None: no moments, the optimizer starts afresh), so
    ``Trainer.load(weights_store, version)`` restores a version saved between full checkpoints.
    """

    def __init__(
        self,
        directory: Path,
        keep: int = 3,
        optimizer_from: Path | None = None,
        *,
        published: PublishedWeights | None = None,
    ) -> None:
        super().__init__(directory, keep, published=published)
        self.optimizer_from = optimizer_from

    def _kept_optimizer_state(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's state dict without its per-parameter ``state`` (the moments)."""
        slim = {key: value for key, value in optimizer_state.items() if key != "state"}
        slim["state"] = {}
        return slim

    def load(self, version: int) -> dict[str, Any]:
        """The version's weights, step and trainer state with ``optimizer_from``'s optimizer."""
        payload = super().load(version)
        if self.optimizer_from is not None:
            payload["optimizer"] = read_checkpoint(self.optimizer_from)["optimizer"]
        return payload


class PublishedWeights(VersionStore):
    """Each published version's weights as one file ``v{version:06d}.safetensors``, cast to
    ``dtype`` (bf16: half of fp32), under the trainer's parameter names (Hugging Face's, for
    both backends' full state dicts); a tied weight is stored once, under its first name.

    Written atomically like a checkpoint. Keeps the newest ``keep`` versions at or below the
    last published one (:meth:`prune`); newer ones belong to a step whose events are not durable
    yet, and a restart removes them (:meth:`discard_after`). Training never resumes from these
    files: they lose fp32's low bits.
    """

    suffix = ".safetensors"

    def __init__(self, directory: Path, keep: int = 2, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(directory, keep)
        self.dtype = dtype
        _open_directory(self.directory)

    def save(self, version: int, model_state: Mapping[str, Any]) -> Path:
        """Write ``version``'s weights unless they are on disk already (a version's weights never
        change: a full checkpoint of a version published as weights writes nothing new)."""
        from safetensors.torch import save_file

        path = self.path(version)
        if path.is_file():
            return path
        tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        for name, value in model_state.items():
            if not isinstance(value, torch.Tensor):
                continue
            key = (value.untyped_storage().data_ptr(), int(value.storage_offset()), tuple(value.shape))
            if key in seen:  # tied to a weight already stored (the LM head to the embeddings)
                continue
            seen.add(key)
            cast = value.detach().to(device="cpu", dtype=self.dtype if value.is_floating_point() else None)
            tensors[name] = cast.contiguous()
        metadata = {"format": "pt", "policy_version": str(version)}
        _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        return path

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s weights; ``CheckpointError`` if they are missing or unreadable."""
        from safetensors.torch import load_file

        path = self.path(version)
        if not path.is_file():
            raise CheckpointError(f"published weights {path} do not exist")
        try:
            return load_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"published weights {path} are corrupt or unreadable: {exc}") from exc

    def prune(self, published: int) -> list[int]:
        """Delete all but the newest ``keep`` versions at or below ``published``; returns them."""
        kept = [v for v in self.versions() if v <= published]
        stale = kept[: max(len(kept) - self.keep, 0)]
        for version in stale:
            self.path(version).unlink(missing_ok=True)
        if stale:
            fsync_path(self.directory)
        return stale


#: Files of a model directory that hold weights: never copied by :func:`export_hf_model` (the
#: exported weights replace them).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def export_hf_model(save_pretrained: Callable[[Path], None], model_dir: Path, directory: Path) -> Path:
    """Write a Hugging Face model directory at ``directory``: the non-weight files of
    ``model_dir`` (tokenizer, chat template, ...) and whatever ``save_pretrained`` writes
    (config and weights, overwriting the copies). Built in a temporary sibling and renamed into
    place, so ``directory`` is either the old export or the complete new one."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}{_TMP_SUFFIX}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for item in Path(model_dir).iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and ".index." not in item.name:
                shutil.copy2(item, tmp / item.name)
        save_pretrained(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.replace(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(directory.parent)
    return directory


def buckets_to_hf(buckets: Iterable[WeightBucket]) -> Callable[[Path], None]:
    """A ``save_pretrained`` for :func:`export_hf_model` from a weight push's buckets
    (``Trainer.weight_buckets``): each bucket becomes one safetensors shard as it comes
    (``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``, as Hugging Face
    writes a sharded model; ``model.safetensors`` when one bucket holds it all), so the export
    holds one bucket in memory, never the whole model. A tied LM head left out of the buckets is
    tied again by the model's config when it is loaded."""

    def save(target: Path) -> None:
        from safetensors.torch import save_file

        from trainer.buckets import bucket_tensors

        weight_map: dict[str, str] = {}
        files: list[Path] = []
        total = 0
        for bucket in buckets:
            path = target / f"model-{len(files) + 1:05d}.safetensors"
            tensors = dict(bucket_tensors(bucket))
            save_file(tensors, str(path), metadata={"format": "pt"})
            files.append(path)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, path.name))
        if len(files) == 1:
            files[0].replace(target / "model.safetensors")
            return
        names = {}
        for k, path in enumerate(files, start=1):
            names[path.name] = f"model-{k:05d}-of-{len(files):05d}.safetensors"
            path.replace(target / names[path.name])
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: names[file] for name, file in sorted(weight_map.items())},
        }
        (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    return save


def full_state_to_hf(model_dir: Path, state: Mapping[str, Any]) -> Callable[[Path], None]:
    """A ``save_pretrained`` for :func:`export_hf_model` from a full HF-named state dict: loads
    the architecture from ``model_dir`` (float32, CPU), copies ``state`` in, saves."""

    def save(target: Path) -> None:
        from transformers import AutoModelForCausalLM  # heavy: only when exporting

        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.load_state_dict(dict(state), strict=True)
        model.save_pretrained(target)

    return save
