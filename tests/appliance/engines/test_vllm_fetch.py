"""``vllm_fetch``, the download half of a pull (what vLLM's worker runs), without vLLM: a
published version fetched from the proxy's weight routes on a real aiohttp server, in parallel,
retried through a server that fails, refused on a wrong token or a digest that differs."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from appliance.engines import vllm_fetch, weight_publication
from appliance.engines.weight_publication import Manifest, PublishedFile, WeightPublication
from tests.appliance.proxy.weights_app import TOKEN, weights_server
from trainer.buckets import WeightBucket, pack_buckets, stream_buckets


async def published(root: Path) -> tuple[WeightPublication, Manifest]:
    publication = WeightPublication(root)
    tensors = {f"layer{i}.weight": torch.randn(128, 64) for i in range(6)}
    manifest = await publication.publish(
        stream_buckets(pack_buckets(tensors.items(), bucket_bytes=1 << 15)), 2
    )
    return publication, manifest


def spec(url: str, token: str = TOKEN, **more: Any) -> dict[str, Any]:
    return {"url": url, "token": token, "version": 2, "threads": 3, "retries": 2, "backoff_s": 0.01, **more}


async def fetch(base: str, manifest: Manifest, directory: Path, settings: dict[str, Any]) -> list[Path]:
    files = [f.to_json() for f in manifest.files]
    return await asyncio.to_thread(vllm_fetch.fetch_files, base, files, directory, settings)


async def test_every_file_arrives_whole_and_checked(tmp_path: Path) -> None:
    publication, manifest = await published(tmp_path / "published")
    (tmp_path / "pulled").mkdir()
    async with weights_server(publication) as url:
        paths = await fetch(f"{url}/admin/weights/v2", manifest, tmp_path / "pulled", spec(url))
        fetched = await asyncio.to_thread(
            vllm_fetch.fetch_json, f"{url}/admin/weights/v2/manifest", spec(url)
        )
    assert len(paths) == len(manifest.files) == 6
    for path, file in zip(paths, manifest.files, strict=True):
        assert path.name == file.name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == file.sha256
    assert Manifest.from_json(fetched) == manifest


async def test_a_wrong_token_fails_at_once_and_a_changed_file_by_its_digest(tmp_path: Path) -> None:
    publication, manifest = await published(tmp_path / "published")
    (tmp_path / "pulled").mkdir()
    async with weights_server(publication) as url:
        base = f"{url}/admin/weights/v2"
        with pytest.raises(vllm_fetch.PullError, match=r"\(1 tries\).*401"):
            await fetch(base, manifest, tmp_path / "pulled", spec(url, token="wrong", backoff_s=5.0))
        path = publication.file_path(2, manifest.files[3].name)
        assert path is not None
        raw = bytearray(path.read_bytes())
        raw[10] ^= 0xFF
        path.write_bytes(bytes(raw))
        with pytest.raises(
            vllm_fetch.PullError, match=f"file {manifest.files[3].name}: its SHA-256 .* is not the manifest's"
        ):
            await fetch(base, manifest, tmp_path / "pulled", spec(url))
        with pytest.raises(vllm_fetch.PullError, match="404"):
            await asyncio.to_thread(vllm_fetch.fetch_json, f"{url}/admin/weights/v9/manifest", spec(url))


async def test_a_failing_server_is_retried_and_then_given_up_on(tmp_path: Path) -> None:
    """Answers 503, then a body cut short, then the file: fetched on the third try; a server that
    only fails is given up on after ``retries`` more tries, naming the last error."""
    payload = bytes(range(256)) * 40
    failures = {"count": 2}
    seen: list[str] = []

    async def flaky(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        if failures["count"] == 2:
            failures["count"] -= 1
            return web.Response(status=503)
        if failures["count"] == 1:
            failures["count"] -= 1
            return web.Response(body=payload[:100])
        if failures["count"] < 0:
            return web.Response(status=502)
        return web.Response(body=payload)

    app = web.Application()
    app.router.add_get("/w/{name}", flaky)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    file = {
        "name": "f.bin",
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "entries": [],
    }
    try:
        url = f"http://127.0.0.1:{port}/w/f.bin"
        path = await asyncio.to_thread(vllm_fetch.fetch_file, url, file, tmp_path / "f.bin", spec(""))
        assert path.read_bytes() == payload
        assert seen == [f"Bearer {TOKEN}"] * 3
        failures["count"] = -1
        with pytest.raises(vllm_fetch.PullError, match=r"\(3 tries\).*502"):
            await asyncio.to_thread(vllm_fetch.fetch_file, url, file, tmp_path / "g.bin", spec(""))
    finally:
        await runner.cleanup()


def test_the_files_wait_where_there_is_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_fetch.PULL_DIR_ENV, str(tmp_path))
    assert vllm_fetch.pull_root(10) == str(tmp_path)
    assert vllm_fetch.pull_root(10, "/") == "/"
    with pytest.raises(vllm_fetch.PullError, match="bytes free"):
        vllm_fetch.pull_root(1 << 62)
    monkeypatch.delenv(vllm_fetch.PULL_DIR_ENV)
    assert vllm_fetch.pull_root(10) in ("/dev/shm", tempfile.gettempdir())


def paced(gate: asyncio.Queue[None], fail_at: int | None = None) -> AsyncIterator[WeightBucket]:
    """Six 32 KiB tensors, each bucket after the first handed over once ``gate`` has a token
    (raising at bucket ``fail_at``)."""
    tensors = {f"layer{i}.weight": torch.randn(128, 64) for i in range(6)}

    async def buckets() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(pack_buckets(tensors.items(), bucket_bytes=1 << 15)):
            if bucket.index:
                await gate.get()
            if bucket.index == fail_at:
                raise RuntimeError("the trainer failed")
            yield bucket

    return buckets()


async def feed(gate: asyncio.Queue[None], directory: Path, count: int) -> None:
    """A token to ``gate`` each time a file has arrived in ``directory`` (the pull then waits
    for the next one to be written: the two overlap, file by file)."""
    given = 0
    for _ in range(2000):  # 10 s at most
        if len(await asyncio.to_thread(os.listdir, directory)) > given:
            gate.put_nowait(None)
            given += 1
        if given == count:
            return
        await asyncio.sleep(0.005)


async def test_a_version_being_written_is_fetched_file_by_file(tmp_path: Path) -> None:
    """The pull follows the version's listing: each file is downloaded while the next is not
    written yet (the write waits for it), and the pull ends only once the version is complete."""
    publication = WeightPublication(tmp_path / "published")
    gate: asyncio.Queue[None] = asyncio.Queue()
    (tmp_path / "pulled").mkdir()
    writing = publication.begin(paced(gate), 2)
    async with weights_server(publication) as url:
        feeding = asyncio.ensure_future(feed(gate, tmp_path / "pulled", 5))
        files, paths = await asyncio.to_thread(
            vllm_fetch.fetch_streamed, f"{url}/admin/weights/v2", tmp_path / "pulled", spec(url)
        )
        await feeding
    manifest = await writing
    assert files == [file.to_json() for file in manifest.files] and len(files) == 6
    for path, file in zip(paths, manifest.files, strict=True):
        assert path.name == file.name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == file.sha256


async def test_a_followed_pull_refuses_a_failed_write_and_a_digest_that_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publication = WeightPublication(tmp_path / "published")
    gate: asyncio.Queue[None] = asyncio.Queue()
    (tmp_path / "pulled").mkdir()
    base_of = "{}/admin/weights/v{}".format
    async with weights_server(publication) as url:
        writing = publication.begin(paced(gate, fail_at=3), 2)
        for _ in range(3):
            gate.put_nowait(None)
        with pytest.raises(vllm_fetch.PullError, match=r"could not publish the version.*trainer failed"):
            await asyncio.to_thread(
                vllm_fetch.fetch_streamed, base_of(url, 2), tmp_path / "pulled", spec(url)
            )
        with pytest.raises(RuntimeError, match="trainer failed"):
            await writing
        # The third file is listed with a digest its bytes do not have.
        hashed = weight_publication.hash_bucket_file

        def wrong(path: Path, bucket: WeightBucket) -> PublishedFile:
            file = hashed(path, bucket)
            return dataclasses.replace(file, sha256="0" * 64) if bucket.index == 2 else file

        monkeypatch.setattr(weight_publication, "hash_bucket_file", wrong)
        writing = publication.begin(paced(gate), 3)
        for _ in range(5):
            gate.put_nowait(None)
        with pytest.raises(
            vllm_fetch.PullError, match=r"file bucket-00002\.bin: its SHA-256 .* is not the manifest's"
        ):
            await asyncio.to_thread(
                vllm_fetch.fetch_streamed, base_of(url, 3), tmp_path / "pulled", spec(url)
            )
        await writing
