"""Matching an assistant turn the harness sent back against the turns this rollout sampled.

Owns the rule for a turn whose text is not exactly what the proxy returned (the exact case is
``Conversation``'s digest + key lookup, in ``appliance.chat.render``), and the reason recorded when
nothing matches. A turn sent back is compared, as the text it renders between the generation
prompt and ``<|im_end|>``, with the text the sampled ids decode to (everything the model sampled,
stop string and tool-call blocks included), for the turns sampled after the very same prompt:

* ``arguments``: the returned turn with its tool calls' arguments re-serialised (the same JSON
  values written differently, as pydantic-ai does): spliced as the returned turn is.
* ``cut`` (reported for a turn sent back exactly as returned, and within ``arguments``): the
  returned message holds fewer tool calls than were sampled (the length limit cut the last one,
  which the proxy does not return): the sampled ids are spliced up to the end of the last
  returned call, not the cut call the harness never saw.
* ``stop``: the turn is the returned text plus the stop string that ended it (a harness that
  re-appends its stop string, as smolagents' CodeAgent does with ``</code>``). The model sampled
  the stop string: when the sampled ids decode to exactly that text, they are all spliced and
  the next call continues the same token sequence. When the last sampled token runs past the
  stop string (``">\\n"`` holding the stop's ``">"``), the ids up to the last whole token inside
  the turn are spliced and the rest of the turn's text is tokenized: the prompt says exactly
  what the harness sent, never text it cut away.
* ``text``: the turn renders to exactly the sampled text (a harness that rebuilt the message
  from the text, e.g. tool calls written back as text): every sampled id is spliced.
* ``extended``: the turn is the sampled text (or the returned text + its stop string, labelled
  ``stop``) followed by text the harness added (smolagents writes "Calling tools: ..." after
  the code into the same assistant turn): the sampled ids are spliced and the added text is
  tokenized. The next call continues the sample; the added text is prompt (never trained).
* ``prefix``: the turn is a proper prefix of what was sampled (a harness that dropped a tool call
  the length limit cut off): the ids of that prefix are spliced, exactly up to the last sampled
  token inside it, then the rest of its text is tokenized. The ids sampled after the prefix stay
  in the call's own record, where they are trained after the prompt they were sampled from; the
  next call's prompt diverges there, so the trainer starts a new sample at it (a prefix break).

Anything else is unmatched and rendered from its text, with a reason: never sampled (few-shot
examples, turns from elsewhere), sampled after a different prompt (an earlier message changed),
its text differs from the returned text at a character, or its tool calls differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.chat.messages import Message
from appliance.chat.template import TOOL_CALL_CLOSE
from appliance.chat.tokenizer import IncrementalDecoder, Tokenizer

#: How a turn sent back was rendered: spliced by one of the rules above, or from its text.
MATCH_KINDS = ("arguments", "cut", "stop", "text", "prefix", "extended", "unmatched")


@dataclass(slots=True)
class SampledTurn:
    """What one call sampled after a prompt: the message returned, the ids (without the closing
    ``<|im_end|>``), and the stop string the returned text was cut before (and where)."""

    message: Message
    ids: tuple[int, ...]
    stop: str | None = None
    #: Where the stop string starts in the decoded ids (the length of the returned text).
    stop_at: int = 0
    #: The ids of the returned turn when it covers less than was sampled (``returned_part``), and
    #: how many of them are sampled ids; None when it covers everything.
    returned: tuple[int, ...] | None = None
    returned_sampled: int = 0
    _decoded: str | None = field(default=None, repr=False)

    def decoded(self, tokenizer: Tokenizer) -> str:
        if self._decoded is None:
            self._decoded = tokenizer.decode(self.ids)
        return self._decoded


@dataclass(frozen=True, slots=True)
class TurnMatch:
    """An assistant turn of a request that was not spliced exactly as it was returned."""

    #: Its position in the request's conversation (0-based, as the proxy read it).
    message: int
    #: One of ``MATCH_KINDS``.
    kind: str
    #: What matched, or why nothing did (e.g. "never sampled", "text differs at char 12").
    reason: str
    #: Sampled ids spliced into the prompt for it, and how many were sampled for the turn.
    spliced: int = 0
    sampled: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "kind": self.kind,
            "reason": self.reason,
            "spliced": self.spliced,
            "sampled": self.sampled,
        }


def match_turn(
    tokenizer: Tokenizer,
    index: int,
    message: Message,
    body: str,
    candidates: Sequence[SampledTurn],
    sampled_elsewhere: bool,
) -> tuple[list[int] | None, TurnMatch]:
    """The ids to splice for ``message`` (None: render it from text) and how it matched.

    ``body`` is the turn's text as rendered between the generation prompt and ``<|im_end|>``;
    ``candidates`` the turns sampled after the same prompt, newest first; ``sampled_elsewhere``
    whether, with no candidates, the turn ``resembles`` one sampled after another prompt."""
    for turn in candidates:
        if _same_but_arguments(message, turn.message):
            n = len(turn.ids)
            what = "the returned turn, its tool call arguments re-serialized"
            if turn.returned is None:
                return list(turn.ids), TurnMatch(index, "arguments", what, n, n)
            what += f"; {CUT_CALL}"
            return list(turn.returned), TurnMatch(index, "arguments", what, turn.returned_sampled, n)
    if not candidates:
        reason = (
            "sampled after a different prompt (an earlier message changed)"
            if sampled_elsewhere
            else "never sampled"
        )
        return None, TurnMatch(index, "unmatched", reason)
    for turn in candidates:
        found = _by_text(tokenizer, index, body, turn)
        if found is not None:
            return found
    return None, TurnMatch(index, "unmatched", _difference(message, candidates[0].message))


def _by_text(
    tokenizer: Tokenizer, index: int, body: str, turn: SampledTurn
) -> tuple[list[int], TurnMatch] | None:
    """The ids to splice for a turn rendering to ``body`` and how it matches ``turn``'s sampled
    text by the text rules above (``stop``, ``text``, ``extended``, ``prefix``); None if by none
    (or if not one whole sampled token lies within it)."""
    decoded = turn.decoded(tokenizer)
    with_stop = None if turn.stop is None else decoded[: turn.stop_at + len(turn.stop)]
    n = len(turn.ids)
    if body == decoded:
        kind = "stop" if with_stop == decoded else "text"
        what = "the sampled text" if kind == "text" else f"the returned text + its stop string {turn.stop!r}"
        return list(turn.ids), TurnMatch(index, kind, what, n, n)
    if with_stop is not None and body.startswith(with_stop):
        kind, what = "stop", f"the returned text + its stop string {turn.stop!r}"
        if len(body) > len(with_stop) and not decoded.startswith(body):
            what += f" + {len(body) - len(with_stop)} chars the harness added"
    elif decoded.startswith(body):
        kind, what = "prefix", f"a prefix ({len(body)} of {len(decoded)} chars) of the sampled text"
    elif body.startswith(decoded):
        kind, what = "extended", f"the sampled text + {len(body) - len(decoded)} chars the harness added"
    else:
        return None
    k, covered = _whole_tokens_within(tokenizer, turn.ids, body)
    if k == 0:
        return None
    rest = body[len(covered) :]
    boundary = "" if not rest else f"; its last {len(rest)} chars tokenized"
    return [*turn.ids[:k], *tokenizer.encode(rest)], TurnMatch(index, kind, f"{what}{boundary}", k, n)


def resembles(tokenizer: Tokenizer, message: Message, body: str, turn: SampledTurn) -> bool:
    """Whether a turn sent back as ``message`` (rendering to ``body``) would have matched
    ``turn`` by one of the rules above, had it come after the prompt ``turn`` was sampled after:
    what tells a turn whose prompt changed from one never sampled, changed by the harness or not."""
    return (
        message.key == turn.message.key
        or _same_but_arguments(message, turn.message)
        or _by_text(tokenizer, 0, body, turn) is not None
    )


#: How a turn that leaves out the rest of its sampled text after its last tool call is described.
CUT_CALL = "the sampled text after its last tool call (a call the length limit cut) left out"


def returned_part(
    tokenizer: Tokenizer, message: Message, ids: Sequence[int]
) -> tuple[tuple[int, ...], int] | None:
    """The ids of what the returned ``message`` says, when its tool calls end before the sampled
    text does (a call the length limit cut is not returned, nor text after the calls): the
    sampled ids up to the end of its last tool call (whole tokens; the rest of that text
    tokenized) and how many of them are sampled. None when the message covers it all."""
    if not message.tool_calls:
        return None
    decoded = tokenizer.decode(list(ids))
    end = decoded.rfind(TOOL_CALL_CLOSE)
    if end < 0:
        return None
    end += len(TOOL_CALL_CLOSE)
    if not decoded[end:].strip():
        return None
    k, covered = _whole_tokens_within(tokenizer, ids, decoded[:end])
    return (*ids[:k], *tokenizer.encode(decoded[len(covered) : end])), k


def _same_but_arguments(sent: Message, returned: Message) -> bool:
    """Whether ``sent`` is the returned turn with its tool calls' arguments written differently
    (the same JSON values: a harness that parsed and re-serialised them)."""
    if not sent.tool_calls or sent.content != returned.content:
        return False
    if len(sent.tool_calls) != len(returned.tool_calls):
        return False
    for a, b in zip(sent.tool_calls, returned.tool_calls, strict=True):
        if a.name != b.name:
            return False
        try:
            if json.loads(a.arguments) != json.loads(b.arguments):
                return False
        except json.JSONDecodeError:
            return False
    return True


def _whole_tokens_within(tokenizer: Tokenizer, ids: Sequence[int], body: str) -> tuple[int, str]:
    """The most leading ``ids`` whose text is a prefix of ``body`` (ending on a whole character),
    and that text. Decodes a short window per token (``IncrementalDecoder``), then checks once."""
    decoder = IncrementalDecoder(tokenizer)
    text = ""
    best = 0
    for i, token in enumerate(ids):
        delta = decoder.push(token)
        if not delta:
            continue
        text += delta
        if len(text) > len(body) or not body.startswith(text):
            break
        best = i + 1
    covered = tokenizer.decode(list(ids[:best])) if best else ""
    if not body.startswith(covered):  # a decoder that is not compositional: splice nothing
        return 0, ""
    return best, covered


def _difference(sent: Message, returned: Message) -> str:
    """Why ``sent`` is not the turn the proxy returned: where its text or tool calls differ."""
    if sent.content != returned.content:
        a, b = sent.content, returned.content
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return f"text differs at char {at} ({len(a)} chars sent, {len(b)} returned)"
    mine, theirs = sent.tool_calls, returned.tool_calls
    if len(mine) != len(theirs):
        return f"tool calls differ ({len(mine)} sent, {len(theirs)} returned)"
    for i, (a_call, b_call) in enumerate(zip(mine, theirs, strict=True)):
        if a_call.name != b_call.name:
            return f"tool call {i} differs (name {a_call.name!r}, returned {b_call.name!r})"
        if a_call.arguments != b_call.arguments:
            return f"tool call {i} differs (arguments)"
    return "rendered text differs from the sampled text"
