"""CheckpointStore: names, atomic writes, pruning, latest, clear errors on bad files; HF export."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.errors import ApplianceError
from trainer.checkpoints import CheckpointError, CheckpointStore, PublishedWeights, export_hf_model


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((2, 3), value)}


def save(store: CheckpointStore, version: int) -> Path:
    return store.save(version, step=version * 10, model_state=state(version), optimizer_state={"lr": 0.1})


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    path = save(store, 7)
    assert path == tmp_path / "run" / "checkpoints" / "v000007.pt"
    assert store.relative_path(7) == Path("checkpoints/v000007.pt")
    assert store.relative_path(7, start=tmp_path) == Path("run/checkpoints/v000007.pt")
    payload = store.load(7)
    assert payload["version"] == 7
    assert payload["step"] == 70
    assert torch.equal(payload["model"]["w"], torch.full((2, 3), 7.0))
    assert payload["optimizer"] == {"lr": 0.1}


def test_latest_and_pruning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    assert store.latest() is None
    for version in (1, 2, 3, 4):
        save(store, version)
    assert store.versions() == [3, 4]
    assert store.latest() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003.pt", "v000004.pt"]


def test_the_version_just_saved_is_never_pruned(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    save(store, 5)
    save(store, 2)
    assert store.versions() == [2, 5]


def test_write_is_fsynced_and_renamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save(CheckpointStore(tmp_path), 1)
    assert len(synced) >= 2  # the file, then the directory


def test_a_failed_write_leaves_no_file_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    save(store, 1)

    def broken_save(obj: object, f: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save(store, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["v000001.pt"]
    assert store.latest() == 1
    assert store.load(1)["step"] == 10


def test_crash_leftovers_are_ignored_and_removed(tmp_path: Path) -> None:
    leftover = tmp_path / ".v000003.pt.1234.tmp"
    leftover.write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    store = CheckpointStore(tmp_path)
    assert not leftover.exists()
    assert store.latest() is None


def test_missing_corrupt_and_foreign_files_raise_checkpoint_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        store.load(1)
    store.path(2).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        store.load(2)
    torch.save({"weights": 1}, store.path(3))
    with pytest.raises(CheckpointError, match="not a trainer checkpoint"):
        store.load(3)
    save(store, 4)
    store.path(4).rename(store.path(5))
    with pytest.raises(CheckpointError, match="records version 4, not 5"):
        store.load(5)
    assert issubclass(CheckpointError, ApplianceError)


def test_truncated_checkpoint_is_corrupt(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = save(store, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        store.load(1)


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(ValueError, match="version"):
        CheckpointStore(tmp_path).path(-1)


def test_trainer_state_is_stored_when_given(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, 4, {"w": torch.ones(1)}, {}, trainer_state={"backend": "verl", "lora_rank": 8})
    store.save(2, 5, {"w": torch.ones(1)}, {})
    assert store.load(1)["trainer"] == {"backend": "verl", "lora_rank": 8}
    assert "trainer" not in store.load(2)


def test_export_hf_model_copies_the_tokenizer_and_replaces_atomically(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "config.json").write_text('{"old": true}')
    (model_dir / "model.safetensors").write_bytes(b"old weights")
    (model_dir / "model.safetensors.index.json").write_text("{}")

    def save_pretrained(target: Path) -> None:
        (target / "config.json").write_text('{"new": true}')
        (target / "model.safetensors").write_bytes(b"new weights")

    out = export_hf_model(save_pretrained, model_dir, tmp_path / "final")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert (out / "config.json").read_text() == '{"new": true}'

    def failing(target: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        export_hf_model(failing, model_dir, out)
    # The earlier export is intact and no temporary directory is left behind.
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "model"]


def test_needed_versions_are_never_pruned(tmp_path: Path) -> None:
    # The version the log names stays while a newer one is written (a crash before its events
    # leaves a run that still restores), and goes once the newer one is published.
    store = CheckpointStore(tmp_path, keep=1)
    save(store, 1)
    store.needed = {1}
    save(store, 2)
    save(store, 3)
    assert store.versions() == [1, 3]
    store.needed = {3}
    assert store.prune() == [1]
    assert store.prune(keep=0) == [] and store.versions() == [3]
    store.needed = set()
    assert store.prune(keep=0) == [3] and store.versions() == []


def test_published_weights_are_bf16_safetensors_kept_per_published_version(tmp_path: Path) -> None:
    published = PublishedWeights(tmp_path / "published", keep=2)
    store = CheckpointStore(tmp_path / "checkpoints", published=published)
    embed = torch.linspace(-1, 1, 12).reshape(4, 3)
    for version in (1, 2, 3):
        model = {"embed.weight": embed * version, "lm_head.weight": None, "steps": torch.tensor([version])}
        model["lm_head.weight"] = model["embed.weight"]  # tied: stored once
        store.save(version, step=version, model_state=model, optimizer_state={})
    assert published.versions() == [1, 2, 3]
    assert not list(published.directory.glob(".*"))  # no temporary files left
    weights = published.load(3)
    assert set(weights) == {"embed.weight", "steps"}
    assert weights["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["embed.weight"], (embed * 3).to(torch.bfloat16))
    assert weights["steps"].dtype == torch.int64  # only floating point tensors are cast
    fp32 = store.path(3).stat().st_size
    assert published.path(3).stat().st_size < fp32 * 0.75
    # Version 3 is written but not published yet: the 2 newest at or below version 2 stay.
    assert published.prune(2) == [] and published.versions() == [1, 2, 3]
    assert published.discard_after(2) == [3]
    store.save(3, step=3, model_state={"embed.weight": embed}, optimizer_state={})
    assert published.prune(3) == [1] and published.versions() == [2, 3]


def test_published_weights_are_written_once_per_version(tmp_path: Path) -> None:
    published = PublishedWeights(tmp_path)
    first = published.save(4, {"w": torch.ones(2)})
    # A full checkpoint of a version published as weights: the same weights, nothing rewritten.
    assert published.save(4, {"w": torch.zeros(2)}) == first
    assert torch.equal(published.load(4)["w"], torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match="do not exist"):
        published.load(5)
    with pytest.raises(ValueError):
        PublishedWeights(tmp_path, keep=0)
