"""The vLLM engine's bucketed pushes: whole weights bucket by bucket, a LoRA adapter, and the
weight group they may come over.

Owns sending each bucket of a push to the server's workers (``appliance_load_bucket`` for a
shared-memory file, ``appliance_receive_bucket`` for a broadcast over the weight group a trainer
hosts, joined by ``join_weight_group``), after checking it against the checkpoint
(``appliance.engines.weight_checks``), and undoing a push that fails half-way (the previous
version reloaded from its file where there is one, else serving waits for a push). No copy of a
bucketed version is left behind, so a server that restarts after one waits for the next push.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from appliance.engines import lora
from appliance.engines.vllm_weights import VLLMWeights
from appliance.engines.weight_checks import check_bucket
from contracts.errors import ApplianceError, BadRequest, EngineUnavailable
from trainer.buckets import TensorEntry, WeightBucket, close_stream, peek

log = logging.getLogger(__name__)

#: Seconds a ``/collective_rpc`` call that waits on the weight group may take beyond the
#: group's ``timeout_s`` (the workers' own waits are bounded by it; this covers loading the
#: bucket into the model and the HTTP round trip).
GROUP_RPC_MARGIN_S = 60.0


class VLLMBuckets(VLLMWeights):
    """``VLLMEngine``'s bucketed pushes and weight group (a part of the engine, not an engine)."""

    _group_timeout_s: float

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """Load a push bucket by bucket into the running server, once no generation runs; serve
        ``version`` after the last one. Each bucket's entries must be checkpoint names with the
        checkpoint's shapes, each at most once, and all of them must have come by the last
        bucket (a tied ``lm_head.weight`` may be left out, and is not sent if given: vLLM ties
        it). Each bucket is checked before it is sent, and the last one also for what is
        missing, so a stream that fails at its first bucket changes nothing; one that fails
        later is undone by reloading the previous version from its file, or, when the previous
        version came in buckets too, leaves the engine refusing to serve until a push completes.

        The server must hold its weights ("weights" woken): a bucket cannot wait for a wake.
        The stream is closed when the load ends; the load runs in its own task and completes if
        the caller is cancelled."""
        self._ensure_open()
        await asyncio.shield(asyncio.ensure_future(self._swap_buckets(buckets, version)))

    async def _swap_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        try:
            async with self._gate.exclusive():
                self._ensure_open()
                if self._down is not None:
                    raise EngineUnavailable(f"the vLLM server is not serving ({self._down}); retry shortly")
                if "weights" in self._released:
                    raise EngineUnavailable(
                        "the vLLM engine's weights are asleep: wake(['weights']) before pushing buckets"
                    )
                started = time.monotonic()
                first, stream = await peek(buckets)
                if first is not None and first.adapter is not None:
                    await self._swap_adapter(stream, version)
                    self.switch_times["push"] = time.monotonic() - started
                    return
                expected = await asyncio.to_thread(self._checkpoint_shapes)
                await self._send_buckets(stream, expected)
                await self._drop_adapter()
                previous, self._weights_dir = self._weights_dir, None
                self._weights_gone, self._push_pending = True, False
                self._policy_version = version
                if previous is not None:
                    await asyncio.to_thread(shutil.rmtree, previous, True)
                self.switch_times["push"] = time.monotonic() - started
        finally:
            await close_stream(buckets)

    async def _swap_adapter(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """A LoRA adapter (``appliance.engines.lora``), checked whole, written as peft files and
        loaded by the server on top of ``model_dir``'s weights (reloaded first if a whole-weights
        push replaced them). A push that fails leaves the previous adapter serving; a server that
        dies meanwhile gets the new one after its restart."""
        weights = await self._checked_adapter(buckets)
        directory = self._push_directory()
        await asyncio.to_thread(lora.write_peft_adapter, directory, weights)
        if self._weights_dir is not None or self._weights_gone:  # the base must come back first
            self._weights_dir, self._weights_gone, self._push_pending = None, False, True
        previous, self._adapter_dir, self._adapter_pending = self._adapter_dir, directory, True

        def undo() -> None:
            # The server kept the previous adapter (or, if the base reload failed, serves
            # nothing until the next push: ``_push_pending`` stays set).
            self._adapter_dir, self._adapter_pending = previous, False

        deferred = "vLLM died during a LoRA push; version %d is loaded after its restart"
        await self._sync_pushed(directory, undo, deferred, version)
        self._policy_version = version
        if previous is not None:
            await asyncio.to_thread(shutil.rmtree, previous, True)

    async def _checked_adapter(self, buckets: AsyncIterator[WeightBucket]) -> lora.AdapterWeights:
        """A LoRA adapter push, read whole and checked against the served model and the
        server's LoRA rank."""
        if self._settings.lora_rank == 0:
            raise BadRequest("this vLLM engine serves no LoRA adapters (it was started with lora_rank 0)")
        weights = await lora.collect_adapter(buckets)
        most = lora.vllm_max_lora_rank(self._settings.lora_rank)
        if weights.adapter.rank > most:
            raise BadRequest(f"a LoRA adapter of rank {weights.adapter.rank} exceeds the server's {most}")
        shapes = await asyncio.to_thread(self._checkpoint_shapes)
        linear = {
            name.removesuffix(".weight"): (shape[0], shape[1])
            for name, shape in shapes.items()
            if name.endswith(".weight") and len(shape) == 2
        }
        lora.check_adapter(weights, linear)
        return weights

    async def _send_buckets(
        self, buckets: AsyncIterator[WeightBucket], expected: dict[str, tuple[int, ...]]
    ) -> None:
        """Check and send every bucket; undo what was sent if anything fails."""
        if self._tied and "lm_head.weight" not in expected:
            expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
        required = expected.keys() - ({"lm_head.weight"} if self._tied else set())
        seen: set[str] = set()
        sent = via_group = False
        try:
            async for bucket in buckets:
                via_group = via_group or bucket.via_group
                entries = self._checked_entries(bucket, expected, seen)
                if bucket.last and (missing := required - seen):
                    raise BadRequest(
                        f"the weight buckets did not cover the served model: missing {sorted(missing)[:5]}"
                    )
                spec = {
                    "path": bucket.path,
                    "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries],
                    "first": not sent,
                    "last": bucket.last,
                }
                if bucket.via_group:
                    if not self._in_group:
                        raise EngineUnavailable("a bucket came over a weight group this server is not in")
                    # The trainer broadcasts exactly this many bytes (trainer.weight_group).
                    spec["nbytes"] = max(bucket.end, 1)
                sent, self._push_pending = True, True
                method = "appliance_receive_bucket" if bucket.via_group else "appliance_load_bucket"
                body = {"method": method, "args": [json.dumps(spec)]}
                if bucket.via_group:
                    await self._group_rpc(body, f"receiving weight bucket {bucket.index}")
                else:
                    await self._client.call("POST", "/collective_rpc", body)
                if bucket.last:
                    break
            else:
                raise BadRequest("the weight buckets ended before their last bucket")
            await self._reset_prefix_cache()
        except BaseException:
            if via_group:  # rank 0 or the workers may have given up on a broadcast
                self._in_group = False  # the next push forms a new group
            if sent:
                await self._undo_buckets()
            raise

    def _checked_entries(
        self, bucket: WeightBucket, expected: dict[str, tuple[int, ...]], seen: set[str]
    ) -> list[TensorEntry]:
        """The entries of ``bucket`` to send (a tied LM head left out), or ``BadRequest``."""
        check_bucket(bucket, expected, seen, dtypes=True)
        return [e for e in bucket.entries if not (self._tied and e.name == "lm_head.weight")]

    @property
    def in_weight_group(self) -> bool:
        """Whether this server's workers are in a weight group now (a restart leaves it)."""
        return self._in_group

    @property
    def weight_group_members(self) -> int:
        """How many members (workers) this server brings to a weight group."""
        return self._settings.tensor_parallel_size

    async def join_weight_group(self, spec: Mapping[str, Any], rank_offset: int = 1) -> None:
        """Have every worker join the weight group ``spec`` (``trainer.weight_group.GroupSpec``
        as a dict) that a trainer hosts at the same time, as ranks ``rank_offset`` and up;
        returns once the group has formed and is connected (``appliance_join_group``). Buckets
        with ``via_group`` are received over it. This call, and each bucket's, waits at most the
        group's ``timeout_s`` plus ``GROUP_RPC_MARGIN_S``."""
        self._ensure_open()
        if self._down is not None:
            raise EngineUnavailable(f"the vLLM server is not serving ({self._down}); retry shortly")
        self._in_group = False
        self._group_timeout_s = float(spec["timeout_s"])
        args = [json.dumps({**spec, "rank_offset": rank_offset})]
        await self._group_rpc({"method": "appliance_join_group", "args": args}, "joining the weight group")
        self._in_group = True

    async def _group_rpc(self, body: dict[str, Any], what: str) -> None:
        """A ``/collective_rpc`` call whose workers wait on the weight group, bounded: the
        session has no total timeout (a generation takes as long as it takes), so each such
        call gets its own. A call cut off drops its connection; the workers' own waits end
        within the group's timeout."""
        limit = self._group_timeout_s + GROUP_RPC_MARGIN_S
        try:
            async with asyncio.timeout(limit):
                await self._client.call("POST", "/collective_rpc", body)
        except TimeoutError as exc:
            raise EngineUnavailable(
                f"vLLM's workers did not finish {what} within {limit:.0f} s (the weight group's "
                f"timeout plus {GROUP_RPC_MARGIN_S:.0f} s): the group is left; the next push forms a new one"
            ) from exc

    async def _undo_buckets(self, what: str = "a bucketed weight push failed half-way") -> None:
        """After a bucketed push (or a pull, ``what``) failed half-way: end it in the server, and
        put the previous version back (``_sync_weights``). Best effort: whatever fails leaves
        ``_push_pending`` set, so nothing is served until a push completes."""
        log.warning("%s; putting version %d back", what, self._policy_version)
        try:
            await self._client.call("POST", "/collective_rpc", {"method": "appliance_abort_buckets"})
            await self._sync_weights()
        except Exception as exc:
            message = exc.message if isinstance(exc, ApplianceError) else f"{type(exc).__name__}: {exc}"
            log.error(
                "vLLM: the previous weights could not be put back (%s); serving waits for a push", message
            )
