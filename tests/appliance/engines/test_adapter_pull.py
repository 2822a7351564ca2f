"""A LoRA run's adapter for remote replicas that pull over HTTP, on CPU: published whole and once
(``adapter_publication``), served by the real proxy at ``/admin/adapters/...`` to the admin token
alone, and fetched by the worker extension's download (``vllm_adapter_fetch``, run here as the
server runs it) into a directory of its own with every digest checked; and the engine's side
(``vllm_pull_adapter``: publish, the worker's RPC, ``/v1/load_lora_adapter`` given the server's
own directory; a late replica's catch-up to the fleet's version) against a vLLM-shaped server
whose RPC runs that download."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from appliance.app import Appliance
from appliance.engines import lora, remote
from appliance.engines.adapter_publication import FILES, AdapterPublication
from appliance.engines.vllm_adapter_fetch import AdapterPullError, pull_adapter
from appliance.engines.vllm_engine import VLLMEngine
from appliance.engines.vllm_pull import PullSource
from appliance.engines.weight_publication import WeightPublication
from tests.support import make_config
from trainer.buckets import LoraAdapter, pack_buckets, stream_buckets


def random_adapter(model_dir: Path, seed: int, rank: int = 4) -> lora.AdapterWeights:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (rows, cols) in lora.linear_shapes(model).items():
        if name != "lm_head":
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.3
    return lora.AdapterWeights(LoraAdapter(rank, 8.0), tensors)


def test_an_adapter_version_is_published_whole_once_and_the_newest_stay(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    publication = AdapterPublication(tmp_path / "adapters", keep=2)
    first = publication.publish(random_adapter(tiny_model_dir, 0), 1)
    assert [f["name"] for f in first["files"]] == list(FILES) and first["version"] == 1
    for file in first["files"]:
        data = (tmp_path / "adapters" / "v1" / file["name"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (file["bytes"], file["sha256"])
    assert publication.publish(random_adapter(tiny_model_dir, 1), 1) == first  # kept as it is
    publication.publish(random_adapter(tiny_model_dir, 2), 2)
    publication.publish(random_adapter(tiny_model_dir, 3), 3)
    assert publication.versions() == [2, 3] and publication.manifest(1) is None
    assert publication.path(3, "manifest.json") is None and publication.path(3, "../v2") is None
    assert not [p for p in (tmp_path / "adapters").iterdir() if p.name.startswith(".tmp-")]


async def test_the_proxy_serves_an_adapter_that_the_worker_fetches_with_digests_checked(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_dir = tmp_path / "server" / "adapters"  # where a launched server's go (its own dir)
    monkeypatch.setenv("APPLIANCE_ADAPTER_DIR", str(server_dir))
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        adapters = app.replicas.adapters
        assert adapters is not None and adapters.root == tmp_path / "run" / "adapters"
        manifest = adapters.publish(random_adapter(tiny_model_dir, 0), 4)
        url = f"{app.proxy_url}/admin/adapters/v4/adapter_config.json"
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as response:
                assert response.status == 401
            async with session.get(url, headers={"Authorization": f"Bearer {app.admin_token}"}) as response:
                assert response.status == 200
                assert await response.read() == (adapters.root / "v4" / "adapter_config.json").read_bytes()
            for missing in ("v5/adapter_config.json", "v4/manifest.json", "v4/model.safetensors"):
                headers = {"Authorization": f"Bearer {app.admin_token}"}
                async with session.get(
                    f"{app.proxy_url}/admin/adapters/{missing}", headers=headers
                ) as response:
                    assert response.status == 404, missing

        worker = SimpleNamespace()
        spec: dict[str, Any] = {"url": app.proxy_url, "token": app.admin_token, "version": 4, **manifest}
        spec["retries"], spec["backoff_s"] = 1, 0.01
        fetched = [await asyncio.to_thread(pull_adapter, worker, json.dumps(spec)) for _ in range(3)]
        paths = [Path(f["path"]) for f in fetched]
        assert not paths[0].exists() and all(p.is_dir() for p in paths[1:])  # the newest two stay
        assert all(p.parent == server_dir for p in paths) and server_dir.stat().st_mode & 0o077 == 0
        for name in FILES:
            assert (paths[2] / name).read_bytes() == (adapters.root / "v4" / name).read_bytes()
        assert fetched[2]["bytes"] == sum(f["bytes"] for f in manifest["files"])
        assert json.loads((paths[2] / "adapter_config.json").read_text())["r"] == 4

        wrong = {**spec, "files": [{**manifest["files"][0], "sha256": "0" * 64}]}
        with pytest.raises(
            AdapterPullError, match=r"adapter_config\.json arrived with another size or SHA-256"
        ):
            await asyncio.to_thread(pull_adapter, worker, json.dumps(wrong))
        with pytest.raises(AdapterPullError, match="HTTP 401"):
            await asyncio.to_thread(pull_adapter, worker, json.dumps({**spec, "token": "wrong"}))
        assert [Path(p) for p in worker._appliance_adapter_dirs] == paths[1:]  # failures left nothing


async def test_an_engine_that_pulls_takes_a_lora_push_as_its_adapter_alone(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's side against a vLLM-shaped server whose worker RPC runs the real download:
    the push is published, fetched into the server's own directory, and that directory is what
    ``/v1/load_lora_adapter`` is given; the version is served."""
    monkeypatch.setenv("APPLIANCE_ADAPTER_DIR", str(tmp_path / "server" / "adapters"))
    loads: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": 2048}]})

    async def rpc(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["method"] == "appliance_pull_adapter"
        return web.json_response({"results": [await asyncio.to_thread(pull_adapter, worker, *body["args"])]})

    async def load(request: web.Request) -> web.Response:
        loads.append(await request.json())
        return web.Response(text="ok")

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    worker = SimpleNamespace()
    server = web.Application()
    server.router.add_get("/v1/models", models)
    server.router.add_post("/collective_rpc", rpc)
    server.router.add_post("/v1/load_lora_adapter", load)
    server.router.add_post("/reset_prefix_cache", reset)
    runner = web.AppRunner(server, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{next(a[1] for a in runner.addresses if isinstance(a, tuple))}"
    try:
        async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
            source = PullSource(
                url=app.proxy_url,
                token=app.admin_token,
                publication=WeightPublication(tmp_path / "run" / "weights"),
            )
            engine = VLLMEngine(tiny_model_dir, base_url=url, lora_rank=4, pull=source)
            await engine.start()
            try:
                weights = random_adapter(tiny_model_dir, 0)
                pushed = pack_buckets(weights.tensors.items(), bucket_bytes=8192, adapter=weights.adapter)
                await engine.load_weight_buckets(stream_buckets(pushed), 1)
                assert engine.policy_version == 1 and not engine.needs_weights
                (loaded,) = loads
                assert loaded["lora_path"] == worker._appliance_adapter_dirs[-1]
                served = Path(loaded["lora_path"])
                assert served != tmp_path / "run" / "adapters" / "v1"  # the server's own copy
                for name in FILES:
                    assert (served / name).read_bytes() == (
                        tmp_path / "run" / "adapters" / "v1" / name
                    ).read_bytes()
                assert engine.last_adapter_pull is not None and engine.last_adapter_pull["version"] == 1

                # A replica that joins late catches up by pulling the adapter of the fleet's version.
                late = VLLMEngine(tiny_model_dir, base_url=url, lora_rank=4, pull=source)
                await late.start()
                try:
                    assert not await late.pull_current_adapter(7)  # nothing published at 7
                    await remote._pull_current(late, 1)
                    assert late.policy_version == 1 and len(loads) == 2
                    assert loads[1]["lora_path"] == worker._appliance_adapter_dirs[-1]
                finally:
                    await late.close()
            finally:
                await engine.close()
    finally:
        await runner.cleanup()
