"""Request bodies read as JSON objects, and a conversation's next body read from where its last
one ended.

Bodies are read with orjson (a model call's request holds the whole conversation, so its parse is
a per-call cost that grows with the history). Where orjson's reading could differ from Python's
``json`` (integers beyond 64 bits, which it reads as floats) or refuses a body (``NaN``, a lone
surrogate escape, deep nesting), the body is read again with ``json`` and judged as before, so
what is accepted and every error stay the same (``parse_body``).

A conversation's next request repeats the last one's ``messages`` array (Responses without
``previous_response_id``: its ``input``) and adds to it; most clients write the repeated part
byte for byte as before. ``read_conversation`` keeps, per rollout, the last body's bytes up to the
end of its array's last element (the transcript's ``BodyHead``, with the members before the array
and the elements they hold): a body that starts with those bytes is in the same state of reading
there (inside the array, after an element, the object still open), so only what follows is read
(Python's ``json``, value by value) and the repeated elements are the same objects as before
(which ``appliance.chat.messages.MessageMemo`` then compares by identity).
Any body it cannot read that way (another start, a lone surrogate escape, nesting too deep,
anything malformed) is read whole by ``parse_body``, which also says what is wrong with it.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

import orjson

from appliance.chat.transcript import BodyHead
from contracts.errors import BadRequest
from store.codec import INEXACT_FROM

#: A ``\\uD800``-``\\uDFFF`` escape: JSON allows it, but alone it is no character.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


#: Arrays and objects nested deeper than this are refused: no API body needs it, and walking one
#: (rendering, recording) would recurse past Python's limit.
MAX_NESTING = 100
_TOO_DEEP = f"the request body nests arrays or objects deeper than {MAX_NESTING} levels"

_SPACE = re.compile(r"[ \t\n\r]*")
_SPACE_BYTES = b" \t\n\r"
_DECODER = json.JSONDecoder()
#: Bodies shorter than this are read whole and not remembered: orjson reads one in a few
#: microseconds, less than reading it from a head costs.
SMALL_BODY = 4096
#: Places where the array may close that are tried when a body is remembered (the last ones).
_CLOSINGS_TRIED = 4


def _scan(value: Any, *, floats: bool = True) -> str | None:
    """What makes a reading of a body unusable: ``"deep"`` (containers nested more than
    ``MAX_NESTING`` deep), with ``floats`` also ``"float"`` (a float that may be an integer orjson
    could not hold; orjson's reading only), or None. Walks the containers only (their scalars are
    looked at, not walked), so a long conversation of string messages costs a few microseconds
    per hundred messages."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            return "deep"
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif floats and kind is float and not -INEXACT_FROM < child < INEXACT_FROM:
                return "float"
    return None


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ``BadRequest`` saying what is wrong otherwise."""
    try:
        fast = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass  # Python's json says why (or reads what orjson refuses, such as NaN)
    else:
        if isinstance(fast, dict):
            found = _scan(fast)
            if found == "deep":
                raise BadRequest(_TOO_DEEP)
            if found is None:
                body: dict[str, Any] = fast
                return body
    return _stdlib_body(raw)


def _stdlib_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):
            # A pair decodes to one character; a lone surrogate would fail later, where the
            # call is recorded (no UTF-8 for it), so it is refused here.
            json.dumps(body, ensure_ascii=False).encode()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeEncodeError:
        raise BadRequest(
            "the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)"
        ) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise BadRequest(f"the request body holds a number Python cannot read: {exc}") from None
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if _scan(body, floats=False) == "deep":
        raise BadRequest(_TOO_DEEP)
    return body


def read_conversation(raw: bytes, head: BodyHead, key: str = "messages") -> dict[str, Any]:
    """``parse_body(raw)``, read from where ``head`` ends when ``raw`` starts with it (and ``head``
    is of the array ``key``: Chat Completions' and Messages' ``messages``, Responses' ``input``);
    ``head`` then holds ``raw``'s head. The body returned is the one ``parse_body`` reads (its
    array a list of its own; the repeated elements the same objects as last time). A body shorter
    than ``SMALL_BODY`` is read whole, ``head`` left as it was."""
    if len(raw) < SMALL_BODY:
        return parse_body(raw)
    if head.raw and head.key == key and raw.startswith(head.raw):
        body = _continued(raw, head)
        if body is not None:
            return body
    body = parse_body(raw)
    _remember(raw, body, head, key)
    return body


def _continued(raw: bytes, head: BodyHead) -> dict[str, Any] | None:
    """``raw`` read from the end of ``head`` (which it starts with), ``head`` moved to the end
    of its last element; None (``head`` unchanged) where what follows does not read as more
    elements, the array's end and the object's other members."""
    start = len(head.raw)
    tail_bytes = raw[start:]
    try:
        tail = tail_bytes.decode()
        read = _read_tail(tail)
        if read is not None and _SURROGATE_ESCAPE.search(tail_bytes):
            # A pair reads as one character; a lone surrogate is refused by the whole reading.
            json.dumps(read[::2], ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # not UTF-8 or JSON, a lone surrogate, a huge number
        return None
    if read is None:
        return None
    added, end, rest = read
    key = head.key
    if key in rest or _scan({key: added, **rest}, floats=False) is not None:
        return None
    messages = head.messages + added
    if added:
        cut = end if tail_bytes.isascii() else len(tail[:end].encode())
        head.raw, head.messages = raw[: start + cut], messages
    return {**head.before, key: messages[:], **rest}


def _read_tail(tail: str) -> tuple[list[Any], int, dict[str, Any]] | None:
    """What follows an array's element up to the end of the document: the further elements,
    where the last of them ends in ``tail`` (0: none), and the object's members after the array;
    None where ``tail`` is not that. Raises ``ValueError`` where a value is not JSON."""
    added: list[Any] = []
    end = 0
    at = _skip(tail, 0)
    while tail.startswith(",", at):
        value, end = _DECODER.raw_decode(tail, _skip(tail, at + 1))
        added.append(value)
        at = _skip(tail, end)
    if not tail.startswith("]", at):
        return None
    at = _skip(tail, at + 1)
    rest: dict[str, Any] = {}
    if tail.startswith(",", at):
        members = "{" + tail[at + 1 :]
        if not members.startswith('"', _skip(members, 1)):
            return None  # "," then the object's end
        rest, at = _DECODER.raw_decode(members)
        tail = members
    elif tail.startswith("}", at):
        at += 1
    else:
        return None
    if _skip(tail, at) != len(tail):
        return None
    return added, end, rest


def _skip(text: str, at: int) -> int:
    """The first position from ``at`` on that is not JSON whitespace."""
    found = _SPACE.match(text, at)
    return found.end() if found is not None else at


def _remember(raw: bytes, body: dict[str, Any], head: BodyHead, key: str) -> None:
    """``head`` set to ``raw``'s (``body``, as read): its bytes up to where its array's last
    element ends, found as the place the array closes, followed by the first member after it (or
    the object's end), and checked: those bytes with the array and the object closed read as the
    members up to the array, and what follows them reads as the members after it. Forgotten where
    no such place is found."""
    head.forget()
    messages = body.get(key)
    if type(messages) is not list or not messages:
        return
    keys = list(body)
    index = keys.index(key)
    before = {name: body[name] for name in keys[:index]}
    after = {name: body[name] for name in keys[index + 1 :]}
    if after:
        closings = [found.start() for found in _closing(next(iter(after))).finditer(raw)]
    else:
        inner = raw.rstrip(_SPACE_BYTES)
        inner = inner[:-1].rstrip(_SPACE_BYTES) if inner.endswith(b"}") else b""
        closings = [len(inner) - 1] if inner.endswith(b"]") else []
    for closing in reversed(closings[-_CLOSINGS_TRIED:]):
        cut = len(raw[:closing].rstrip(_SPACE_BYTES))
        try:
            upto = orjson.loads(raw[:cut] + b"]}")
            read = _read_tail(raw[cut:].decode())
        except (ValueError, RecursionError):
            continue
        if (
            read is not None
            and not read[0]
            and read[2] == after
            and list(upto) == keys[: index + 1]
            and upto == {**before, key: messages}
        ):
            head.raw, head.before, head.messages, head.key = raw[:cut], before, list(messages), key
            return


@lru_cache(maxsize=64)
def _closing(member: str) -> re.Pattern[bytes]:
    """Where an array closes and the object's member ``member`` follows it (the patterns of the
    last 64 members asked for kept compiled: the member is the client's)."""
    space = rb"[ \t\n\r]*"
    return re.compile(rb"\]" + space + rb"," + space + re.escape(orjson.dumps(member)) + space + rb":")
