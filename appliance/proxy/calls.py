"""One model call, independent of the API surface that carried it.

Owns the path every surface shares: render the conversation to tokens (splicing earlier sampled
turns), wait while the GPUs train, generate (all at once or streamed), parse the sampled text
back into a message, make the call durable as an ``LLMCallCompleted`` event, and only then
remember the turn for splicing and answer. A surface module only converts request and response
shapes; it never touches tokens.

A call whose client goes away mid-stream is cancelled in the engine and still recorded, with
finish reason ``cancelled`` and the tokens sampled so far.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from appliance.chat.messages import Message, tool_schema_names
from appliance.chat.render import RenderedPrompt
from appliance.chat.template import TOOL_CALL_OPEN
from appliance.chat.tokenizer import IncrementalDecoder, Tokenizer
from appliance.chat.tools import parse_assistant
from appliance.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams
from appliance.proxy.deltas import TextDeltas, TokenArrivals
from appliance.proxy.deltas import cut_at_stop as _cut_at_stop
from appliance.proxy.gate import ServingGate
from appliance.proxy.sampled import Columns, Sampled, sampling_record
from appliance.rollouts.registry import DEFAULT_ROLLOUT, ActiveRollout
from contracts.errors import ApplianceError, ContextTooLong, EngineUnavailable
from store.events import LLMCallCompleted
from store.eventstore import EventStore
from store.tokens import Tokens

log = logging.getLogger(__name__)

#: Tokens an engine may hand over at once for a call whose client does not stream
#: (``GenerateRequest.token_batch``): at most this many, and only as many as it samples in
#: ``BATCH_WAIT_S``. A preempted call loses the tokens not handed over yet (at most about that
#: much generation), which it samples again after the switch.
TOKEN_BATCH = 256
BATCH_WAIT_S = 0.5
#: For a client that streams: at most this many tokens at once, and only as many as the engine
#: samples in ``STREAM_BATCH_WAIT_S`` (the first token always alone), so no token waits longer
#: for its batch. A fast engine then writes, and the proxy reads and relays, one event per batch
#: instead of one per token; a slow one still streams token by token.
STREAM_TOKEN_BATCH = 16
STREAM_BATCH_WAIT_S = 0.02


def new_call_id() -> str:
    """A call id unique within the run and unguessable (96 random bits, 24 hex digits): the ids
    the surfaces answer with (a stored response's ``resp_<id>`` among them) say nothing of other
    calls'."""
    return secrets.token_hex(12)


@dataclass(slots=True)
class PreparedCall:
    """A validated, rendered call that has not been sent to the engine yet."""

    rollout: ActiveRollout
    rendered: RenderedPrompt
    params: SamplingParams
    tools: Sequence[dict[str, Any]]
    surface: str
    request: dict[str, Any]
    user_agent: str
    started: float
    #: Stop strings: generation ends once the text contains one; the text returned ends before it.
    stop: tuple[str, ...] = ()
    #: Also score the prompt: its tokens' log-probs, with this many alternatives each.
    prompt_logprobs: int | None = None
    call_id: str = field(default_factory=new_call_id)

    @property
    def prompt_tokens(self) -> int:
        return len(self.rendered.prompt_ids)


@dataclass(frozen=True, slots=True)
class CallOutcome:
    message: Message
    result: GenerateResult
    prompt_tokens: int
    call_id: str
    #: The sampled text without the stop token (tool-call blocks included), cut before a stop
    #: string.
    text: str
    #: The stop string the text was cut before (None: none matched).
    stop_sequence: str | None = None


class CallStream:
    """A call being generated: an async iterator of text deltas and finally the ``CallOutcome``.

    Generation is already running when the stream is created. ``aclose`` (or leaving
    ``async with``) cancels it if it has not finished, whether or not it was iterated.
    """

    def __init__(
        self,
        run: asyncio.Task[CallOutcome],
        items: AsyncGenerator[str | CallOutcome, None],
        arrivals: TokenArrivals,
        deltas: TextDeltas,
    ) -> None:
        self._run = run
        self._items = items
        self._arrivals = arrivals
        self._deltas = deltas

    def write_through(self, ready: Callable[[], bool], send: Callable[[str], None]) -> None:
        """While the iterator waits for tokens, decode each group the engine hands over at once
        and give its text to ``send`` in the engine's callback, if ``ready()`` (the client keeps
        up): the iterator is not woken for it, one task switch fewer per group. A group that
        comes while the iterator is busy, or is not ``ready()``, waits for the iterator as before.
        The text sent either way, then the iterator's, concatenates to what the iterator alone
        would have yielded."""
        deltas = self._deltas

        def take(ids: Sequence[int]) -> bool:
            if not ready():
                return False
            if delta := deltas.push(ids):
                send(delta)
            return True

        self._arrivals.shortcut(take)

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> str | CallOutcome:
        return await self._items.__anext__()

    async def aclose(self) -> None:
        await self._items.aclose()
        if not self._run.done():
            self._run.cancel()
        await asyncio.gather(self._run, return_exceptions=True)

    async def __aenter__(self) -> CallStream:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


class CallService:
    def __init__(
        self,
        *,
        engine: Engine,
        store: EventStore,
        tokenizer: Tokenizer,
        gate: ServingGate,
        max_tokens_default: int | None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.tokenizer = tokenizer
        self.gate = gate
        self.max_tokens_default = max_tokens_default
        #: Called with each call's event once it is durable (the proxy's ``/metrics``).
        self.on_recorded: Callable[[LLMCallCompleted], None] | None = None

    def prepare(
        self,
        rollout: ActiveRollout,
        rendered: RenderedPrompt,
        *,
        tools: Sequence[dict[str, Any]],
        params: SamplingParams,
        surface: str,
        request: Mapping[str, Any],
        user_agent: str,
        stop: tuple[str, ...] = (),
        prompt_logprobs: int | None = None,
        fit_context: bool = False,
        asked_max_tokens: int | None = None,
    ) -> PreparedCall:
        """Validate a rendered prompt's call; raises before anything is generated or recorded.

        ``params.max_tokens`` 0 samples nothing (nothing is recorded); with ``prompt_logprobs``
        the prompt is still scored. ``fit_context``: the client set no length, so the call may
        generate up to what the context leaves, if that is less than ``params.max_tokens``.
        ``asked_max_tokens``: the length the client asked, which an overflow's message compares
        with what the cap (or the rollout's own limit) made of it."""
        started = time.perf_counter()
        if rollout.temperature_override is not None:
            params = replace(params, temperature=rollout.temperature_override)
        if rollout.max_tokens_override is not None:
            params = replace(params, max_tokens=rollout.max_tokens_override)
        prompt_len = len(rendered.prompt_ids)
        room = self.engine.max_context - prompt_len
        if fit_context and room >= 1 and params.max_tokens > room:
            params = replace(params, max_tokens=room)
        if (
            prompt_len + max(params.max_tokens, 1 if prompt_logprobs is not None else 0)
            > self.engine.max_context
        ):
            raise ContextTooLong(
                prompt_tokens=prompt_len,
                completion_tokens=params.max_tokens,
                max_context=self.engine.max_context,
                surface=surface,
                asked_tokens=asked_max_tokens,
                capped_by=(
                    "the appliance's max_tokens_cap"
                    if rollout.max_tokens_override is None
                    else "the rollout's max_tokens"
                ),
            )
        if not params.stop_token_ids:
            params = replace(params, stop_token_ids=(self.tokenizer.im_end_id,))
        return PreparedCall(
            rollout,
            rendered,
            params,
            tools,
            surface,
            dict(request),
            user_agent,
            started,
            stop=stop,
            prompt_logprobs=prompt_logprobs,
        )

    async def complete(self, call: PreparedCall) -> CallOutcome:
        """Generate the whole completion, record it, and return it."""
        return await self._run(call, None)

    def stream(self, call: PreparedCall) -> CallStream:
        """Start generating now; the returned stream yields text deltas as they are sampled, then
        the ``CallOutcome`` (after it is durable).

        Generation starts before the caller iterates, so a surface can write its response
        headers while the engine prefills. With tools declared, text from a ``<tool_call>`` block
        on is held back: the surface sends the parsed tool calls from the outcome instead.
        Closing the stream early (the client went away) cancels the generation, which is
        recorded as cancelled. Use it as ``async with calls.stream(call) as items:``.
        """
        arrivals = TokenArrivals()
        run = asyncio.create_task(self._run(call, arrivals.add))
        run.add_done_callback(lambda _: arrivals.end())
        markers = (*call.stop, *((TOOL_CALL_OPEN,) if call.tools else ()))
        deltas = TextDeltas(self.tokenizer, call.params.stop_token_ids, markers)
        return CallStream(run, self._relay(run, arrivals, deltas), arrivals, deltas)

    async def _relay(
        self, run: asyncio.Task[CallOutcome], arrivals: TokenArrivals, deltas: TextDeltas
    ) -> AsyncGenerator[str | CallOutcome, None]:
        # Each delta is the text of every token that came since the last one was taken: one
        # per token while the client keeps up with the engine, fewer and longer when it does not.
        while (tokens := await arrivals.take()) is not None:
            if delta := deltas.push(tokens):
                yield delta
        outcome = await run
        # What was held back to the end (a trailing partial character, text that only
        # looked like the start of a marker) goes out now, as the final text has it.
        final = outcome.message.content if outcome.message.tool_calls else outcome.text
        sent = deltas.sent
        if len(final) > sent and final.startswith(deltas.text[:sent]):
            yield final[sent:]
        yield outcome

    async def _run(
        self, call: PreparedCall, on_tokens: Callable[[Sequence[int]], None] | None
    ) -> CallOutcome:
        if call.params.max_tokens == 0:
            return await self._nothing_sampled(call)
        sampled = Sampled()
        first_token_at: list[float] = []
        decoder = IncrementalDecoder(self.tokenizer) if call.stop else None
        seen = [""]
        stopped = asyncio.Event()
        generation: asyncio.Future[GenerateResult] | None = None
        version = self.engine.policy_version
        queued: float | None = None
        preemptions = 0

        def collect_all(ids: Sequence[int], logprobs: Sequence[float]) -> None:
            # One call per group of tokens the engine hands over (vLLM: per read of its stream).
            if stopped.is_set():
                return  # tokens the engine sampled after a stop string matched are dropped
            if not first_token_at:
                first_token_at.append(time.perf_counter())
            if decoder is not None and generation is not None:
                for i, token in enumerate(ids):
                    seen[0] += decoder.push(token)
                    if any(s in seen[0] for s in call.stop):
                        ids, logprobs = ids[: i + 1], logprobs[: i + 1]
                        stopped.set()
                        generation.cancel()
                        break
            # Each token with the version that sampled it (a switch between two groups
            # changes ``version`` before the next group comes).
            sampled.add(ids, logprobs, version)
            if on_tokens is not None:
                on_tokens(ids)

        def collect(token: int, logprob: float) -> None:
            collect_all((token,), (logprob,))

        while True:
            if sampled.ids and sampled.ids[-1] in call.params.stop_token_ids:
                result = GenerateResult(
                    token_ids=(), logprobs=(), finish_reason="stop", policy_version=version
                )
                break  # preempted right after the last token: nothing left to generate
            if len(sampled.ids) >= call.params.max_tokens:
                result = GenerateResult(
                    token_ids=(), logprobs=(), finish_reason="length", policy_version=version
                )
                break
            await self.gate.enter()
            queued = time.perf_counter() - call.started if queued is None else queued
            version = self.engine.policy_version
            request = GenerateRequest(
                # Engines never change a request's ids: the rendered list goes as it is unless the
                # call continues after a preemption.
                prompt_ids=[*call.rendered.prompt_ids, *sampled.ids]
                if sampled.ids
                else call.rendered.prompt_ids,
                params=replace(call.params, max_tokens=call.params.max_tokens - len(sampled.ids))
                if sampled.ids
                else call.params,
                on_token=collect,
                on_tokens=collect_all,
                # A rollout's calls go to one engine replica (its prefix cache holds the earlier
                # turns); the shared rollout-less conversation goes wherever there is room.
                affinity=None if call.rollout.rollout == DEFAULT_ROLLOUT else call.rollout.rollout,
                prompt_logprobs=call.prompt_logprobs,
                # A chat prompt is the tokenizer's ids and sampled ones (a Completions prompt may
                # be the client's ids).
                tokenizer_vocab=self.tokenizer.vocab_size if call.rendered.text is None else 0,
                # The renderer's JSON of the prompt (not of a continuation's longer one).
                prompt_json=None if sampled.ids else call.rendered.prompt_json,
                # A client that streams gets each token within ``STREAM_BATCH_WAIT_S`` of its
                # sampling; otherwise the tokens are only kept for a preemption, and fewer,
                # larger batches cost less to read (each read of the stream costs the same).
                token_batch=STREAM_TOKEN_BATCH if on_tokens is not None else TOKEN_BATCH,
                batch_wait_s=STREAM_BATCH_WAIT_S if on_tokens is not None else BATCH_WAIT_S,
            )
            generation = asyncio.ensure_future(self.engine.generate(request))
            self.gate.track(generation)
            preempted = False
            try:
                result = await generation
                break
            except asyncio.CancelledError:
                current = asyncio.current_task()
                ours = current is not None and current.cancelling() > 0
                preempted = self.gate.untrack(generation) and not ours
                if preempted and not stopped.is_set():
                    preemptions += 1
                    continue  # wait for the switch to end, then continue from what was sampled
                if stopped.is_set() and not ours:
                    result = GenerateResult(
                        token_ids=(), logprobs=(), finish_reason="stop", policy_version=version
                    )
                    break
                if not generation.done():
                    generation.cancel()
                await self._record(call, "cancelled", sampled.columns(), queued, first_token_at, preemptions)
                raise
            except ApplianceError:
                raise
            except Exception as exc:
                # An engine that breaks its contract (raises something other than its errors)
                # fails this call alone, retryably, like an engine fault it reports itself.
                log.exception("the engine failed on call %s", call.call_id)
                raise EngineUnavailable(
                    f"the engine failed on this call ({type(exc).__name__}: {exc}); retry"
                ) from exc
            finally:
                self.gate.untrack(generation)
                self.gate.leave()
        finish = result.finish_reason
        token_ids, logprobs, versions = sampled.columns()
        body = token_ids
        if body and body[-1] in call.params.stop_token_ids:
            body = body[:-1]
        decoded = self.tokenizer.decode(body)
        text = _cut_at_stop(decoded, call.stop)
        matched = next((s for s in call.stop if decoded.startswith(s, len(text))), None)
        message = parse_assistant(
            text, tool_schema_names(call.tools), reasoning=call.rollout.transcript.fmt.reasoning
        )
        # Durable before acknowledged: the harness hears nothing final until the call is logged.
        await self._record(
            call, finish, (token_ids, logprobs, versions), queued, first_token_at, preemptions, text, matched
        )
        call.rollout.transcript.remember(
            call.rendered, message, token_ids, text, call.params.stop_token_ids, matched
        )
        call.rollout.calls += 1
        prompt_len = call.prompt_tokens
        merged = GenerateResult(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            policy_version=version,
            queue_s=queued or 0.0,
            top_logprobs=result.top_logprobs,
            # A preempted call's last prompt also held what it had sampled: only the prompt's part.
            prompt_logprobs=result.prompt_logprobs[:prompt_len],
            prompt_top_logprobs=result.prompt_top_logprobs[:prompt_len],
        )
        return CallOutcome(
            message=message,
            result=merged,
            prompt_tokens=prompt_len,
            call_id=call.call_id,
            text=text,
            stop_sequence=matched,
        )

    async def _nothing_sampled(self, call: PreparedCall) -> CallOutcome:
        """A call for no tokens (Completions' ``max_tokens: 0``): nothing is sampled or recorded;
        with ``prompt_logprobs`` the engine scores the prompt (one token is drawn and dropped)."""
        result = GenerateResult(
            token_ids=(), logprobs=(), finish_reason="length", policy_version=self.engine.policy_version
        )
        if call.prompt_logprobs is not None:
            await self.gate.enter()
            try:
                scored = await self.engine.generate(
                    GenerateRequest(
                        prompt_ids=call.rendered.prompt_ids,
                        params=replace(call.params, max_tokens=1),
                        prompt_logprobs=call.prompt_logprobs,
                    )
                )
            finally:
                self.gate.leave()
            result = replace(
                result,
                policy_version=scored.policy_version,
                prompt_logprobs=scored.prompt_logprobs,
                prompt_top_logprobs=scored.prompt_top_logprobs,
            )
        return CallOutcome(
            message=Message("assistant", ""),
            result=result,
            prompt_tokens=call.prompt_tokens,
            call_id=call.call_id,
            text="",
        )

    async def _record(
        self,
        call: PreparedCall,
        finish: str,
        columns: Columns,
        queued: float | None,
        first_token_at: list[float],
        preemptions: int,
        text: str | None = None,
        stop_sequence: str | None = None,
    ) -> None:
        now = time.perf_counter()
        token_ids, logprobs, versions = columns
        event = LLMCallCompleted(
            ts=time.time(),
            rollout=call.rollout.rollout,
            call_id=call.call_id,
            surface=call.surface,
            prompt_ids=call.rendered.prompt_ids,
            response_ids=Tokens(token_ids),
            response_logprobs=logprobs,
            # The oldest version that sampled any of it (the whole response when not preempted).
            policy_version=min(versions) if versions else self.engine.policy_version,
            finish_reason=finish,
            request=call.request,
            response_text=self.tokenizer.decode(token_ids) if text is None else text,
            queue_s=queued or 0.0,
            total_s=now - call.started,
            ttft_s=(first_token_at[0] - call.started) if first_token_at else 0.0,
            user_agent=call.user_agent,
            spliced_tokens=call.rendered.spliced_tokens,
            unmatched_assistant_turns=call.rendered.unmatched_assistant_turns,
            assistant_turns=tuple(t.as_json() for t in call.rendered.turns),
            stop_sequence=stop_sequence or "",
            sampling=sampling_record(call.params),
            preemptions=preemptions,
            response_versions=Tokens(versions),
        )
        await self.store.append([event])
        if self.on_recorded is not None:
            self.on_recorded(event)
