"""The in-process engine: a transformers causal LM decoded in batches by plain torch.

Owns batching, the decode loop (left padding, KV cache, rows finishing independently),
cancellation and in-place weight swaps; the numerics of choosing tokens and their log-probs
live in ``appliance.engines.sampling``. It knows nothing about chat templates, tools or HTTP:
prompts arrive as token ids and completions leave as token ids (``appliance.engines.base``).

How it serves: ``generate`` puts a request on a queue. One background task takes whatever is
queued (up to ``max_batch_size``) as a batch and decodes it to the end in a worker thread while
new requests wait for the next batch (static batching: simple and exact, at the price of
head-of-line waiting behind a batch's longest row). Rows finish independently and leave the
batch (and its KV cache) as they do.

Invariants: the weights never change while a batch decodes (``load_weights`` and the batch
runner share one lock), so every token of a result was sampled by the ``policy_version`` it
reports; and each reported log-probability is what a teacher-forced forward pass over the
whole sequence gives at the same temperature (tested to 1e-4), which is what the trainer needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.engines.sampling import TopLogprobs, choose_tokens
from appliance.errors import BadRequest, ContextTooLong, EngineUnavailable

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Pending:
    """A request between ``generate`` and the end of its batch."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    enqueued_at: float
    loop: asyncio.AbstractEventLoop
    #: Set by the caller's side on cancellation; the decode thread polls it every step.
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True, eq=False)
class _Row:
    """Decode-thread state of one request in a running batch."""

    pending: _Pending
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    #: None while decoding; then "stop", "length" or "cancelled".
    finish: str | None = None
    finished_at: float = 0.0

    @property
    def params(self) -> SamplingParams:
        return self.pending.request.params


def _eos_ids(*values: Any) -> frozenset[int]:
    """The union of ``eos_token_id`` fields, each None, an int or a list of ints."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class TorchEngine:
    """An ``Engine`` on transformers + torch in this process (CPU by default, or CUDA).

    ``model_dir`` is anything ``AutoModelForCausalLM.from_pretrained`` loads; ``dtype`` defaults
    to the checkpoint's own; ``max_batch_size`` caps the rows decoded together; ``num_threads``,
    when given, is passed to ``torch.set_num_threads`` at start (process-wide: one thread is
    ~10x faster for tiny models on a 2-core machine); ``policy_version`` is the version of the
    weights in ``model_dir``.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 16,
        num_threads: int | None = None,
        policy_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self._model_dir = Path(model_dir)
        self._device = torch.device(device)
        self._dtype = dtype
        self._max_batch_size = max_batch_size
        self._num_threads = num_threads
        self._policy_version = policy_version
        self._model: Any = None
        self._max_context = 0
        self._vocab_size = 0
        self._pad_id = 0
        self._eos_ids: frozenset[int] = frozenset()
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        #: Held by a running batch and by a weight swap: they never overlap.
        self._lock = asyncio.Lock()
        self._runner: asyncio.Task[None] | None = None
        self._running: list[_Row] = []
        self._work: asyncio.Future[None] | None = None
        self._closed = False
        #: Sleep state: which of "weights" / "kv_cache" are released.
        self._released: set[str] = set()

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def max_context(self) -> int:
        return self._max_context

    async def start(self) -> None:
        if self._closed:
            raise EngineUnavailable("the torch engine is closed; create a new one")
        if self._runner is not None:
            return
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        self._model = await asyncio.to_thread(self._load)
        self._runner = asyncio.create_task(self._serve(), name="torch-engine-batcher")

    def _load(self) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=self._dtype or "auto")
        model.to(self._device).eval()
        config = model.config
        self._max_context = int(config.max_position_embeddings)
        self._vocab_size = int(config.vocab_size)
        # Pad ids only fill masked positions; any valid id would do.
        self._pad_id = int(config.pad_token_id) if config.pad_token_id is not None else 0
        # generation_config often lists more end-of-turn ids than config (e.g. <|im_end|>).
        self._eos_ids = _eos_ids(config.eos_token_id, model.generation_config.eos_token_id)
        return model

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        gone = EngineUnavailable("the torch engine was closed")
        for row in self._running:
            row.pending.cancelled.set()
            if not row.pending.future.done():
                row.pending.future.set_exception(gone)
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        if self._work is not None:
            # The decode thread stops at its next step (every row is cancelled); wait for it
            # so the model is not released under it.
            await asyncio.wait([self._work])
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(gone)
        self._model = None

    def _ensure_serving(self) -> None:
        if self._closed:
            raise EngineUnavailable("the torch engine is closed")
        if self._runner is None:
            raise EngineUnavailable("the torch engine has not been started")

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)

    async def sleep(self, level: int = 1) -> None:
        """Wait for the running batch, then move the weights to host memory (level 1) and
        release cached accelerator memory. The KV cache lives only while a batch runs, so
        between batches there is none to free. Level 2 is level 1 here: host memory is where
        the weights would be discarded to, and ``load_weights`` overwrites them anyway."""
        if level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {level}", param="level")
        self._ensure_serving()
        async with self._lock:
            self._released = {"weights", "kv_cache"}
            await asyncio.to_thread(self._move_weights, torch.device("cpu"))

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        self._ensure_serving()
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise BadRequest(
                f"unknown wake tags {sorted(unknown)}; use 'weights' and 'kv_cache'", param="tags"
            )
        async with self._lock:
            if "weights" in tags and "weights" in self._released:
                await asyncio.to_thread(self._move_weights, self._device)
            self._released -= set(tags)

    def _move_weights(self, device: torch.device) -> None:
        self._model.to(device)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _validate(self, request: GenerateRequest) -> None:
        params, prompt = request.params, request.prompt_ids
        if not prompt:
            raise BadRequest("the prompt is empty: send at least one token", param="prompt")
        if params.max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {params.max_tokens}", param="max_tokens")
        if len(prompt) + params.max_tokens > self._max_context:
            raise ContextTooLong(
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}, "
                f"more than the model's context of {self._max_context} tokens; "
                "shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        if min(prompt) < 0 or max(prompt) >= self._vocab_size:
            raise BadRequest(f"prompt token ids must lie in [0, {self._vocab_size})", param="prompt")
        if not (math.isfinite(params.temperature) and params.temperature >= 0):
            raise BadRequest(f"temperature must be >= 0, got {params.temperature}", param="temperature")
        if not 0 < params.top_p <= 1:
            raise BadRequest(f"top_p must lie in (0, 1], got {params.top_p}", param="top_p")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._ensure_serving()
        if self._released:
            raise EngineUnavailable("the torch engine is asleep (the machine is training); retry shortly")
        self._validate(request)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        pending = _Pending(request, future, time.monotonic(), loop)
        self._queue.put_nowait(pending)
        try:
            return await future
        except asyncio.CancelledError:
            # The future is cancelled with us, so no result can be delivered; the flag makes
            # the decode thread drop the row at its next step.
            pending.cancelled.set()
            raise

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model in place once no batch runs; serve ``version``.

        Keys and shapes must match the model's own (a tied ``lm_head.weight`` may be left out).
        The swap runs in its own task: if the caller is cancelled, it still completes.
        """
        self._ensure_serving()
        weights = self._checked_weights(state_dict)
        await asyncio.shield(asyncio.ensure_future(self._swap(weights, version)))

    def _checked_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights = dict(state_dict)
        tied = "lm_head.weight", "model.embed_tokens.weight"
        if self._model.config.tie_word_embeddings and tied[0] not in weights and tied[1] in weights:
            weights[tied[0]] = weights[tied[1]]
        own = self._model.state_dict()
        missing, unexpected = own.keys() - weights.keys(), weights.keys() - own.keys()
        misshapen = [k for k in own.keys() & weights.keys() if own[k].shape != weights[k].shape]
        if missing or unexpected or misshapen:
            raise BadRequest(
                "the state dict does not fit the served model: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}, "
                f"wrong shapes {sorted(misshapen)[:5]}"
            )
        return weights

    async def _swap(self, weights: dict[str, torch.Tensor], version: int) -> None:
        async with self._lock:
            self._ensure_serving()
            await asyncio.to_thread(self._copy_weights, weights)
            self._policy_version = version

    def _copy_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # load_state_dict copies into the existing parameters (converting dtype and device),
        # so nothing holding a reference to them, nor the model's memory, changes.
        with torch.no_grad():
            self._model.load_state_dict(weights, strict=True)

    async def _serve(self) -> None:
        """The batch runner: take what is queued, decode it to the end, deliver, repeat."""
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]
            if not batch:
                continue
            async with self._lock:
                version = self._policy_version
                started = time.monotonic()
                rows = [self._new_row(p) for p in batch]
                self._running = rows
                self._work = asyncio.ensure_future(asyncio.to_thread(self._decode, rows))
                try:
                    await asyncio.shield(self._work)
                except Exception as exc:
                    log.exception("torch engine: a batch of %d failed", len(rows))
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                finally:
                    self._running = []
            for row in rows:
                if row.finish in ("stop", "length") and not row.pending.future.done():
                    row.pending.future.set_result(
                        GenerateResult(
                            token_ids=tuple(row.token_ids),
                            logprobs=tuple(row.logprobs),
                            finish_reason=row.finish,
                            policy_version=version,
                            queue_s=started - row.pending.enqueued_at,
                            gen_s=row.finished_at - started,
                            top_logprobs=tuple(row.top_logprobs),
                        )
                    )

    def _new_row(self, pending: _Pending) -> _Row:
        params = pending.request.params
        generator = None
        if params.seed is not None:
            # A private stream per request: the same seed gives the same sample whatever else
            # shares the batch. Unseeded rows draw from torch's global generator.
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        stop_ids = frozenset(params.stop_token_ids) or self._eos_ids
        return _Row(pending=pending, stop_ids=stop_ids, generator=generator)

    def _decode(self, rows: list[_Row]) -> None:
        """Decode ``rows`` until each stops, hits its length or is cancelled (worker thread)."""
        with torch.inference_mode():
            self._decode_loop(rows)

    def _decode_loop(self, rows: list[_Row]) -> None:
        device, model = self._device, self._model
        prompts = [list(r.pending.request.prompt_ids) for r in rows]
        width = max(len(p) for p in prompts)
        # Left padding: every row's last prompt token sits in the last column, so one forward
        # gives each row's next-token logits at position -1 and new tokens append in lockstep.
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        # Positions count real tokens only, so a padded row sees exactly the positions (and
        # hence rotary phases) it would see alone; pads get 0 and are masked anyway.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        live = list(rows)
        while True:
            tokens = self._advance(out.logits[:, -1, :], live)
            keep = [j for j, row in enumerate(live) if row.finish is None]
            if not keep:
                return
            if len(keep) < len(live):
                # Finished and cancelled rows leave the batch and the KV cache.
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                mask, next_pos, tokens = mask[index], next_pos[index], tokens[index]
                live = [live[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1

    @staticmethod
    def _advance(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Choose each row's next token, record it with its log-prob, mark rows that end.

        Returns the chosen ids (rows,) on the logits' device, to feed the next step.
        """
        params = [r.params for r in rows]
        tokens, logprobs, tops = choose_tokens(
            logits,
            [p.temperature for p in params],
            [p.top_p for p in params],
            [r.generator for r in rows],
            [p.top_logprobs for p in params],
        )
        now = time.monotonic()
        for row, token, logprob, top in zip(rows, tokens, logprobs, tops, strict=True):
            if row.pending.cancelled.is_set():
                row.finish = "cancelled"
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if top:
                row.top_logprobs.append(top)
            on_token = row.pending.request.on_token
            if on_token is not None:
                row.pending.loop.call_soon_threadsafe(on_token, token, logprob)
            if token in row.stop_ids:
                row.finish, row.finished_at = "stop", now
            elif len(row.token_ids) >= row.params.max_tokens:
                row.finish, row.finished_at = "length", now
        return torch.tensor(tokens, dtype=torch.long, device=logits.device)
