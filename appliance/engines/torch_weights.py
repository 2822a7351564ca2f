"""The torch engine's weights: where they are while it sleeps, and loading new ones in place.

Owns moving the parameters aside (level-1 sleep), dropping and re-creating their storage
(level 2), and the three ways weights arrive: a whole state dict (``load_weights``), a stream
of buckets copied tensor by tensor out of their shared-memory files (``load_weight_buckets``),
and a LoRA adapter pushed alone, served on ``model_dir``'s weights (``appliance.engines.lora``).
Every load waits for ``TorchEngine``'s exclusive access (no row decodes while weights change)
and is checked (``appliance.engines.weight_checks``) before anything is copied; a bucketed load
that fails after its first copy leaves the engine refusing to serve until a load completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from appliance.engines import lora
from appliance.engines.served import ServedState
from appliance.engines.weight_checks import check_bucket, check_state_dict
from contracts.errors import BadRequest, EngineUnavailable
from trainer.buckets import LoraAdapter, WeightBucket, bucket_tensors, close_stream, peek

log = logging.getLogger(__name__)


class TorchWeights(ServedState):
    """``TorchEngine``'s weight handling (a part of the engine, not an engine: the fields below
    are ``TorchEngine``'s, set when it is made and loaded)."""

    _model: Any
    _device: torch.device
    _model_dir: Path
    _shapes: dict[str, torch.Size]
    _weights_discarded: bool
    _needs_weights: bool
    _base_weights: bool

    if TYPE_CHECKING:

        def _ensure_serving(self) -> None: ...

        def _exclusive_access(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    def _offload_weights(self) -> None:
        self._model.to("cpu")
        self._free_cached_memory()

    def _discard_weights(self) -> None:
        # Empty storages instead of the meta device: `.data` cannot move to meta, and replacing
        # the parameters would untie lm_head from the embeddings and drop non-persistent buffers
        # (rotary inv_freq) that load_weights cannot restore.
        for param in self._model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._weights_discarded = self._needs_weights = True
        # A wake gives them fresh storage, not model_dir's values: an adapter needs them read again.
        self._base_weights = False
        self._free_cached_memory()

    def _place_weights(self, device: torch.device) -> None:
        """Put the weights on ``device``; discarded ones get fresh (uninitialised) storage."""
        if self._weights_discarded:
            shapes = {id(p): self._shapes[name] for name, p in self._model.named_parameters()}
            for param in self._model.parameters():
                param.data = torch.empty(shapes[id(param)], dtype=param.dtype, device=device)
            self._weights_discarded = False
        self._model.to(device)

    def _free_cached_memory(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model in place once no row runs; serve ``version``.

        Keys and shapes must match the model's own (a tied ``lm_head.weight`` may be left out).
        Requests queued meanwhile start after the swap, with the new weights. The swap runs in
        its own task: if the caller is cancelled, it still completes.
        """
        self._ensure_serving()
        weights = self._checked_weights(state_dict)
        await asyncio.shield(asyncio.ensure_future(self._swap(weights, version)))

    def _checked_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights = dict(state_dict)
        tied = "lm_head.weight", "model.embed_tokens.weight"
        if self._model.config.tie_word_embeddings and tied[0] not in weights and tied[1] in weights:
            weights[tied[0]] = weights[tied[1]]
        check_state_dict(self._shapes, weights)
        return weights

    async def _swap(self, weights: dict[str, torch.Tensor], version: int) -> None:
        async with self._exclusive_access():
            await asyncio.to_thread(self._copy_weights, weights)
            self._policy_version = version
            self._needs_weights = False

    def _copy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        lora.detach(self._model)
        self._base_weights = False
        if self._weights_discarded:
            # Asleep at level 2 and not woken yet: give them storage where level 1 keeps them.
            self._place_weights(torch.device("cpu") if self._released else self._device)
        # load_state_dict copies into the existing parameters (converting dtype and device),
        # so nothing holding a reference to them, nor the model's memory, changes.
        with torch.no_grad():
            self._model.load_state_dict(weights, strict=True)

    async def load_weight_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        """Copy each bucket's tensors into the model in place, once no row runs; serve ``version``
        after the last one. Names and shapes must be the model's own, each at most once, and
        every one must have come by the last bucket (a tied ``lm_head.weight`` may be left out).

        Each bucket is checked whole before any of it is copied: a bad first bucket leaves the
        old weights serving. A failure after that (a later bad bucket, a stream that ends or
        raises before its last bucket, parameters missing at the end) leaves a mix of old and new
        weights: the engine then refuses to generate until a load completes. The stream is closed
        when the load ends (``aclose``, where it has one). Like ``load_weights``, the load runs
        in its own task and completes if the caller is cancelled.
        """
        self._ensure_serving()
        await asyncio.shield(asyncio.ensure_future(self._swap_buckets(buckets, version)))

    async def _swap_buckets(self, buckets: AsyncIterator[WeightBucket], version: int) -> None:
        async with self._exclusive_access():
            try:
                first, stream = await peek(buckets)
                if first is not None and first.adapter is not None:
                    await self._swap_adapter(stream)
                else:
                    await self._copy_buckets(stream)
            finally:
                await close_stream(buckets)
            self._policy_version = version
            self._needs_weights = False

    async def _copy_buckets(self, buckets: AsyncIterator[WeightBucket]) -> None:
        """Whole weights, bucket by bucket, into the parameters (in place)."""
        if self._weights_discarded:
            place = torch.device("cpu") if self._released else self._device
            await asyncio.to_thread(self._place_weights, place)
        # The parameters and persistent buffers themselves (not detached copies).
        targets: dict[str, torch.Tensor] = self._model.state_dict(keep_vars=True)
        seen: set[str] = set()
        copied = False
        try:
            async for bucket in buckets:
                if bucket.via_group:
                    raise BadRequest(
                        "the torch engine takes weight buckets in files, not over a weight group"
                    )
                check_bucket(bucket, self._shapes, seen)
                if not copied:
                    lora.detach(self._model)
                    self._base_weights = False
                copied = True
                await asyncio.to_thread(self._copy_bucket, bucket, targets)
                if bucket.last:
                    break
            else:
                raise BadRequest("the weight buckets ended before their last bucket")
            missing = self._shapes.keys() - seen - self._optional_names()
            if missing:
                raise BadRequest(
                    f"the weight buckets did not cover the served model: missing {sorted(missing)[:5]}"
                )
        except BaseException:
            if copied:
                # Some parameters are new, others old: serving that mix would sample from
                # a policy no version describes.
                self._needs_weights = True
                log.error("torch engine: a bucketed load failed half-way; it serves again after a load")
            raise

    async def _swap_adapter(self, buckets: AsyncIterator[WeightBucket]) -> None:
        """A LoRA adapter (``appliance.engines.lora``), checked whole before anything changes,
        served on top of ``model_dir``'s weights (read again if they were replaced or dropped)."""
        weights = await lora.collect_adapter(buckets)
        pairs = lora.check_adapter(weights, lora.linear_shapes(self._model))
        await asyncio.to_thread(self._attach_adapter, weights.adapter, pairs)

    def _attach_adapter(
        self, adapter: LoraAdapter, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        if self._weights_discarded or not self._base_weights:
            self._load_base_weights()
        lora.attach(self._model, adapter, pairs)

    def _load_base_weights(self) -> None:
        """``model_dir``'s weights back into the parameters, one safetensors file at a time."""
        if self._weights_discarded:
            self._place_weights(torch.device("cpu") if self._released else self._device)
        lora.detach(self._model)
        targets: dict[str, torch.Tensor] = self._model.state_dict(keep_vars=True)
        seen: set[str] = set()
        with torch.no_grad():
            for path in sorted(self._model_dir.glob("*.safetensors")):
                # A tensor at a time, from the file's mapping: never a second copy of the model.
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        if name in targets:
                            targets[name].copy_(handle.get_tensor(name))
                            seen.add(name)
        missing = self._shapes.keys() - seen - self._optional_names()
        if missing:
            self._needs_weights = True
            raise EngineUnavailable(
                f"{self._model_dir} lacks weights of the served model: {sorted(missing)[:5]}"
            )
        self._base_weights = True

    def _optional_names(self) -> set[str]:
        """Names a load may leave out: the LM head tied to the embedding (they share a tensor)."""
        return {"lm_head.weight"} if self._model.config.tie_word_embeddings else set()

    @staticmethod
    def _copy_bucket(bucket: WeightBucket, targets: dict[str, torch.Tensor]) -> None:
        # copy_ converts dtype and device; the views read the bucket's file without a copy.
        with torch.no_grad():
            for name, tensor in bucket_tensors(bucket):
                targets[name].copy_(tensor)
