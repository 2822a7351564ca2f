"""Rendering conversations to token ids, splicing in the exact ids of earlier sampled turns.

Owns the one place where text becomes prompt tokens. A prompt is the concatenation of one
segment per turn (the first system message and the tool list share a segment, and so do
consecutive tool results), each tokenized on its own, then the generation prompt. Every segment
starts with ``<|im_start|>`` and ends with ``<|im_end|>\n``; special tokens are never merged
with their neighbours, so the concatenation tokenizes exactly like the whole text the model's
chat template renders (tests hold ``render_text`` to the Jinja template, and the ids to the
whole-text tokenization).

Two invariants make a multi-call rollout one exact token sequence:

* An assistant turn that this conversation sampled earlier is not re-rendered from its text:
  its segment is the generation prompt, the sampled ids, and the closing tokens. The lookup is
  keyed by a digest of the whole prompt that produced it plus the turn's key (content and tool
  calls as the proxy returned them), so a turn is only spliced where it was actually sampled.
* Rendering is incremental: a ``Conversation`` keeps the last request's messages, segments,
  their running digests and the prompt's ids so far, so a new request plans, tokenizes, hashes
  and copies only what it adds. The repeated messages are found by comparing the message lists
  (the same ``Message`` objects where the request was read with the conversation's
  ``MessageMemo``, so no text is compared), and their segments' ids are taken as one slice.
  The prompt's ids as JSON (what the vLLM engine sends) are kept the same way: each segment's
  ids are written once, when the segment is made, and the prompt's JSON is those bytes joined.

An assistant turn whose text is not exactly the returned one (a stop string re-appended, a
truncated tool call dropped, a turn never sampled) is matched by ``appliance.chat.turns``
against what was sampled after the same prompt; every turn not spliced exactly is reported in
``RenderedPrompt.turns`` (how it matched, or why it did not).

The renderer knows nothing about HTTP, engines or rollouts.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from appliance.chat.formats import CHATML, ChatFormat
from appliance.chat.messages import Message
from appliance.chat.template import IM_END, IM_START, TOOLS_POSTAMBLE, TOOLS_PREAMBLE
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.turns import CUT_CALL, SampledTurn, TurnMatch, match_turn, resembles, returned_part
from store.tokens import Tokens, pack_ids

GENERATION_PROMPT = f"{IM_START}assistant\n"
_TURN_END = f"{IM_END}\n"
#: How many of the turns sampled after one prompt a turn sent back changed is compared with (the
#: newest). More come from a harness that asks the same prompt again and again (retries, n answers
#: one call at a time); exact splicing remembers every one of them regardless.
SAMPLED_TURNS_PER_PROMPT = 64

SegmentKey = tuple[Any, ...]


def _system_text(system: Message | None, tools: Sequence[dict[str, Any]]) -> str:
    content = system.content if system is not None else ""
    listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{IM_START}system\n{content}{TOOLS_PREAMBLE}{listing}{TOOLS_POSTAMBLE}{IM_END}\n"


def _assistant_tool_text(message: Message) -> str:
    parts = [f"{IM_START}assistant"]
    if message.content:
        parts.append("\n" + message.content)
    for call in message.tool_calls:
        parts.append(f'\n<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>')
    parts.append(f"{IM_END}\n")
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One segment to render: its cache key, what it is made of, and the message if it may be
    spliced. Its text is only built when the segment is tokenized (a segment reused from the
    last request never is)."""

    key: SegmentKey
    #: "tools" (the system message with the tool list), "tool" (a run of tool results),
    #: "assistant", or the role of a plain turn.
    kind: str
    messages: tuple[Message, ...]
    #: The position after the segment's last message in the request's messages (0 for a
    #: system segment the format inserts).
    stop: int
    tools: Sequence[dict[str, Any]] = ()

    @property
    def assistant(self) -> Message | None:
        return self.messages[0] if self.kind == "assistant" else None

    @property
    def text(self) -> str:
        if self.kind == "tools":
            return _system_text(self.messages[0] if self.messages else None, self.tools)
        if self.kind == "tool":
            body = "".join(f"\n<tool_response>\n{m.content}\n</tool_response>" for m in self.messages)
            return f"{IM_START}user{body}{IM_END}\n"
        message = self.messages[0]
        if self.kind == "assistant" and message.tool_calls:
            return _assistant_tool_text(message)
        return f"{IM_START}{message.role}\n{message.content}{IM_END}\n"


def plan_segments(
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]],
    fmt: ChatFormat = CHATML,
    tools_json: bytes | None = None,
) -> list[_Plan]:
    """One plan per segment, in order, mirroring the chat template's branches (``tools_json``:
    the tools as ``_tools_json`` writes them, if already known)."""
    first = messages[0] if messages and messages[0].role == "system" else None
    stop = 0 if first is None else 1
    system = first
    if system is None and fmt.default_system is not None:
        system = Message("system", fmt.default_system)
    plans: list[_Plan] = []
    if tools:
        listing = _tools_json(tools) if tools_json is None else tools_json
        key = ("tools", system.key if system else None, listing)
        plans.append(_Plan(key, "tools", () if system is None else (system,), stop, tools))
    elif system is not None:
        plans.append(_Plan(("system", system.key), "system", (system,), stop))
    plans += _turn_plans(messages, stop)
    return plans


def _tools_json(tools: Sequence[dict[str, Any]]) -> bytes:
    """The tool list as it keys the system segment (sorted keys: the same tools, the same key)."""
    return orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS) if tools else b""


def _turn_plans(messages: Sequence[Message], start: int) -> list[_Plan]:
    """The plans of the turns from ``messages[start]`` on (no system segment among them)."""
    plans: list[_Plan] = []
    i = start
    while i < len(messages):
        message = messages[i]
        if message.role == "tool":
            # Consecutive tool results share one user turn, and so one segment: a boundary
            # between them would fall inside a pre-token ("</tool_response>" + "\n" merge).
            j = i
            while j < len(messages) and messages[j].role == "tool":
                j += 1
            run = tuple(messages[i:j])
            plans.append(_Plan(("tool", tuple(m.key for m in run)), "tool", run, j))
            i = j
            continue
        plans.append(_Plan((message.role, message.key), message.role, (message,), i + 1))
        i += 1
    return plans


def _stop(segment: _Segment) -> int:
    """Where ``segment``'s messages end (what the kept segments are searched by)."""
    return segment.stop


def _common_prefix(new: tuple[Message, ...], old: tuple[Message, ...]) -> int:
    """How many leading messages of ``new`` render as those of ``old`` (the same key)."""
    m = min(len(new), len(old))
    if new[:m] == old[:m]:  # the same objects compare without a look at their text
        return m
    i = 0
    while i < m and (new[i] is old[i] or new[i].key == old[i].key):
        i += 1
    return i


def render_text(
    messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (), fmt: ChatFormat = CHATML
) -> str:
    """The prompt as text, generation prompt included (what the Jinja template renders)."""
    return "".join(p.text for p in plan_segments(messages, tools, fmt)) + GENERATION_PROMPT


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    #: As the call's event keeps them (a long conversation's ids are copied once per call, as bytes).
    prompt_ids: Tokens
    #: Digest of ``prompt_ids``; a sampled response is remembered under it.
    digest: bytes
    #: Prompt tokens taken verbatim from earlier sampled turns.
    spliced_tokens: int
    #: Prompt tokens tokenized for this request (the incremental cost).
    tokenized_tokens: int
    #: Assistant turns in the request that were not sampled here and were rendered from text.
    unmatched_assistant_turns: int
    #: A Completions prompt's text (None for a chat prompt).
    text: str | None = None
    #: ``prompt_ids`` as a JSON array (``orjson.dumps(prompt_ids.tolist())``), where the renderer kept it.
    prompt_json: bytes | None = None
    #: Every assistant turn of the prompt not spliced exactly as it was returned, in order: how it
    #: matched what was sampled, or why nothing matched (``unmatched_assistant_turns`` of them).
    turns: tuple[TurnMatch, ...] = ()


@dataclass(slots=True)
class _Segment:
    key: SegmentKey
    #: The position after the segment's last message (see ``_Plan.stop``).
    stop: int
    ids: list[int]
    #: Running digest of every token up to and including this segment.
    hasher: Any
    #: The length of the conversation's ids JSON up to and including this segment.
    json_end: int
    #: The prompt's length and its spliced tokens up to and including this segment.
    end: int
    spliced_total: int
    #: How many turns of ``Conversation._turns`` the segments up to this one hold.
    turns_end: int = 0


@dataclass(slots=True)
class Conversation:
    """Per-rollout render state: the sampled turns and the last request's segments."""

    tokenizer: Tokenizer
    fmt: ChatFormat = CHATML
    #: The sampled turns remembered (the oldest forgotten beyond it: they no longer splice) and
    #: the prompts they are remembered after; None: every one, for the rollout's life.
    max_sampled: int | None = None
    _sampled: dict[tuple[bytes, Any], tuple[int, ...]] = field(default_factory=dict)
    #: The turns sampled after each prompt digest, newest first (the last
    #: ``SAMPLED_TURNS_PER_PROMPT``), and the keys of the sampled turns remembered, each with how
    #: many of them it is (what a turn that does not match exactly is compared with).
    _by_prompt: dict[bytes, deque[SampledTurn]] = field(default_factory=dict)
    _sampled_keys: dict[Any, int] = field(default_factory=dict)
    #: Sampled turns whose returned message covers less than was sampled: (sampled ids spliced,
    #: ids sampled), reported when the turn is spliced (``turns.returned_part``).
    _cut: dict[tuple[bytes, Any], tuple[int, int]] = field(default_factory=dict)
    #: The non-exact assistant turns of the last request's segments, in order.
    _turns: list[TurnMatch] = field(default_factory=list)
    #: The last request's messages and tools (as ``_tools_json`` writes them), and its segments.
    _messages: tuple[Message, ...] = ()
    _tools: bytes = b""
    _segments: list[_Segment] = field(default_factory=list)
    #: The ids of ``_segments``, concatenated (the last prompt without its generation prompt), as
    #: little-endian int32s (``Tokens``' bytes; what the digests hash).
    _packed: bytearray = field(default_factory=bytearray)
    #: The same ids as JSON numbers joined by commas (a JSON array without its brackets).
    _ids_json: bytearray = field(default_factory=bytearray)
    _gen_prompt: list[int] = field(default_factory=list)
    _gen_prompt_json: bytes = b""
    _gen_prompt_packed: bytes = b""
    _newline: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._gen_prompt = self.tokenizer.encode(GENERATION_PROMPT)
        self._gen_prompt_packed = pack_ids(self._gen_prompt)
        self._gen_prompt_json = orjson.dumps(self._gen_prompt)[1:-1]
        self._newline = self.tokenizer.encode("\n")

    def remember(
        self,
        digest: bytes,
        message: Message,
        response_ids: Sequence[int],
        stop: str | None = None,
        stop_at: int = 0,
    ) -> None:
        """Record that ``response_ids``, sampled after the prompt with ``digest``, became ``message``
        (its text cut at ``stop_at`` before the stop string ``stop``, if one matched)."""
        ids = tuple(response_ids)
        body = ids[:-1] if ids and ids[-1] == self.tokenizer.im_end_id else ids
        turn = SampledTurn(message, body, stop, stop_at)
        returned = returned_part(self.tokenizer, message, body)
        pair = (digest, message.key)
        # Sampled again: remembered anew, as the newest.
        if self._sampled.pop(pair, None) is None:
            self._sampled_keys[message.key] = self._sampled_keys.get(message.key, 0) + 1
        self._cut.pop(pair, None)
        if returned is None:
            self._sampled[pair] = ids
        else:
            # A call the length limit cut was not returned: the turn is spliced without it.
            turn.returned, turn.returned_sampled = returned
            self._sampled[pair] = returned[0]
            self._cut[pair] = (returned[1], len(body))
        turns = self._by_prompt.pop(digest, None)
        if turns is None:
            turns = deque(maxlen=SAMPLED_TURNS_PER_PROMPT)
        self._by_prompt[digest] = turns
        turns.appendleft(turn)
        if self.max_sampled is not None:
            self._forget_beyond(self.max_sampled)

    def _forget_beyond(self, most: int) -> None:
        """Forget the oldest sampled turns past ``most``, and the oldest prompts past it."""
        while len(self._sampled) > most:
            pair = next(iter(self._sampled))
            del self._sampled[pair]
            self._cut.pop(pair, None)
            key = pair[1]
            if self._sampled_keys[key] > 1:
                self._sampled_keys[key] -= 1
            else:
                del self._sampled_keys[key]
        while len(self._by_prompt) > most:
            del self._by_prompt[next(iter(self._by_prompt))]

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> RenderedPrompt:
        try:
            return self._render(messages, tools)
        except BaseException:
            # The kept ids may be half extended: start the next request from scratch (the
            # sampled turns stay, so it still splices them).
            self._segments, self._packed, self._ids_json, self._messages = [], bytearray(), bytearray(), ()
            self._turns = []
            raise

    def _render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> RenderedPrompt:
        now = tuple(messages)
        listing = _tools_json(tools)
        last = self._segments
        reused = 0
        if last and listing == self._tools:
            same = _common_prefix(now, self._messages)
            # The segments of the repeated messages, but not a run of tool results the new
            # request continues (nor the system segment alone: a request with no message in
            # common may open with a system message of its own).
            reused = bisect_right(last, same, key=_stop) if same else 0
            continued = reused > 0 and same < len(now) and now[same].role == "tool"
            if continued and last[reused - 1].key[0] == "tool" and last[reused - 1].stop == same:
                reused -= 1
        segments = last[:reused]
        if segments:
            plans = _turn_plans(now, segments[-1].stop)
        else:
            plans = plan_segments(now, tools, self.fmt, listing)
        end = segments[-1].end if segments else 0
        spliced_total = segments[-1].spliced_total if segments else 0
        # The earlier segments' ids (the kept bytes, cut where the reused segments end).
        packed = self._packed
        del packed[end * 4 :]
        ids_json = self._ids_json
        del ids_json[segments[-1].json_end if segments else 0 :]
        hasher = segments[-1].hasher.copy() if segments else hashlib.blake2b(digest_size=16)
        turns = self._turns
        del turns[segments[-1].turns_end if segments else 0 :]
        tokenized = 0
        im_end = self.tokenizer.im_end_id
        for plan in plans:
            ids: list[int] | None = None
            spliced = 0
            assistant = plan.assistant
            if assistant is not None:
                at_turn = hasher.copy()
                at_turn.update(self._gen_prompt_packed)
                digest = at_turn.digest()
                sampled = self._sampled.get((digest, assistant.key))
                if sampled is not None:
                    closing = [] if sampled and sampled[-1] == im_end else [im_end]
                    ids = [*self._gen_prompt, *sampled, *closing, *self._newline]
                    spliced = len(sampled)
                    cut = self._cut.get((digest, assistant.key)) if self._cut else None
                    if cut is not None:
                        spliced = cut[0]
                        tokenized += len(sampled) - cut[0]
                        what = f"the returned turn; {CUT_CALL}"
                        turns.append(TurnMatch(plan.stop - 1, "cut", what, *cut))
                else:
                    body, turn = self._match(plan, assistant, digest)
                    turns.append(turn)
                    if body is not None:
                        ids = [*self._gen_prompt, *body, im_end, *self._newline]
                        spliced = turn.spliced
                        tokenized += len(body) - turn.spliced
            if ids is None:
                ids = self.tokenizer.encode(plan.text)
                tokenized += len(ids)
            chunk = pack_ids(ids)
            hasher = hasher.copy()
            hasher.update(chunk)
            packed += chunk
            if ids:
                if ids_json:
                    ids_json += b","
                ids_json += memoryview(orjson.dumps(ids))[1:-1]
            end += len(ids)
            spliced_total += spliced
            segments.append(
                _Segment(plan.key, plan.stop, ids, hasher, len(ids_json), end, spliced_total, len(turns))
            )
        self._segments = segments
        self._messages, self._tools = now, listing
        final = hasher.copy()
        final.update(self._gen_prompt_packed)
        return RenderedPrompt(
            # The kept ids and the generation prompt: one copy of their bytes.
            prompt_ids=Tokens.of_bytes(b"".join((packed, self._gen_prompt_packed))),
            digest=final.digest(),
            spliced_tokens=spliced_total,
            tokenized_tokens=tokenized,
            unmatched_assistant_turns=sum(t.kind == "unmatched" for t in turns),
            turns=tuple(turns),
            prompt_json=b"".join(
                (b"[", ids_json, b"," if ids_json and self._gen_prompt else b"", self._gen_prompt_json, b"]")
            ),
        )

    def _match(self, plan: _Plan, message: Message, digest: bytes) -> tuple[list[int] | None, TurnMatch]:
        """A turn not sampled exactly as sent: the ids of its text's match with what was sampled
        after the same prompt (None: none), and how it matched (``appliance.chat.turns``)."""
        text = plan.text
        assert text.startswith(GENERATION_PROMPT) and text.endswith(_TURN_END)
        body = text[len(GENERATION_PROMPT) : len(text) - len(_TURN_END)]
        candidates = self._by_prompt.get(digest, ())
        elsewhere = not candidates and (
            message.key in self._sampled_keys
            or any(
                resembles(self.tokenizer, message, body, turn)
                for turns in self._by_prompt.values()
                for turn in turns
            )
        )
        return match_turn(self.tokenizer, plan.stop - 1, message, body, candidates, elsewhere)
