"""``WeightPublication``: a push's buckets written once as files and a manifest, complete or not
at all, owner-only, the newest versions kept (and any version pinned), one write shared by the
replicas a fleet tees a push to. No vLLM: the files are read back here byte for byte."""

from __future__ import annotations

import asyncio
import hashlib
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.engines.fleet import EngineFleet
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.weight_publication import MANIFEST, Manifest, PublicationFailed, WeightPublication
from tests.appliance.engines.test_fleet import Replica
from trainer.buckets import WeightBucket, dtype_of, pack_buckets, stream_buckets
from trainer.policy import PolicyTrainer


def weights(seed: int) -> dict[str, torch.Tensor]:
    noise = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 33, generator=noise),
        "b.bias": torch.randn(7, generator=noise).to(torch.bfloat16),
        "c.steps": torch.arange(5, dtype=torch.int64),
        "d.empty": torch.zeros(0, 3),
        "e.weight": torch.randn(300, 20, generator=noise),
    }


def push(tensors: dict[str, torch.Tensor], bucket_bytes: int = 4096) -> AsyncIterator[WeightBucket]:
    return stream_buckets(pack_buckets(tensors.items(), bucket_bytes=bucket_bytes))


def read_back(publication: WeightPublication, manifest: Manifest) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in manifest.files:
        path = publication.file_path(manifest.version, file.name)
        assert path is not None
        raw = path.read_bytes()
        assert len(raw) == file.bytes and hashlib.sha256(raw).hexdigest() == file.sha256
        for e in file.entries:
            data = bytearray(raw[e.offset : e.offset + e.nbytes])
            tensor = torch.frombuffer(data, dtype=dtype_of(e.dtype)) if data else torch.empty(0)
            out[e.name] = tensor.to(dtype_of(e.dtype)).reshape(e.shape)
    return out


def listed(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_push_is_written_as_files_whose_bytes_are_the_tensors(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path / "weights")
    tensors = weights(0)
    manifest = await publication.publish(push(tensors), 3)
    assert publication.current == manifest and publication.versions == (3,)
    assert len(manifest.files) >= 3  # ~34 KiB in 4 KiB buckets (a large tensor gets its own)
    back = read_back(publication, manifest)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
    directory = tmp_path / "weights" / "v3"
    assert json.loads((directory / MANIFEST).read_text()) == manifest.to_json()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert mode(tmp_path / "weights") == mode(directory) == 0o700
    assert {mode(path) for path in directory.iterdir()} == {0o600}
    assert listed(tmp_path / "weights") == ["v3"]  # no temporary left
    # What a restarted appliance finds: the same version, served again.
    assert WeightPublication(tmp_path / "weights").current == manifest


async def test_the_same_weights_give_the_same_files_whatever_the_bucket_held_before(tmp_path: Path) -> None:
    """The bytes between tensors are zeros, not what the reused bucket file held."""
    publication = WeightPublication(tmp_path)
    first = await publication.publish(push(weights(0)), 1)
    inode = (tmp_path / "v1" / first.files[0].name).stat().st_ino
    again = await publication.publish(push(weights(0)), 1)
    assert again == first
    assert (tmp_path / "v1" / first.files[0].name).stat().st_ino == inode  # kept, not rewritten
    other = await publication.publish(push(weights(1)), 1)
    assert other.files[0].sha256 != first.files[0].sha256
    assert publication.manifest(1) == other
    assert torch.equal(read_back(publication, other)["a.weight"], weights(1)["a.weight"])


async def test_the_newest_versions_stay_and_a_pinned_one_until_it_is_released(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path, keep=2)
    for version in (1, 2, 3):
        await publication.publish(push(weights(version)), version)
    assert list(publication.versions) == [2, 3]
    assert not (tmp_path / "v1").exists()
    with publication.pinned(2):
        for version in (4, 5):
            await publication.publish(push(weights(version)), version)
        assert list(publication.versions) == [2, 4, 5]
        assert publication.file_path(2, publication.manifest(2).files[0].name) is not None  # type: ignore[union-attr]
    assert list(publication.versions) == [4, 5]
    assert not (tmp_path / "v2").exists()


async def test_only_names_in_the_manifest_are_files(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path)
    manifest = await publication.publish(push(weights(0)), 1)
    assert publication.file_path(1, manifest.files[0].name) == tmp_path / "v1" / manifest.files[0].name
    for name in (MANIFEST, "../v1/" + manifest.files[0].name, "", "bucket-99999.bin"):
        assert publication.file_path(1, name) is None
    assert publication.file_path(2, manifest.files[0].name) is None


async def test_a_push_that_fails_half_way_publishes_nothing(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path)
    await publication.publish(push(weights(0)), 1)

    async def failing() -> AsyncIterator[WeightBucket]:
        count = 0
        async for bucket in push(weights(1)):
            if count == 2:
                raise RuntimeError("the trainer failed")
            count += 1
            yield bucket

    with pytest.raises(RuntimeError, match="trainer failed"):
        await publication.publish(failing(), 2)
    assert list(publication.versions) == [
        1,
    ]
    assert listed(tmp_path) == ["v1"]

    async def short() -> AsyncIterator[WeightBucket]:
        async for bucket in push(weights(1)):
            if not bucket.last:
                yield bucket

    with pytest.raises(ValueError, match="before their last bucket"):
        await publication.publish(short(), 2)
    assert listed(tmp_path) == ["v1"]


class Publishing(Replica):
    """A fleet replica that takes a push by publishing it (as an HTTP-pull engine does)."""

    def __init__(self, engine: TorchEngine, publication: WeightPublication) -> None:
        super().__init__(engine)
        self.publication = publication
        self.manifests: list[Manifest] = []

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        self.manifests.append(await self.publication.publish(buckets, version))


async def test_the_replicas_of_a_fleet_share_one_write_of_a_push(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two publishing replicas and a torch engine take one push through the fleet's tee: the
    publication is written once (the second replica drains its stream and waits), nothing
    stalls, and the torch engine loads every bucket."""
    publication = WeightPublication(tmp_path)
    writes: list[int] = []
    write = publication._write

    async def counted(buckets: AsyncIterator[WeightBucket], version: int, *rest: Any) -> Manifest:
        writes.append(version)
        return await write(buckets, version, *rest)

    publication._write = counted  # type: ignore[method-assign, assignment]
    local = TorchEngine(tiny_model_dir)
    replicas = [Publishing(TorchEngine(tiny_model_dir), publication) for _ in range(2)]
    fleet = EngineFleet([local, *replicas])
    await fleet.start()
    try:
        trainer = PolicyTrainer(tiny_model_dir)
        with torch.no_grad():
            for param in trainer.model.parameters():
                param.add_(0.01)
        buckets = stream_buckets(trainer.weight_buckets(8192))
        await asyncio.wait_for(fleet.load_weight_buckets(buckets, 7), 60)
    finally:
        await fleet.close()
    assert writes == [7]
    assert replicas[0].manifests == replicas[1].manifests == [publication.current]
    assert local.policy_version == fleet.policy_version == 7
    state = trainer.model.state_dict()
    back = read_back(publication, replicas[0].manifests[0])
    assert {name: torch.equal(back[name], state[name]) for name in back} == dict.fromkeys(back, True)


def paced(tensors: dict[str, torch.Tensor], gate: asyncio.Queue[None]) -> AsyncIterator[WeightBucket]:
    """``push(tensors)``, each bucket after the first handed over only once ``gate`` has a token."""

    async def buckets() -> AsyncIterator[WeightBucket]:
        async for bucket in push(tensors):
            if bucket.index:
                await gate.get()
            yield bucket

    return buckets()


async def collect(publication: WeightPublication, version: int) -> list[str]:
    return [file.name async for file in publication.files_of(version)]


async def test_a_version_is_followed_file_by_file_while_it_is_written(tmp_path: Path) -> None:
    """A reader that follows a version gets each file once it is whole, and the path of a file
    not yet whole is refused; readers that come late (mid-write, after) get the whole version."""
    publication = WeightPublication(tmp_path)
    gate: asyncio.Queue[None] = asyncio.Queue()
    writing = publication.begin(paced(weights(0), gate), 4)
    assert publication.writing(4) and publication.known(4) and publication.manifest(4) is None
    follower = publication.files_of(4)
    first = await anext(follower)
    assert first.name == "bucket-00000.bin"
    path = publication.file_path(4, first.name)
    assert path is not None and hashlib.sha256(path.read_bytes()).hexdigest() == first.sha256
    assert publication.file_path(4, "bucket-00001.bin") is None  # not written yet: not served
    late = asyncio.ensure_future(collect(publication, 4))
    gate.put_nowait(None)
    second = await anext(follower)
    assert second.name == "bucket-00001.bin" and publication.file_path(4, second.name) is not None
    for _ in range(20):
        gate.put_nowait(None)
    rest = [file.name async for file in follower]
    manifest = await writing
    names = [file.name for file in manifest.files]
    assert [first.name, second.name, *rest] == names == await late
    assert await collect(publication, 4) == names  # after the write: the published version
    assert not publication.writing(4) and publication.file_path(4, names[-1]) == tmp_path / "v4" / names[-1]
    with pytest.raises(KeyError):
        await collect(publication, 5)


async def test_a_follower_of_a_write_that_fails_is_told_so(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path)

    async def failing() -> AsyncIterator[WeightBucket]:
        async for bucket in push(weights(1)):
            if bucket.index == 2:
                raise RuntimeError("the trainer failed")
            yield bucket

    follower = asyncio.ensure_future(collect(publication, 2))
    with pytest.raises(RuntimeError, match="trainer failed"):
        await publication.publish(failing(), 2)
    with pytest.raises(
        PublicationFailed, match="writing weights v2 failed: RuntimeError: the trainer failed"
    ):
        await follower
    assert not publication.known(2) and listed(tmp_path) == []
