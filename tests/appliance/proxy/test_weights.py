"""GET /admin/weights/...: a published version's manifest and files over a real aiohttp server,
to a real client; the admin token required, only the manifest's names served."""

from __future__ import annotations

import hashlib
from pathlib import Path

import aiohttp
import torch

from appliance.engines.weight_publication import WeightPublication
from tests.appliance.proxy.weights_app import TOKEN, weights_server
from trainer.buckets import pack_buckets, stream_buckets

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
