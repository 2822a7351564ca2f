"""The text a streamed call may send its client now, from the tokens the engine has handed over.

Owns the buffer between the engine's token callbacks and the task that writes a client's stream
(``TokenArrivals``: the writer takes every token that came since it last looked, at once, and
never waits for more than one; so a writer that keeps up sends each group of tokens as the engine
hands it over, the first token included, and one slower than the engine sends several tokens'
text as one delta instead of falling behind by one delta per token; while the writer waits with
nothing left to take, a group may be handed straight to a ``Shortcut`` in the engine's callback,
one task switch fewer per group), the decoding of such groups
into text deltas that never end inside a character (``TextDeltas``), and what of the text must
wait (``stream_safe``: what may be the start of a stop string or of a tool-call block). It knows
nothing of calls, surfaces or HTTP.

Invariant: the deltas concatenate to the decoded text of the tokens taken (stop tokens left
out), cut before the first marker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from appliance.chat.tokenizer import Tokenizer

#: Takes a group of tokens at once, in the engine's callback, or declines it (False: the group
#: waits for ``TokenArrivals.take`` as if there were no shortcut).
Shortcut = Callable[[Sequence[int]], bool]


class TokenArrivals:
    """The sampled token ids not yet taken by the stream's writer, and whether sampling ended."""

    __slots__ = ("_ended", "_ids", "_shortcut", "_waiter")

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._shortcut: Shortcut | None = None

    def shortcut(self, take: Shortcut | None) -> None:
        """From now on (None: no longer), a group of tokens that comes while the writer waits in
        ``take`` with nothing left to take is offered to ``take`` first, in the caller of ``add``;
        the writer keeps waiting unless it declines. Tokens keep their order: a group is only
        offered when no earlier one waits to be taken."""
        self._shortcut = take

    def add(self, ids: Sequence[int]) -> None:
        """Tokens just sampled, in order."""
        shortcut = self._shortcut
        if shortcut is not None and not self._ids and self.waiting and shortcut(ids):
            return
        self._ids += ids
        self._wake()

    @property
    def waiting(self) -> bool:
        """Whether the writer waits in ``take`` (nothing was left to take)."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def end(self) -> None:
        """Sampling is over: ``take`` answers None once every token has been taken."""
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[int] | None:
        """Every token that came since the last take, waiting for one if none has; None once
        sampling has ended and every token was taken."""
        while not self._ids:
            if self._ended:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        ids, self._ids = self._ids, []
        return ids


class TextDeltas:
    """Text deltas of a growing token sequence: each group of tokens is decoded at once, with a
    short window of the tokens before it (``appliance.chat.tokenizer.IncrementalDecoder``'s
    method, a group at a time). Text that ends in an incomplete UTF-8 sequence (U+FFFD) is held
    back until a later token completes it; stop tokens are left out; text that may be the start
    of one of ``markers`` waits (``stream_safe``)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int], markers: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop_ids = frozenset(stop_ids)
        self._markers = markers
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        #: The text decoded so far, and how many of its characters were sent.
        self.text = ""
        self.sent = 0

    def push(self, tokens: Sequence[int]) -> str:
        """What can be sent now that ``tokens`` came too (possibly nothing)."""
        if not self._stop_ids.isdisjoint(tokens):
            tokens = [token for token in tokens if token not in self._stop_ids]
        if not tokens:
            return ""
        decoded = self._decode(tokens)
        if not decoded:
            return ""
        self.text += decoded
        if not self._markers:
            self.sent = len(self.text)
            return decoded
        safe = stream_safe(self.text, self._markers)
        if len(safe) <= self.sent:
            return ""
        delta = safe[self.sent :]
        self.sent = len(safe)
        return delta

    def _decode(self, tokens: Sequence[int]) -> str:
        ids = self._ids
        start = len(ids)
        ids += tokens
        decode = self._tokenizer.decode
        before = decode(ids[self._prefix : self._read])
        after = decode(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(ids)
            return after[len(before) :]
        if len(tokens) == 1:
            return ""
        # The group ends inside a character: token by token, so the whole characters before it
        # go now.
        del ids[start:]
        return "".join([self._decode((token,)) for token in tokens])


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the earliest stop string (OpenAI and Anthropic leave the stop string out)."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def stream_safe(text: str, markers: tuple[str, ...]) -> str:
    """The prefix of ``text`` that can be sent now: everything before the first marker (a stop
    string, or ``<tool_call>`` when tools are declared), and before a partial marker at the end."""
    if not markers:
        return text
    text = cut_at_stop(text, markers)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                text = text[:-k]
                break
    return text
