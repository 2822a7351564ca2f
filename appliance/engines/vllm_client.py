"""The wire between the vLLM engine and one vLLM server: calls, streams and completions.

Owns ``ServerClient`` (JSON calls and server-sent-event streams over aiohttp, every failure on
the wire mapped to ``EngineUnavailable`` or ``BadRequest``) and the shape of a token-in/token-out
completion: the body that asks for one (``completion_body``), the JSON it is sent as
(``encode_json``) and the reading of the answer, whole (``parse_choice``) or streamed
(``read_chunks``), into a checked ``ParsedChoice``, and the pace at which the server streams a
completion's tokens (``StreamPace``: how many tokens an event may hold when none should wait long
for it). It does not own the server's process
(``appliance.engines.vllm_process``) nor when to call what (``appliance.engines.vllm_engine``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from appliance.engines.base import GenerateRequest
from appliance.engines.http_stream import raise_for_status, sse_batches
from appliance.engines.sampling import TopLogprobs
from contracts.errors import EngineUnavailable
from store.tokens import Tokens


def server_session(uds: Path | None) -> aiohttp.ClientSession:
    """The session every JSON call to a server goes through: over its Unix socket ``uds``, or
    TCP (no limit on connections; 30 s to connect, no bound on an answer)."""
    connector = aiohttp.TCPConnector(limit=0) if uds is None else aiohttp.UnixConnector(str(uds), limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, connect=30))


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
                try:
                    async for events in sse_batches(response.content.readany, path):
                        yield events
                except BaseException:
                    # Cancelled or failed mid-stream: drop the connection, which makes vLLM
                    # abort the request (a connection released for keep-alive would not).
                    response.close()
                    raise
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"the vLLM server broke off {path}: {exc!r}; retry shortly") from exc


_JSON = {"Content-Type": "application/json"}


def _ids_list(value: Any) -> list[int]:
    """A ``Tokens`` prompt as the JSON array it is (the ``default`` of both JSON writers)."""
    if type(value) is Tokens:
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_json(body: dict[str, Any], *, prompt_json: bytes | None = None) -> bytes:
    """``body`` as JSON: orjson (a completion's prompt is as long as the conversation), Python's
    json for what orjson does not write (integers beyond 64 bits). ``prompt_json``: the JSON of
    ``body["prompt"]``, already written (``GenerateRequest.prompt_json``), goes in as it is."""
    try:
        if prompt_json is not None:
            return orjson.dumps({**body, "prompt": orjson.Fragment(prompt_json)})
        return orjson.dumps(body, default=_ids_list)
    except TypeError:
        return json.dumps(body, default=_ids_list).encode()


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


def completion_body(
    request: GenerateRequest, model: str, vocab_size: int, token_batch: int | None = None
) -> dict[str, Any]:
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
    ``token_batch`` (default: the request's) is the ``stream_interval`` asked for.
    """
    params, prompt = request.params, request.prompt_ids
    stop = [t for t in params.stop_token_ids if 0 <= t < vocab_size]
    body: dict[str, Any] = {
        "model": model,
        # A list, tuple or ``Tokens`` is written as it is (no copy of a long prompt on every call).
        "prompt": prompt if type(prompt) in (list, tuple, Tokens) else list(prompt),
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
    batch = request.token_batch if token_batch is None else token_batch
    if batch > 1 and body["stream"]:
        # vLLM sends the first token at once, then every ``stream_interval`` tokens and the end.
        body["stream_interval"] = batch
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


class StreamPace:
    """How fast the server samples one stream's tokens lately, and so how many tokens a stream
    may ask to get at once (``stream_interval``) when none should wait longer than a bound.

    vLLM's ``stream_interval`` counts tokens, not time: a batch of 16 tokens is a few
    milliseconds on a fast GPU but seconds on a slow one. The pace is measured on the streams
    themselves (from the first token's arrival to the last's, per token), follows a slowdown at
    once and a speed-up gradually; until a stream has been measured, batches are one token."""

    def __init__(self) -> None:
        #: Seconds per token of one stream, lately (None: not measured yet).
        self.token_s: float | None = None

    def batch(self, token_batch: int, wait_s: float) -> int:
        """The tokens per batch for a request that allows ``token_batch`` and ``wait_s``."""
        if token_batch <= 1 or wait_s <= 0:
            return token_batch
        if self.token_s is None:
            return 1
        return max(1, min(token_batch, int(wait_s / max(self.token_s, 1e-9))))

    def measured(self, tokens: int, seconds: float) -> None:
        """A stream brought ``tokens`` more tokens in ``seconds`` after its first one."""
        if tokens < 1:
            return
        pace = seconds / tokens
        if self.token_s is None or pace > self.token_s:
            self.token_s = pace
        else:
            self.token_s = 0.8 * self.token_s + 0.2 * pace


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
    ``ParsedChoice`` per chunk: the chunks' tokens are gathered and their ids read at once (a
    stream of one token per chunk costs a few dictionary look-ups per token)."""
    finish: str | None = None
    tokens: list[str] = []
    values: list[float] = []
    try:
        for event in events:
            choice = event["choices"][0]
            block = choice.get("logprobs") or {}
            some = block.get("tokens") or ()
            scores = block.get("token_logprobs") or ()
            if len(some) != len(scores):
                raise EngineUnavailable(
                    f"vLLM streamed {len(some)} token ids but {len(scores)} log-probs in a chunk"
                )
            tokens += some
            values += scores
            if entries := block.get("top_logprobs"):
                tops.extend(_top(entry) for entry in entries)
            finish = choice.get("finish_reason")
        token_ids += token_ids_of(tokens)
        logprobs += map(float, values)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineUnavailable(f"vLLM answered a completion in an unexpected shape: {exc!r}") from exc
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
    JSON reads as exactly one id per token. One token (a paced stream's event) is read as it
    stands, under the same rule (ASCII digits, no leading zero)."""
    if not tokens:
        return []
    if len(tokens) == 1:  # a paced stream's event: one token
        token = tokens[0]
        if type(token) is str and token.startswith(TOKEN_ID_PREFIX):
            digits = token[len(TOKEN_ID_PREFIX) :]
            # What JSON reads as an id: ASCII digits, no leading zero.
            if digits.isascii() and digits.isdigit() and (digits[0] != "0" or len(digits) == 1):
                return [int(digits)]
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
