"""The in-process engine: a transformers causal LM decoded with continuous batching by plain torch.

Owns admission, the decode loop (left padding, one KV cache for all running rows, rows joining
and leaving between steps), cancellation, sleep/wake and in-place weight swaps; the numerics of
choosing tokens and their log-probs live in ``appliance.engines.sampling``. It knows nothing
about chat templates, tools or HTTP: prompts arrive as token ids and completions leave as token
ids (``appliance.engines.base``).

How it serves: ``generate`` appends a request to an inbox. While anything is queued or running,
one worker thread runs the step loop: before each decode step it admits queued requests (up to
``max_batch_size`` running rows), prefills them together as their own left-padded batch, and
merges their KV cache into the running one; then one forward pass advances every running row
by a token. A request that arrives during a long generation therefore starts at the next step
instead of waiting for the batch to end, and each row's result is delivered the moment it ends.

Why not transformers' own continuous batching (``ContinuousBatchingManager``, 5.10): it decides
greedy vs sampling for the whole manager, draws with the global generator (no per-request seed),
reports log-probs of the *processed* distribution (after top-p), has no top-logprobs, and owns
its own thread and paged cache, which a weight swap would have to stop from outside. The
trainer needs the log-probs of the unfiltered tempered policy, so this engine keeps its own loop.

Joining, numerically: all rows share one cache laid out (rows, heads, width, head_dim) with
left padding. Merging two batches left-pads the narrower cache with zero keys/values and zero
mask columns, then concatenates the rows. Masked columns get zero attention weight and each row
keeps its own position ids (rotary phases), so a row's logits are those it would get alone, up
to float summation order (greedy ids equal; log-probs within 1e-5, tested). Leading columns that
no running row uses any more are cut off after rows leave. Models whose cache layers are not
plain full-attention ``DynamicLayer`` s (sliding windows, linear attention) are not merged:
newcomers then wait until the running batch is empty (static batching).

Failures: nothing admitted is ever left waiting. A request that cannot be made a row (a value
``_validate`` missed) fails alone with ``BadRequest``; a prefill of several newcomers that raises
is retried one by one, so only the request that fails alone fails (``EngineUnavailable``); a
decode step that raises fails every row of the batch (its cache is suspect) and the engine serves
on. Errors reach callers through their event loop (``call_soon_threadsafe``), never directly from
the worker thread.

Weights arrive whole (``load_weights``: a state dict, loaded with ``load_state_dict``) or as a
stream of buckets (``load_weight_buckets``: each bucket's tensors are viewed in place in its
shared-memory file and copied into the parameters, so no second copy of the model is built).
A bucketed load checks each bucket before copying any of it; one that fails after the first
copy leaves a mix of old and new weights, so the engine refuses to serve until a load completes.
A push of a LoRA adapter (buckets marked with their ``LoraAdapter``) is collected and checked
whole, then served on ``model_dir``'s weights (``appliance.engines.lora``: read back first if
whole weights replaced them or a level-2 sleep dropped them); a bad one changes nothing.

Invariants: the weights never change while a row decodes (a swap, sleep or wake stops admission,
waits for the running rows to finish, and holds the lock the step loop holds), so every token of
a result was sampled by the ``policy_version`` it reports; and each reported log-probability is
what a teacher-forced forward pass over the whole sequence gives at the same temperature
(tested to 1e-4), which is what the trainer needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from appliance.engines import lora
from appliance.engines.base import (
    MIN_TOP_P,
    SEED_MAX,
    SEED_MIN,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    validate_request,
)
from appliance.engines.buckets import LoraAdapter, WeightBucket, bucket_tensors, close_stream, peek
from appliance.engines.constraints import PARAM, GrammarCompiler, Guide, mask_logits
from appliance.engines.sampling import TopLogprobs, choose_tokens
from appliance.errors import ApplianceError, BadRequest, EngineUnavailable

log = logging.getLogger(__name__)

#: ``from_pretrained`` sets process-wide state while it loads (the default device: meta), so two
#: engines of one process (an engine fleet's replicas) load one after the other.
_LOADING = threading.Lock()


@dataclass(slots=True, eq=False)
class _Pending:
    """A request between ``generate`` and its result."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    enqueued_at: float
    loop: asyncio.AbstractEventLoop
    #: Set by the caller's side on cancellation; the step loop polls it every step.
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True, eq=False)
class _Row:
    """Step-loop state of one admitted request."""

    pending: _Pending
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    version: int
    started_at: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    #: The grammar the row's text must match (None: unconstrained).
    guide: Guide | None = None
    #: The prompt's scores, when the request asks for them (set by the prefill).
    prompt_logprobs: tuple[float | None, ...] = ()
    prompt_top_logprobs: tuple[TopLogprobs, ...] = ()
    #: None while decoding; then "stop", "length", "cancelled" or "error" (its grammar broke).
    finish: str | None = None
    finished_at: float = 0.0

    @property
    def params(self) -> SamplingParams:
        return self.pending.request.params


@dataclass(slots=True, eq=False)
class _Batch:
    """Rows decoding together: their KV cache, mask (rows, width), next positions (rows,) and
    the tokens chosen last, to be fed at the next step (rows,). Every row is unfinished."""

    rows: list[_Row]
    cache: DynamicCache
    mask: torch.Tensor
    next_pos: torch.Tensor
    tokens: torch.Tensor


def _eos_ids(*values: Any) -> frozenset[int]:
    """The union of ``eos_token_id`` fields, each None, an int or a list of ints."""
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _score_prompt(row: _Row, logits: torch.Tensor, prompt: list[int]) -> None:
    """Set ``row``'s prompt scores from the prefill's ``logits`` (len(prompt), vocab) at its
    prompt's positions: log p(prompt[j] | prompt[:j]) under the raw model distribution
    (log_softmax of the logits, temperature 1: no temperature, top-p or grammar applies to a
    prompt), with the k most likely tokens at each position; nothing for the first token."""
    k = row.pending.request.prompt_logprobs or 0
    # Position j - 1 predicts token j.
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
    row.prompt_logprobs = (None, *(float(v) for v in chosen))
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        tops = (tuple((int(t), float(v)) for t, v in zip(i, x, strict=True)) for i, x in pairs)
        row.prompt_top_logprobs = ((), *tops)
    else:
        row.prompt_top_logprobs = tuple(() for _ in prompt)


def _set_exception(future: asyncio.Future[GenerateResult], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _fault(doing: str, exc: BaseException) -> EngineUnavailable:
    """The retryable error a caller gets when the engine itself failed while ``doing``."""
    error = EngineUnavailable(f"the torch engine failed while {doing} ({type(exc).__name__}: {exc}); retry")
    error.__cause__ = exc
    return error


def _left_pad_columns(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, each with ``keys`` and ``values`` (rows, heads, width, head_dim)."""
    return list(cache.layers)


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """One batch of ``a``'s rows then ``b``'s, both left-padded to the wider cache."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    for la, lb in zip(_kv_layers(a.cache), _kv_layers(b.cache), strict=True):
        # (rows, heads, width, head_dim): zero keys/values at masked columns never contribute.
        la.keys = torch.cat([_left_pad_columns(la.keys, width, 2), _left_pad_columns(lb.keys, width, 2)])
        la.values = torch.cat(
            [_left_pad_columns(la.values, width, 2), _left_pad_columns(lb.values, width, 2)]
        )
    return _Batch(
        rows=a.rows + b.rows,
        cache=a.cache,
        mask=torch.cat([_left_pad_columns(a.mask, width, 1), _left_pad_columns(b.mask, width, 1)]),
        next_pos=torch.cat([a.next_pos, b.next_pos]),
        tokens=torch.cat([a.tokens, b.tokens]),
    )


def _compact(batch: _Batch) -> _Batch | None:
    """Drop finished rows (and their cache) and leading columns no row uses; None if empty."""
    keep = [j for j, row in enumerate(batch.rows) if row.finish is None]
    if not keep:
        return None
    if len(keep) < len(batch.rows):
        index = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
        batch.cache.batch_select_indices(index)
        batch.rows = [batch.rows[j] for j in keep]
        batch.mask, batch.next_pos, batch.tokens = (
            batch.mask[index],
            batch.next_pos[index],
            batch.tokens[index],
        )
        used = batch.mask.any(dim=0)
        first = int(used.int().argmax())  # the first column some row attends to
        if first > 0:
            batch.mask = batch.mask[:, first:]
            for layer in _kv_layers(batch.cache):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
    return batch


class TorchEngine:
    """An ``Engine`` on transformers + torch in this process (CPU by default, or CUDA).

    ``model_dir`` is anything ``AutoModelForCausalLM.from_pretrained`` loads; ``dtype`` defaults
    to the checkpoint's own; ``max_batch_size`` caps the rows decoded together; ``num_threads``,
    when given, is passed to ``torch.set_num_threads`` at start (process-wide: one thread is
    ~10x faster for tiny models on a 2-core machine); ``policy_version`` is the version of the
    weights in ``model_dir``.

    Sleep: level 1 moves the weights to host memory (a no-op on CPU) and frees cached CUDA
    memory; level 2 discards them (each parameter keeps its identity, ties included, with an
    empty storage), so after ``wake`` generation is refused until ``load_weights``. Requests
    still queued when the engine falls asleep fail with ``EngineUnavailable`` (retryable).
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
        #: Whether newcomers may be merged into a running batch (plain full-attention cache).
        self._joinable = False
        #: Parameter shapes, kept while level-2 sleep empties the parameters.
        self._shapes: dict[str, torch.Size] = {}
        #: Appended on the event loop, popped by the step loop (deque ops are thread-safe).
        self._inbox: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        #: Held by the step loop while it runs and by swaps, sleep and wake: they never overlap.
        self._lock = asyncio.Lock()
        #: Operations waiting for the lock; while > 0 the step loop admits nobody and drains.
        self._exclusive = 0
        self._stopping = threading.Event()
        self._runner: asyncio.Task[None] | None = None
        #: The rows admitted and not yet finished (replaced, never mutated, by the step loop).
        self._running: list[_Row] = []
        self._work: asyncio.Future[None] | None = None
        self._closed = False
        #: Sleep state: which of "weights" / "kv_cache" are released, and where the weights are.
        self._released: set[str] = set()
        self._weights_discarded = False
        self._needs_weights = False
        #: Whether the parameters are ``model_dir``'s (what a LoRA adapter is served on top of).
        self._base_weights = True
        #: Built by the step loop for the first constrained request (reading the vocabulary
        #: takes ~1 s on a large one), then used by it alone.
        self._grammars: GrammarCompiler | None = None

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
        self._runner = asyncio.create_task(self._serve(), name="torch-engine-steps")

    def _load(self) -> Any:
        with _LOADING:
            model: Any = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=self._dtype or "auto")
        model.to(self._device).eval()
        config = model.config
        self._max_context = int(config.max_position_embeddings)
        self._vocab_size = int(config.vocab_size)
        # Pad ids only fill masked positions; any valid id would do.
        self._pad_id = int(config.pad_token_id) if config.pad_token_id is not None else 0
        # generation_config often lists more end-of-turn ids than config (e.g. <|im_end|>).
        self._eos_ids = _eos_ids(config.eos_token_id, model.generation_config.eos_token_id)
        self._joinable = all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
        self._shapes = {k: v.shape for k, v in model.state_dict().items()}
        return model

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        work = self._work
        gone = EngineUnavailable("the torch engine was closed")
        for row in self._running:
            row.pending.cancelled.set()
            if not row.pending.future.done():
                row.pending.future.set_exception(gone)
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        if work is not None:
            # The step loop stops at its next step; wait so the model is not released under it.
            await asyncio.wait([work])
        self._fail_queued(gone)
        self._model = None

    def _fail_queued(self, error: Exception) -> None:
        while self._inbox:
            pending = self._inbox.popleft()
            if not pending.future.done():
                pending.future.set_exception(error)

    def _ensure_serving(self) -> None:
        if self._closed:
            raise EngineUnavailable("the torch engine is closed")
        if self._runner is None:
            raise EngineUnavailable("the torch engine has not been started")

    @contextlib.asynccontextmanager
    async def _exclusive_access(self) -> AsyncIterator[None]:
        """Stop admission, wait for the running rows to finish, and hold the lock."""
        self._exclusive += 1
        try:
            async with self._lock:
                self._ensure_serving()
                yield
        finally:
            self._exclusive -= 1
            self._wakeup.set()  # requests queued meanwhile may start now

    @property
    def needs_weights(self) -> bool:
        return self._needs_weights and not self._released and not self._closed

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot serve whatever it is asked (closed, not started); None once
        started. Sleep and ``needs_weights`` are reported apart."""
        if self._closed:
            return "closed"
        return "not started" if self._runner is None else None

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)

    async def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {level}", param="level")
        self._ensure_serving()
        async with self._exclusive_access():
            self._released = {"weights", "kv_cache"}
            self._fail_queued(EngineUnavailable("the torch engine went to sleep (the machine trains); retry"))
            # The KV cache lives only while rows run, and none do: nothing else to free.
            await asyncio.to_thread(self._discard_weights if level == 2 else self._offload_weights)

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        self._ensure_serving()
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise BadRequest(
                f"unknown wake tags {sorted(unknown)}; use 'weights' and 'kv_cache'", param="tags"
            )
        async with self._exclusive_access():
            if "weights" in tags and "weights" in self._released:
                await asyncio.to_thread(self._place_weights, self._device)
            self._released -= set(tags)

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

    def _validate(self, request: GenerateRequest) -> None:
        """Every field against the contract's ranges (``BadRequest`` naming it), so that nothing
        the step loop is handed can fail there because of one request's values."""
        validate_request(request, max_context=self._max_context, vocab_size=self._vocab_size)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._ensure_serving()
        if self._released:
            raise EngineUnavailable("the torch engine is asleep (the machine is training); retry shortly")
        if self._needs_weights:
            raise EngineUnavailable(
                "the torch engine has no complete weights (sleep(2) discarded them, or a bucketed "
                "load failed half-way); load_weights or load_weight_buckets first"
            )
        self._validate(request)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        pending = _Pending(request, future, time.monotonic(), loop)
        self._inbox.append(pending)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            # The future is cancelled with us, so no result can be delivered; the flag makes
            # the step loop drop the row at its next step (or skip it if still queued).
            pending.cancelled.set()
            raise

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
        own = self._shapes
        missing, unexpected = own.keys() - weights.keys(), weights.keys() - own.keys()
        misshapen = [k for k in own.keys() & weights.keys() if own[k] != weights[k].shape]
        if missing or unexpected or misshapen:
            raise BadRequest(
                "the state dict does not fit the served model: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}, "
                f"wrong shapes {sorted(misshapen)[:5]}"
            )
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
                self._check_bucket(bucket, seen)
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

    def _check_bucket(self, bucket: WeightBucket, seen: set[str]) -> None:
        """Every entry of ``bucket`` names a tensor of the model once, with its shape; adds them
        to ``seen``. Raises ``BadRequest`` before anything is copied."""
        own = self._shapes
        names = Counter(entry.name for entry in bucket.entries)
        unexpected = [name for name in names if name not in own]
        repeated = sorted(name for name, count in names.items() if name in seen or count > 1)
        misshapen = [e.name for e in bucket.entries if e.name in own and tuple(own[e.name]) != e.shape]
        if unexpected or repeated or misshapen:
            raise BadRequest(
                f"weight bucket {bucket.index} does not fit the served model: "
                f"unexpected {sorted(unexpected)[:5]}, repeated {repeated[:5]}, "
                f"wrong shapes {sorted(misshapen)[:5]}"
            )
        seen.update(names)

    @staticmethod
    def _copy_bucket(bucket: WeightBucket, targets: dict[str, torch.Tensor]) -> None:
        # copy_ converts dtype and device; the views read the bucket's file without a copy.
        with torch.no_grad():
            for name, tensor in bucket_tensors(bucket):
                targets[name].copy_(tensor)

    async def _serve(self) -> None:
        """Start the step loop whenever requests are queued and nothing holds the engine."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._inbox or self._exclusive or self._released:
                continue
            async with self._lock:
                self._work = asyncio.ensure_future(asyncio.to_thread(self._run))
                try:
                    # ``_run`` fails its own rows on any error, so the engine serves on.
                    await asyncio.shield(self._work)
                finally:
                    self._running = []
            if self._inbox:
                self._wakeup.set()  # left behind by a drain; admitted once it is over

    def _admitting(self) -> bool:
        return self._exclusive == 0 and not self._stopping.is_set()

    def _run(self) -> None:
        """The step loop (worker thread): admit, prefill and merge newcomers, step; repeat
        until nothing runs and nothing may be admitted.

        Every row it admits ends with its result or an error delivered: a decode step (or a
        merge) that raises fails every running row, and the loop returns, to be started afresh
        by ``_serve`` for whatever is queued; a loop stopped by ``close`` fails what still runs.
        """
        try:
            with torch.inference_mode():
                self._steps()
        except Exception as exc:
            log.exception("torch engine: a decode step failed with %d rows; they fail", len(self._running))
            self._fail_running(_fault("generating", exc))
        finally:
            self._fail_running(EngineUnavailable("the torch engine was closed"))

    def _steps(self) -> None:
        """The loop itself; ``_running`` always holds every row admitted and not yet finished."""
        batch: _Batch | None = None
        while not self._stopping.is_set():
            running = batch.rows if batch is not None else []
            if batch is None or self._joinable:
                newcomers = self._admit(self._max_batch_size - len(running))
                if newcomers:
                    self._running = running + newcomers
                    fresh = self._prefill_isolated(newcomers)
                    self._running = running + (fresh.rows if fresh is not None else [])
                    if fresh is not None:
                        batch = fresh if batch is None else _merge(batch, fresh)
            if batch is None:
                self._running = []
                if self._inbox and self._admitting():
                    continue
                return
            batch = self._step(batch)
            self._running = batch.rows if batch is not None else []

    def _fail_running(self, error: Exception) -> None:
        """Fail every row still running (those already delivered are left alone)."""
        rows, self._running = self._running, []
        for row in rows:
            self._fail(row.pending, error)

    @staticmethod
    def _fail(pending: _Pending, error: Exception) -> None:
        """Deliver ``error`` to ``pending``'s caller from the worker thread, after any result
        or token already queued for it (so a delivered result is never overwritten)."""
        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits any more
            pending.loop.call_soon_threadsafe(_set_exception, pending.future, error)

    def _admit(self, room: int) -> list[_Row]:
        """Up to ``room`` queued requests as rows; one that cannot be made a row fails alone."""
        rows: list[_Row] = []
        while len(rows) < room and self._inbox and self._admitting():
            pending = self._inbox.popleft()
            if not pending.cancelled.is_set() and (row := self._row_or_fail(pending)) is not None:
                rows.append(row)
        return rows

    def _row_or_fail(self, pending: _Pending) -> _Row | None:
        try:
            return self._new_row(pending)
        except ApplianceError as exc:
            log.warning("torch engine: a request passed validation but was refused: %s", exc.message)
            self._fail(pending, exc)
        except Exception as exc:
            log.exception("torch engine: admitting a request failed")
            self._fail(pending, _fault("admitting the request", exc))
        return None

    def _new_row(self, pending: _Pending) -> _Row:
        params = pending.request.params
        generator = None
        if params.seed is not None:
            # A private stream per request: the same seed gives the same sample whatever else
            # shares the batch. Unseeded rows draw from torch's global generator.
            generator = torch.Generator(device=self._device)
            try:
                generator.manual_seed(params.seed)
            except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
                raise BadRequest(
                    f"seed {params.seed!r} cannot seed a generator ({exc}); "
                    f"use an integer in [{SEED_MIN}, {SEED_MAX}]",
                    param="seed",
                ) from exc
        stop_ids = frozenset(params.stop_token_ids) or self._eos_ids
        guide = None
        if params.constraint is not None:
            guide = self._grammar_compiler().guide(params.constraint, stop_ids)
        return _Row(pending, stop_ids, generator, self._policy_version, time.monotonic(), guide=guide)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            path = self._model_dir / "tokenizer.json"
            if not path.is_file():
                raise BadRequest(
                    f"constraints need the model's tokenizer.json, and {path} is missing", param=PARAM
                )
            self._grammars = GrammarCompiler(
                path.read_text(), self._vocab_size, min(self._eos_ids, default=self._pad_id)
            )
        return self._grammars

    def _prefill_isolated(self, rows: list[_Row]) -> _Batch | None:
        """``_prefill`` of ``rows``; if it raises, each row again on its own, so only a request
        that fails alone fails and the others start as they would have."""
        try:
            return self._prefill(rows)
        except Exception as exc:
            if len(rows) == 1:
                self._fail_prefill(rows[0], exc)
                return None
            error = exc
        log.warning(
            "torch engine: prefilling %d requests together failed (%s: %s); trying them one by one",
            len(rows),
            type(error).__name__,
            error,
        )
        fresh: _Batch | None = None
        for row in rows:
            if row.finish is not None or row.pending.cancelled.is_set():
                continue  # delivered, or nobody waits for it
            if row.token_ids:  # its stream has tokens already: it cannot start over
                self._fail(row.pending, _fault("prefilling the request", error))
                continue
            # A new row (a fresh generator): a seeded request draws what it would draw alone.
            retry = self._row_or_fail(row.pending)
            if retry is None:
                continue
            try:
                single = self._prefill([retry])
            except Exception as exc:
                self._fail_prefill(retry, exc)
                continue
            if single is not None:
                fresh = single if fresh is None else _merge(fresh, single)
        return fresh

    def _fail_prefill(self, row: _Row, exc: Exception) -> None:
        if isinstance(exc, ApplianceError):
            self._fail(row.pending, exc)
            return
        log.error(
            "torch engine: prefilling a request of %d tokens failed",
            len(row.pending.request.prompt_ids),
            exc_info=exc,
        )
        self._fail(row.pending, _fault("prefilling the request", exc))

    def _prefill(self, rows: list[_Row]) -> _Batch | None:
        """Run the prompts of ``rows`` as one left-padded batch and choose their first tokens."""
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
        scored = [i for i, r in enumerate(rows) if r.pending.request.prompt_logprobs is not None]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            # Scoring prompts needs the logits at every position (rows x width x vocab);
            # otherwise only the last one is computed.
            logits_to_keep=0 if scored else 1,
        )
        for i in scored:
            _score_prompt(rows[i], out.logits[i, width - len(prompts[i]) :], prompts[i])
        tokens = self._advance(out.logits[:, -1, :], rows)
        return _compact(_Batch(rows, cache, mask, next_pos, tokens))

    def _step(self, batch: _Batch) -> _Batch | None:
        """Feed every row its last token, choose the next one, drop the rows that ended."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        out = self._model(
            input_ids=batch.tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.next_pos[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.next_pos = batch.next_pos + 1
        batch.tokens = self._advance(out.logits[:, -1, :], batch.rows)
        return _compact(batch)

    def _advance(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Choose each row's next token, record it with its log-prob, finish and deliver rows
        that end. Returns the chosen ids (rows,) on the logits' device, to feed the next step."""
        params = [r.params for r in rows]
        # Constrained rows sample from the policy restricted to what their grammar allows.
        logits = mask_logits(logits, [r.guide for r in rows])
        tokens, logprobs, tops = choose_tokens(
            logits,
            [p.temperature for p in params],
            [max(p.top_p, MIN_TOP_P) for p in params],
            [r.generator for r in rows],
            top_logprobs=[p.top_logprobs for p in params],
            top_ks=[p.top_k for p in params],
        )
        now = time.monotonic()
        for row, token, logprob, top in zip(rows, tokens, logprobs, tops, strict=True):
            if row.pending.cancelled.is_set():
                row.finish = "cancelled"
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if row.guide is not None:
                row.guide.consume(token)
                if row.guide.error is not None:
                    # The grammar broke while sampling: an answer past this point would not
                    # hold to the constraint, so the request fails instead (``_deliver``).
                    row.finish, row.finished_at = "error", now
                    row.pending.loop.call_soon_threadsafe(self._deliver, row)
                    continue
            if top:
                row.top_logprobs.append(top)
            on_token = row.pending.request.on_token
            if on_token is not None:
                row.pending.loop.call_soon_threadsafe(on_token, token, logprob)
            if token in row.stop_ids:
                row.finish, row.finished_at = "stop", now
            elif len(row.token_ids) >= row.params.max_tokens:
                row.finish, row.finished_at = "length", now
            if row.finish is not None:
                # Queued behind this row's on_token calls, so a stream sees every token first.
                row.pending.loop.call_soon_threadsafe(self._deliver, row)
        return torch.tensor(tokens, dtype=torch.long, device=logits.device)

    @staticmethod
    def _deliver(row: _Row) -> None:
        future = row.pending.future
        if future.done() or row.finish is None:
            return
        if row.finish == "error" and row.guide is not None:
            future.set_exception(
                BadRequest(
                    f"the output constraint cannot be enforced on this request: {row.guide.error}; "
                    "simplify the schema or grammar"
                )
            )
            return
        future.set_result(
            GenerateResult(
                token_ids=tuple(row.token_ids),
                logprobs=tuple(row.logprobs),
                finish_reason=row.finish,
                policy_version=row.version,
                queue_s=row.started_at - row.pending.enqueued_at,
                gen_s=row.finished_at - row.started_at,
                top_logprobs=tuple(row.top_logprobs),
                prompt_logprobs=row.prompt_logprobs,
                prompt_top_logprobs=row.prompt_top_logprobs,
            )
        )
