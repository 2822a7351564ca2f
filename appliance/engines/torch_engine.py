"""The in-process engine: a transformers causal LM decoded with continuous batching by plain torch.

Owns the engine's life (loading the model, start, close), taking requests (``generate``
validates and queues them), cancellation and sleep/wake. Its parts: the step loop that admits
and decodes (left padding, one KV cache for all running rows, rows joining and leaving between
steps) is ``appliance.engines.torch_steps``, a batch's state and cache numerics
``appliance.engines.torch_batch``, in-place weight swaps ``appliance.engines.torch_weights``;
the numerics of choosing tokens and their log-probs live in ``appliance.engines.sampling``. It
knows nothing about chat templates, tools or HTTP: prompts arrive as token ids and completions
leave as token ids (``appliance.engines.base``).

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
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from appliance.engines.base import (
    GenerateRequest,
    GenerateResult,
    validate_request,
)
from appliance.engines.constraints import GrammarCompiler
from appliance.engines.served import WAKE_TAGS, check_sleep_level, check_wake_tags
from appliance.engines.torch_batch import Pending, Row, eos_ids
from appliance.engines.torch_steps import TorchStepLoop
from appliance.engines.torch_weights import TorchWeights
from contracts.errors import EngineUnavailable

log = logging.getLogger(__name__)

#: ``from_pretrained`` sets process-wide state while it loads (the default device: meta), so two
#: engines of one process (an engine fleet's replicas) load one after the other.
_LOADING = threading.Lock()


class TorchEngine(TorchWeights, TorchStepLoop):
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
        self._inbox: deque[Pending] = deque()
        self._wakeup = asyncio.Event()
        #: Held by the step loop while it runs and by swaps, sleep and wake: they never overlap.
        self._lock = asyncio.Lock()
        #: Operations waiting for the lock; while > 0 the step loop admits nobody and drains.
        self._exclusive = 0
        self._stopping = threading.Event()
        self._runner: asyncio.Task[None] | None = None
        #: The rows admitted and not yet finished (replaced, never mutated, by the step loop).
        self._running: list[Row] = []
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
        self._eos_ids = eos_ids(config.eos_token_id, model.generation_config.eos_token_id)
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

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        self._ensure_serving()
        async with self._exclusive_access():
            self._released = set(WAKE_TAGS)
            self._fail_queued(EngineUnavailable("the torch engine went to sleep (the machine trains); retry"))
            # The KV cache lives only while rows run, and none do: nothing else to free.
            await asyncio.to_thread(self._discard_weights if level == 2 else self._offload_weights)

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        self._ensure_serving()
        check_wake_tags(tags)
        async with self._exclusive_access():
            if "weights" in tags and "weights" in self._released:
                await asyncio.to_thread(self._place_weights, self._device)
            self._released -= set(tags)

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
        pending = Pending(request, future, time.monotonic(), loop)
        self._inbox.append(pending)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            # The future is cancelled with us, so no result can be delivered; the flag makes
            # the step loop drop the row at its next step (or skip it if still queued).
            pending.cancelled.set()
            raise
