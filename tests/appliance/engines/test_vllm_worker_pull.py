"""``ApplianceWorkerExtension.appliance_pull_weights`` without vLLM: a worker whose bucket load is
recorded pulls a version from the proxy's weight routes on a real aiohttp server while the
version is still being written. Nothing is loaded before the version is complete and every file
checked; a digest that differs fails the pull with nothing loaded."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.engines import vllm_fetch, weight_publication
from appliance.engines.vllm_worker import ApplianceWorkerExtension
from appliance.engines.weight_publication import PublishedFile, WeightPublication
from tests.appliance.proxy.weights_app import TOKEN, weights_server
from trainer.buckets import WeightBucket, pack_buckets, stream_buckets

TENSORS = {
    **{f"model.layers.{i}.weight": torch.randn(96, 64) for i in range(5)},
    "lm_head.weight": torch.randn(32, 64),
}


class Recording(ApplianceWorkerExtension):
    """A worker that keeps what each bucket load got (a copy of its tensors) and whether the
    version was complete when it did."""

    def __init__(self, publication: WeightPublication, version: int) -> None:
        self.publication, self.version = publication, version
        self.loads: list[tuple[dict[str, Any], dict[str, torch.Tensor], bool]] = []

    def _appliance_load(self, spec: dict[str, Any], tensors: Any) -> dict[str, int]:
        raw, views = tensors()
        copied = {name: tensor.clone() for name, tensor in views}
        del raw
        complete = self.publication.manifest(self.version) is not None
        self.loads.append((spec, copied, complete))
        return {"tensors": len(copied), "tied_heads": 0}


def paced(gate: asyncio.Queue[None]) -> AsyncIterator[WeightBucket]:
    async def buckets() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(pack_buckets(TENSORS.items(), bucket_bytes=1 << 15)):
            if bucket.index:
                await gate.get()
            yield bucket

    return buckets()


def pull_spec(url: str, version: int, directory: Path) -> str:
    return json.dumps(
        {
            "url": url,
            "token": TOKEN,
            "version": version,
            "follow": True,
            "skip": ["lm_head.weight"],
            "bytes": 1 << 20,
            "threads": 2,
            "retries": 1,
            "backoff_s": 0.01,
            "directory": str(directory),
        }
    )


def pull_directories(root: Path) -> list[str]:
    """The directories a pull left in ``root`` (its own is removed when it ends)."""
    return [path.name for path in root.iterdir() if path.name.startswith("appliance-pull-")]


async def feed(gate: asyncio.Queue[None], count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0.02)
        gate.put_nowait(None)


async def test_a_followed_version_loads_only_once_complete_and_checked(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path / "published")
    gate: asyncio.Queue[None] = asyncio.Queue()
    worker = Recording(publication, 3)
    writing = publication.begin(paced(gate), 3)
    async with weights_server(publication) as url:
        feeding = asyncio.ensure_future(feed(gate, 10))
        report = await asyncio.to_thread(worker.appliance_pull_weights, pull_spec(url, 3, tmp_path))
        await feeding
    manifest = await writing
    assert (report["version"], report["bytes"], report["files"]) == (3, manifest.bytes, len(manifest.files))
    assert len(worker.loads) == len(manifest.files) >= 5
    assert all(complete for _, _, complete in worker.loads)
    assert [(spec["first"], spec["last"]) for spec, _, _ in worker.loads] == [
        (i == 0, i == len(manifest.files) - 1) for i in range(len(manifest.files))
    ]
    loaded = {name: tensor for _, tensors, _ in worker.loads for name, tensor in tensors.items()}
    assert loaded.keys() == TENSORS.keys() - {"lm_head.weight"}  # skipped: a tied head
    assert all(torch.equal(loaded[name], TENSORS[name]) for name in loaded)
    assert not worker.appliance_pull_touched()
    assert pull_directories(tmp_path) == []


async def test_a_digest_that_differs_fails_the_pull_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publication = WeightPublication(tmp_path / "published")
    hashed = weight_publication.hash_bucket_file

    def wrong(path: Path, bucket: WeightBucket) -> PublishedFile:
        file = hashed(path, bucket)
        return dataclasses.replace(file, sha256="0" * 64) if bucket.index == 3 else file

    monkeypatch.setattr(weight_publication, "hash_bucket_file", wrong)
    gate: asyncio.Queue[None] = asyncio.Queue()
    worker = Recording(publication, 4)
    writing = publication.begin(paced(gate), 4)
    async with weights_server(publication) as url:
        feeding = asyncio.ensure_future(feed(gate, 10))
        with pytest.raises(vllm_fetch.PullError, match=r"bucket-00003\.bin: its SHA-256 .* nothing was"):
            await asyncio.to_thread(worker.appliance_pull_weights, pull_spec(url, 4, tmp_path))
        await feeding
    await writing
    assert worker.loads == [] and not worker.appliance_pull_touched()
    assert pull_directories(tmp_path) == []
