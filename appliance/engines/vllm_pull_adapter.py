"""A LoRA run's adapter for a vLLM server that pulls its weights over HTTP.

Owns the adapter half of the HTTP pull: a push of an adapter alone (``appliance.engines.lora``)
is checked as for a local load, published as peft files (``adapter_publication``, beside the
whole weights' publication), downloaded by the server's worker into a directory of its own
(``/collective_rpc`` -> ``appliance_pull_adapter``, ``vllm_adapter_fetch``, SHA-256 checked) and
loaded from there through ``/v1/load_lora_adapter``, as a local push's files are. The files are
the adapter alone: a 7B model's rank-16 adapter is about 40 MB where its weights are 14 GB.

A pull that fails leaves the previous adapter serving. A replica that joins a LoRA run late, or
comes back, catches up by pulling the adapter of the fleet's version (``pull_current_adapter``).
The directory named to vLLM is the server's, on its own machine: the worker keeps its newest two
and removes older ones itself.
Whole weights by HTTP pull are ``appliance.engines.vllm_pull``'s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from appliance.engines.adapter_publication import AdapterPublication, adapters_beside
from appliance.engines.vllm_buckets import VLLMBuckets
from contracts.errors import ApplianceError, EngineUnavailable
from trainer.buckets import WeightBucket


class _Published(Protocol):
    @property
    def root(self) -> Path: ...


class AdapterSource(Protocol):
    """Where the server pulls from (``vllm_pull.PullSource``): the appliance's URL and admin
    token, the whole weights' publication (the adapters go beside it), and how to fetch."""

    @property
    def url(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def publication(self) -> _Published: ...
    @property
    def retries(self) -> int: ...
    @property
    def backoff_s(self) -> float: ...
    @property
    def timeout_s(self) -> float: ...


class VLLMPullAdapter(VLLMBuckets):
    """``VLLMEngine``'s adapter pulls (a part of the engine, not an engine)."""

    #: Where the server pulls from (None: it takes pushes through shared memory).
    _pull: Any

    #: What the last adapter pull reported (version, path, bytes, seconds).
    last_adapter_pull: dict[str, Any] | None = None

    async def _pull_adapter(
        self, pull: AdapterSource, buckets: AsyncIterator[WeightBucket], version: int
    ) -> None:
        """Check and publish the adapter push ``buckets`` as ``version``, then have the server
        fetch and serve it."""
        started = time.monotonic()
        weights = await self._checked_adapter(buckets)
        publication = AdapterPublication(adapters_beside(pull.publication.root))
        manifest = await asyncio.to_thread(publication.publish, weights, version)
        await self._serve_adapter(pull, manifest)
        self.switch_times["push"] = time.monotonic() - started

    async def pull_current_adapter(self, version: int) -> bool:
        """A LoRA run's catch-up: have the server pull and serve adapter ``version`` if it is
        published and not served yet; whether it serves it now (False: not published, or this
        engine takes pushes through shared memory)."""
        self._ensure_open()
        pull = self._pull
        if pull is None:
            return False
        if version == self._policy_version and not self._adapter_pending and self._adapter_dir is not None:
            return True
        publication = AdapterPublication(adapters_beside(pull.publication.root))
        manifest = await asyncio.to_thread(publication.manifest, version)
        if manifest is None:
            return False
        await self._serve_adapter(pull, manifest)
        return True

    async def _serve_adapter(self, pull: AdapterSource, manifest: dict[str, Any]) -> None:
        """Have the server's worker fetch the published adapter ``manifest`` describes into a
        directory of its own, and serve it from there."""
        version = int(manifest["version"])
        spec = {
            "url": pull.url,
            "token": pull.token,
            "version": version,
            "files": manifest["files"],
            "retries": pull.retries,
            "backoff_s": pull.backoff_s,
            "timeout_s": pull.timeout_s,
        }
        async with self._gate.exclusive():
            self._ensure_open()
            if self._down is not None:
                raise EngineUnavailable(f"the vLLM server is not serving ({self._down}); retry shortly")
            body = {"method": "appliance_pull_adapter", "args": [json.dumps(spec)]}
            try:
                answer = await self._client.call("POST", "/collective_rpc", body)
            except ApplianceError as exc:
                raise EngineUnavailable(
                    f"the vLLM server did not pull LoRA adapter v{version} from {pull.url}: {exc.message}"
                ) from exc
            fetched = dict(answer["results"][0])
            previous = self._adapter_dir
            self._adapter_dir, self._adapter_pending = Path(fetched["path"]), True
            try:
                await self._sync_weights()  # /v1/load_lora_adapter from the server's directory
            except BaseException:
                self._adapter_dir, self._adapter_pending = previous, False
                raise
            self._policy_version = version
        self.last_adapter_pull = {"version": version, **fetched}
