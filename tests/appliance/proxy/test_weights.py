"""GET /admin/weights/...: a published version's manifest and files over a real aiohttp server,
to a real client; the admin token required, only the manifest's names served."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from appliance.engines.weight_publication import WeightPublication
from tests.appliance.proxy.weights_app import TOKEN, weights_server
from trainer.buckets import WeightBucket, pack_buckets, stream_buckets

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def published(root: Path, version: int = 4) -> WeightPublication:
    publication = WeightPublication(root)
    tensors = {f"layer{i}.weight": torch.full((40, 40), float(i)) for i in range(3)}
    await publication.publish(stream_buckets(pack_buckets(tensors.items(), bucket_bytes=8192)), version)
    return publication


async def test_a_version_is_served_to_the_admin_token_only(tmp_path: Path) -> None:
    publication = await published(tmp_path)
    manifest = publication.current
    assert manifest is not None
    name = manifest.files[1].name
    async with weights_server(publication) as url, aiohttp.ClientSession() as session:
        for path in ("/admin/weights/current", "/admin/weights/v4/manifest", f"/admin/weights/v4/{name}"):
            async with session.get(url + path) as response:
                assert response.status == 401, path
                assert "admin token" in (await response.json())["error"]["message"]
            async with session.get(url + path, headers={"Authorization": "Bearer wrong"}) as response:
                assert response.status == 401, path
        async with session.get(f"{url}/admin/weights/current", headers=AUTH) as response:
            assert response.status == 200
            assert await response.json() == {"version": 4, "manifest": manifest.to_json()}
        async with session.get(f"{url}/admin/weights/v4/manifest", headers=AUTH) as response:
            assert await response.json() == manifest.to_json()
        async with session.get(f"{url}/admin/weights/v4/{name}", headers=AUTH) as response:
            assert response.status == 200
            body = await response.read()
        assert len(body) == manifest.files[1].bytes
        assert hashlib.sha256(body).hexdigest() == manifest.files[1].sha256
        # A cut-off download can resume where it stopped.
        async with session.get(
            f"{url}/admin/weights/v4/{name}", headers={**AUTH, "Range": "bytes=100-"}
        ) as response:
            assert response.status == 206
            assert await response.read() == body[100:]


async def test_unknown_versions_files_and_paths_are_404(tmp_path: Path) -> None:
    publication = await published(tmp_path / "weights")
    (tmp_path / "secret.txt").write_text("not weights")
    async with weights_server(publication) as url, aiohttp.ClientSession(headers=AUTH) as session:
        for path in (
            "/admin/weights/v5/manifest",
            "/admin/weights/v3/bucket-00000.bin",
            "/admin/weights/v4/bucket-99999.bin",
            "/admin/weights/v4/manifest.json",
            "/admin/weights/v4/..%2F..%2Fsecret.txt",
            "/admin/weights/v4/%2E%2E",
            "/admin/weights/vx/manifest",
        ):
            async with session.get(url + path) as response:
                assert response.status == 404, path
                assert "not_found" in (await response.text()), path


async def test_nothing_published_is_404(tmp_path: Path) -> None:
    async with (
        weights_server(WeightPublication(tmp_path)) as url,
        aiohttp.ClientSession(headers=AUTH) as session,
        session.get(f"{url}/admin/weights/current") as response,
    ):
        assert response.status == 404
        assert "no weights have been published" in (await response.json())["error"]["message"]


async def lines(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in response.content:
        yield json.loads(raw)


async def test_a_version_being_written_is_listed_and_served_file_by_file(tmp_path: Path) -> None:
    """``/files`` lists each file once it is whole and serves it at once (a file not yet written
    is a 404, never a part of it); its last line says the version is complete; a reader that
    comes after the write gets the whole version the same way."""
    publication = WeightPublication(tmp_path)
    gate: asyncio.Queue[None] = asyncio.Queue()
    tensors = {f"layer{i}.weight": torch.full((40, 40), float(i)) for i in range(3)}

    async def paced() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(pack_buckets(tensors.items(), bucket_bytes=8192)):
            if bucket.index:
                await gate.get()
            yield bucket

    writing = publication.begin(paced(), 6)
    seen: list[dict[str, Any]] = []
    async with weights_server(publication) as url, aiohttp.ClientSession(headers=AUTH) as session:
        async with session.get(f"{url}/admin/weights/v6/files") as listing:
            assert listing.status == 200
            async for line in lines(listing):
                seen.append(line)
                if "name" not in line:
                    break
                async with session.get(f"{url}/admin/weights/v6/{line['name']}") as response:
                    assert response.status == 200
                    assert hashlib.sha256(await response.read()).hexdigest() == line["sha256"]
                following = f"bucket-{len(seen):05d}.bin"
                async with session.get(f"{url}/admin/weights/v6/{following}") as response:
                    assert response.status == 404, following  # not whole yet
                gate.put_nowait(None)
        manifest = await writing
        assert seen[:-1] == [file.to_json() for file in manifest.files]
        assert seen[-1] == {"version": 6, "files": len(manifest.files), "bytes": manifest.bytes}
        async with session.get(f"{url}/admin/weights/v6/files") as late:
            assert [line async for line in lines(late)] == seen
        async with session.get(f"{url}/admin/weights/v7/files") as unknown:
            assert unknown.status == 404


async def test_a_write_that_fails_ends_its_listing_with_the_error(tmp_path: Path) -> None:
    publication = WeightPublication(tmp_path)
    gate: asyncio.Queue[None] = asyncio.Queue()
    tensors = {f"layer{i}.weight": torch.full((40, 40), float(i)) for i in range(3)}

    async def failing() -> AsyncIterator[WeightBucket]:
        async for bucket in stream_buckets(pack_buckets(tensors.items(), bucket_bytes=8192)):
            if bucket.index == 1:
                await gate.get()
                raise RuntimeError("the trainer failed")
            yield bucket

    writing = publication.begin(failing(), 2)
    async with (
        weights_server(publication) as url,
        aiohttp.ClientSession(headers=AUTH) as session,
        session.get(f"{url}/admin/weights/v2/files") as listing,
    ):
        first = await anext(lines(listing))
        assert first["name"] == "bucket-00000.bin"
        gate.put_nowait(None)
        rest = [line async for line in lines(listing)]
    assert rest == [{"error": "writing weights v2 failed: RuntimeError: the trainer failed"}]
    with pytest.raises(RuntimeError, match="trainer failed"):
        await writing
