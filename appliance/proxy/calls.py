"""One model call, independent of the API surface that carried it.

Owns the path every surface shares: render the conversation to tokens (splicing earlier sampled
turns), wait while the GPUs train, generate, parse the sampled text back into a message, make
the call durable as an ``LLMCallCompleted`` event, and only then remember the turn for splicing
and answer. A surface module only converts its request and response shapes.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from appliance.chat.messages import Message, tool_schema_names
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.tools import parse_assistant
from appliance.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams
from appliance.errors import ContextTooLong
from appliance.rollouts import ActiveRollout
from store.events import LLMCallCompleted
from store.eventstore import EventStore


class ServingGate:
    """Open while the engine serves; closed while the trainer holds the machine.

    Calls that arrive while it is closed wait (their connections stay open) instead of failing.
    ``inflight`` counts generations so the scheduler can wait for them to drain.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = 0

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def enter(self) -> None:
        await self._open.wait()
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def drained(self) -> None:
        await self._idle.wait()


@dataclass(frozen=True, slots=True)
class CallOutcome:
    message: Message
    result: GenerateResult
    prompt_tokens: int
    call_id: str


class CallService:
    def __init__(
        self,
        *,
        engine: Engine,
        store: EventStore,
        tokenizer: Tokenizer,
        gate: ServingGate,
        max_tokens_default: int,
    ) -> None:
        self.engine = engine
        self.store = store
        self.tokenizer = tokenizer
        self.gate = gate
        self.max_tokens_default = max_tokens_default

    async def complete(
        self,
        rollout: ActiveRollout,
        *,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]],
        params: SamplingParams,
        surface: str,
        request: dict[str, Any],
        user_agent: str,
    ) -> CallOutcome:
        started = time.perf_counter()
        rendered = rollout.conversation.render(messages, tools)
        prompt_len = len(rendered.prompt_ids)
        if prompt_len + params.max_tokens > self.engine.max_context:
            raise ContextTooLong(
                f"the prompt has {prompt_len} tokens and max_tokens is {params.max_tokens}, but the "
                f"model's context is {self.engine.max_context} tokens; shorten the conversation or "
                "lower max_tokens",
                param="messages",
            )
        if not params.stop_token_ids:
            params = SamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                stop_token_ids=(self.tokenizer.im_end_id,),
            )
        await self.gate.enter()
        try:
            queued = time.perf_counter() - started
            result = await self.engine.generate(
                GenerateRequest(prompt_ids=rendered.prompt_ids, params=params)
            )
        finally:
            self.gate.leave()
        body = result.token_ids
        if body and body[-1] in params.stop_token_ids:
            body = body[:-1]
        text = self.tokenizer.decode(body)
        message = parse_assistant(text, tool_schema_names(tools))
        call_id = "chatcmpl-" + secrets.token_hex(12)
        event = LLMCallCompleted(
            ts=time.time(),
            rollout=rollout.rollout,
            call_id=call_id,
            surface=surface,
            prompt_ids=tuple(rendered.prompt_ids),
            response_ids=result.token_ids,
            response_logprobs=result.logprobs,
            policy_version=result.policy_version,
            finish_reason=result.finish_reason,
            request=request,
            response_text=text,
            queue_s=queued + result.queue_s,
            total_s=time.perf_counter() - started,
            user_agent=user_agent,
            spliced_tokens=rendered.spliced_tokens,
        )
        # Durable before acknowledged: the harness hears nothing until the call is in the log.
        await self.store.append([event])
        rollout.conversation.remember(rendered.digest, message, result.token_ids)
        rollout.calls += 1
        return CallOutcome(message=message, result=result, prompt_tokens=prompt_len, call_id=call_id)
