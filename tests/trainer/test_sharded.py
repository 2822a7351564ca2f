"""Sharded checkpoints: real ranks (gloo, FSDP2) save and load across world sizes; the store's
crash safety, pruning and discarding, in process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.trainer.sharded_workers import Load, Save, launch, load_and_snapshot, train_and_save
from trainer import sharded_format
from trainer.checkpoints import CheckpointError, CheckpointStore
from trainer.sharded import ShardedStore, ShardedWeightsStore
from trainer.sharded_format import checkpoint_bytes, load_sharded, read_manifest, save_sharded
from trainer.versions import VersionStore

# In-process tests run without a process group; DCP says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def read(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=False)
    return state


def assert_equal_states(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_equal_states(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype, key
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def assert_moments_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Per-parameter optimizer state equal; param groups equal but for their order of keys."""
    assert_equal_states(actual["state"], expected["state"])
    assert [sorted(g.items()) for g in actual["param_groups"]] == [
        sorted(g.items()) for g in expected["param_groups"]
    ]


# --- across world sizes (spawned ranks) -------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("save_ranks", "load_ranks"), [(2, 1), (1, 2)])
def test_full_checkpoint_resumes_on_another_world_size(
    tmp_path: Path, save_ranks: int, load_ranks: int
) -> None:
    ckpt, expected = tmp_path / "checkpoints" / "v000002", tmp_path / "expected.pt"
    launch(save_ranks, tmp_path, train_and_save, [Save(2, str(ckpt), str(expected), full=True)])
    manifest = read_manifest(ckpt)
    assert (manifest.version, manifest.step, manifest.kind, manifest.dtype) == (2, 2, "full", None)
    assert manifest.world_size == save_ranks
    assert manifest.trainer_state == {"backend": "test", "lr_scheduler": {"last_epoch": 2}}
    assert len(list(ckpt.glob("*.distcp"))) == save_ranks  # every rank wrote its own shards
    assert [p.name for p in ckpt.parent.iterdir()] == ["v000002"]  # no leftovers

    out = tmp_path / "loaded.pt"
    launch(load_ranks, tmp_path, load_and_snapshot, [Load(str(ckpt), str(out))])
    loaded, saved = read(out), read(expected)
    assert_equal_states(loaded["model"], saved["model"])
    assert_moments_equal(loaded["optimizer"], saved["optimizer"])
    assert loaded["manifest"] == manifest


@pytest.mark.timeout(240)
def test_bf16_weights_load_with_the_optimizer_of_an_earlier_full_checkpoint(tmp_path: Path) -> None:
    full, weights = tmp_path / "v000002", tmp_path / "weights" / "v000003"
    plan = [
        Save(2, str(full), str(tmp_path / "full.pt"), full=True),
        Save(3, str(weights), str(tmp_path / "weights.pt"), full=False, dtype="bfloat16"),
    ]
    launch(2, tmp_path, train_and_save, plan)
    manifest = read_manifest(weights)
    assert (manifest.kind, manifest.dtype, manifest.step, manifest.world_size) == (
        "weights",
        "bfloat16",
        3,
        2,
    )
    assert checkpoint_bytes(weights) < checkpoint_bytes(full) / 4  # half-width, no moments

    with_moments, fresh = tmp_path / "with_moments.pt", tmp_path / "fresh.pt"
    loads = [Load(str(weights), str(with_moments), optimizer_from=str(full)), Load(str(weights), str(fresh))]
    launch(1, tmp_path, load_and_snapshot, loads)
    expected_weights = read(tmp_path / "weights.pt")["model"]
    rounded = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in expected_weights.items()}
    assert any(not torch.equal(rounded[k], v) for k, v in expected_weights.items())  # bf16 rounds
    for name in (with_moments, fresh):
        loaded = read(name)
        assert_equal_states(loaded["model"], rounded)  # fp32 again, values rounded to bf16
    # The moments are the full checkpoint's (one step older than the weights) ...
    assert not read(with_moments)["cleared"]
    assert_moments_equal(read(with_moments)["optimizer"], read(tmp_path / "full.pt")["optimizer"])
    # ... or, without optimizer_from, the optimizer's own state is cleared: a fresh start.
    assert read(fresh)["cleared"]


# --- one process: the format and the store --------------------------------------------------------


def model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def save(store: ShardedStore, version: int, module: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    return store.save(version, module, optimizer, step=version * 10, trainer_state={"v": version})


def test_store_round_trip_names_and_manifest(tmp_path: Path) -> None:
    module, optimizer = model()
    store = ShardedStore(tmp_path / "run" / "checkpoints")
    path = save(store, 7, module, optimizer)
    assert path == tmp_path / "run" / "checkpoints" / "v000007"
    assert store.relative_path(7) == Path("checkpoints/v000007")
    assert store.manifest(7).step == 70
    assert store.disk_bytes() == checkpoint_bytes(path) > 0
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    manifest = store.load(7, other)
    assert manifest.trainer_state == {"v": 7}
    assert_equal_states(other.state_dict(), module.state_dict())
    with pytest.raises(CheckpointError, match="does not exist"):
        store.load(8, other)


def test_store_latest_prune_and_discard_after_as_checkpoint_store(tmp_path: Path) -> None:
    module, optimizer = model()
    sharded_store, file_store = ShardedStore(tmp_path, keep=2), CheckpointStore(tmp_path, keep=2)
    stores: list[VersionStore] = [sharded_store, file_store]  # one protocol: mypy checks it
    assert sharded_store.latest() is None
    for version in (1, 2, 3, 4):
        save(sharded_store, version, module, optimizer)
        file_store.save(version, step=version, model_state=module.state_dict(), optimizer_state={})
    # Side by side in one directory, each store sees only its own versions.
    assert [store.versions() for store in stores] == [[3, 4], [3, 4]]
    assert [store.latest() for store in stores] == [4, 4]
    assert checkpoint_bytes(file_store.path(4)) == file_store.path(4).stat().st_size
    assert checkpoint_bytes(tmp_path / "v000099") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003", "v000003.pt", "v000004", "v000004.pt"]
    # The version just saved is never pruned.
    save(sharded_store, 1, module, optimizer)
    file_store.save(1, step=1, model_state=module.state_dict(), optimizer_state={})
    assert sharded_store.versions() == file_store.versions() == [1, 3, 4]
    assert sharded_store.discard_after(1) == file_store.discard_after(1) == [3, 4]
    assert sharded_store.versions() == file_store.versions() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001", "v000001.pt"]


def test_writing_a_version_again_replaces_it(tmp_path: Path) -> None:
    module, optimizer = model()
    store = ShardedStore(tmp_path)
    save(store, 3, module, optimizer)
    store.save(3, module, optimizer, step=31, trainer_state={})
    assert store.manifest(3).step == 31
    assert [p.name for p in tmp_path.iterdir()] == ["v000003"]


def test_an_interrupted_write_leaves_no_version_and_the_store_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, optimizer = model()
    store = ShardedStore(tmp_path)
    save(store, 1, module, optimizer)

    def crash(path: Path) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(sharded_format, "fsync_path", crash)  # publish() dies before its rename
    with pytest.raises(OSError, match="power cut"):
        save(store, 2, module, optimizer)
    with pytest.raises(OSError, match="power cut"):
        store.save(1, module, optimizer, step=99, trainer_state={})
    monkeypatch.undo()
    assert store.versions() == [1]
    assert store.manifest(1).step == 10  # the old copy is intact
    assert {p.name for p in tmp_path.iterdir()} == {"v000001", ".v000002.partial", ".v000001.partial"}

    # A crash between "rename the old copy aside" and "rename the new one in": put back.
    (tmp_path / "v000001").rename(tmp_path / ".v000001.replaced")
    (tmp_path / "v000009").mkdir()
    (tmp_path / ".v000009.replaced").mkdir()  # the new copy made it: the old one goes
    (tmp_path / ".v000005.discarded").mkdir()  # a deletion cut short
    CheckpointStore(tmp_path)  # does not trip over our directories
    store = ShardedStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001", "v000009"]
    assert store.manifest(1).step == 10


def test_manifest_errors(tmp_path: Path) -> None:
    module, optimizer = model()
    with pytest.raises(CheckpointError, match="does not exist"):
        read_manifest(tmp_path / "v000001")
    path = save_sharded(tmp_path / "v000001", module, optimizer, step=1, version=1, trainer_state={})
    manifest_file = path / sharded_format.MANIFEST
    raw = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**raw, "format": "something else"}))
    with pytest.raises(CheckpointError, match="not one of ours"):
        read_manifest(path)
    manifest_file.write_text("{")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_manifest(path)


def test_bad_arguments_write_nothing(tmp_path: Path) -> None:
    module, optimizer = model()
    with pytest.raises(TypeError):
        save_sharded(
            tmp_path / "v000001", module, None, step=1, version=1, trainer_state={"t": torch.ones(1)}
        )
    with pytest.raises(ValueError, match="weights checkpoint"):
        save_sharded(
            tmp_path / "v000001", module, optimizer, step=1, version=1, trainer_state={}, dtype=torch.bfloat16
        )
    assert list(tmp_path.iterdir()) == []


def test_optimizer_from_must_be_a_full_checkpoint(tmp_path: Path) -> None:
    module, optimizer = model()
    weights = ShardedWeightsStore(tmp_path / "weights", dtype=torch.bfloat16)
    weights.save(1, module, optimizer, step=1, trainer_state={})
    assert read_manifest(weights.path(1)).kind == "weights"
    with pytest.raises(CheckpointError, match="not a full one"):
        load_sharded(weights.path(1), module, optimizer, optimizer_from=weights.path(1))
