"""Stored Responses: what ``store: true`` keeps, read back from the event log.

Owns the state behind ``previous_response_id`` (``ResponseLog``) and the routes that read and
delete it: ``GET /v1/responses/{id}`` (the response as answered), ``GET .../input_items`` (a
page of the items it answered, each with an id) and ``DELETE``. A stored response is a
``ResponseStored`` event and a deletion a ``ResponseDeleted`` event, both in the rollout that
made them, and every answer is folded from a rollout's own events
(``EventStore.read(rollout=...)``), so a rollout never sees another's responses and everything
survives a restart. What is kept in memory is a cache: the recent rollouts' folded events,
filled from the log on first use and extended by this process's own appends (the only writer).
It does not own ``POST /v1/responses`` nor how its bodies and answers are shaped
(``openai_responses``, which stores what it answered through ``keep``).

A response's input items are its ancestors' input items and output, then its own: a chain is
walked through ``previous_response_id`` whether or not an ancestor was deleted since (deleting
a response hides it; the responses already chained on it keep their context).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from appliance.proxy.http import CALLS, PREFIXES, add_get, json_answer, rollout_of
from appliance.proxy.validate import shown
from contracts.errors import BadRequest, NotFound
from store.events import JsonObject, ResponseDeleted, ResponseStored
from store.eventstore import EventStore

#: Rollouts whose stored responses are kept in memory (the least recently used go first; the
#: log still holds them).
CACHED_ROLLOUTS = 256
_TYPES = (ResponseStored.type, ResponseDeleted.type)
#: ``input_items``: the page size's default and largest value.
PAGE_DEFAULT, PAGE_MAX = 20, 100
#: The id prefix of an input item that came without one, by item type.
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass(slots=True)
class _Rollout:
    """One rollout's stored responses by id, and the ids deleted since."""

    stored: dict[str, ResponseStored] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)

    def apply(self, event: object) -> None:
        match event:
            case ResponseStored(response=response):
                self.stored[str(response.get("id"))] = event
            case ResponseDeleted(response_id=response_id):
                self.deleted.add(response_id)


class ResponseLog:
    """The stored responses of every rollout, kept in ``store``."""

    def __init__(self, store: EventStore, cached_rollouts: int = CACHED_ROLLOUTS) -> None:
        self.store = store
        self._cached = cached_rollouts
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        # One load at a time: a load that read the log before an append committed must not
        # replace the cache that append extended.
        self._loading = asyncio.Lock()

    async def _rollout(self, rollout: str) -> _Rollout:
        async with self._loading:
            state = self._rollouts.get(rollout)
            if state is None:
                state = _Rollout()
                for stored in await self.store.read(types=_TYPES, rollout=rollout):
                    state.apply(stored.event)
                self._rollouts[rollout] = state
                while len(self._rollouts) > self._cached:
                    self._rollouts.popitem(last=False)
            self._rollouts.move_to_end(rollout)
            return state

    async def get(self, rollout: str, response_id: str) -> ResponseStored | None:
        """The stored response, or None (never stored in this rollout, or deleted)."""
        state = await self._rollout(rollout)
        if response_id in state.deleted:
            return None
        return state.stored.get(response_id)

    async def input_items(self, rollout: str, response_id: str) -> list[JsonObject] | None:
        """Every input item the response answered, oldest first (its ancestors' input items and
        output, then its own); None if it is not retrievable."""
        found = await self.get(rollout, response_id)
        if found is None:
            return None
        state = await self._rollout(rollout)
        chain = [found]
        seen = {response_id}
        while (previous := chain[-1].response.get("previous_response_id")) is not None:
            earlier = state.stored.get(previous)
            if earlier is None or previous in seen:
                break  # only a log written by hand could lose or loop an ancestor
            seen.add(previous)
            chain.append(earlier)
        chain.reverse()
        items = list(chain[0].input_items)
        for earlier, later in itertools.pairwise(chain):
            items += [*_as_input(earlier.response), *later.input_items]
        return items

    async def context(self, rollout: str, response_id: str) -> list[JsonObject] | None:
        """What a request with ``previous_response_id`` continues: the response's input items
        then its output items; None if it is not retrievable."""
        items = await self.input_items(rollout, response_id)
        if items is None:
            return None
        found = await self.get(rollout, response_id)
        assert found is not None
        return [*items, *_as_input(found.response)]

    async def keep(self, rollout: str, response: Mapping[str, Any], items: Sequence[JsonObject]) -> None:
        """Make ``response`` (answering ``items``, the request's own input items) durable."""
        event = ResponseStored(
            ts=time.time(), rollout=rollout, response=dict(response), input_items=tuple(items)
        )
        await self._append(event)

    async def delete(self, rollout: str, response_id: str) -> bool:
        """Delete a stored response; False if there is none to delete."""
        if await self.get(rollout, response_id) is None:
            return False
        await self._append(ResponseDeleted(ts=time.time(), rollout=rollout, response_id=response_id))
        return True

    async def _append(self, event: ResponseStored | ResponseDeleted) -> None:
        await self.store.append([event])
        (await self._rollout(event.rollout)).apply(event)


def _as_input(response: Mapping[str, Any]) -> list[JsonObject]:
    """A response's output items, as the input items a request chained on it continues from."""
    output = response.get("output")
    return [dict(item) for item in output] if isinstance(output, list) else []


class PreviousResponseNotFound(BadRequest):
    """``previous_response_id`` names no response stored in this rollout (OpenAI's 400)."""

    code = "previous_response_not_found"

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"Previous response with id '{response_id}' not found.", param="previous_response_id"
        )


class ResponseNotFound(NotFound):
    """No stored response of this rollout has this id (never stored, ``store: false``, deleted,
    or another rollout's). OpenAI types its 404s as invalid requests."""

    error_type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.")


def input_items(raw: Any, call_id: str) -> list[dict[str, Any]]:
    """A request's (validated) ``input`` as the items ``input_items`` lists: each with its type
    and an ``id`` (the client's, or one made from the call's id), a message's content as parts."""
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        given = item.get("id")
        item_id = given if isinstance(given, str) else f"{_ID_PREFIXES.get(kind, 'item')}_{call_id}_in{i}"
        if kind == "message":
            role, content = item["role"], item["content"]
            if isinstance(content, str):
                text = "output_text" if role == "assistant" else "input_text"
                content = [{"type": text, "text": content}]
            if role == "assistant":
                content = [{"annotations": [], **part} for part in content]
            status = item.get("status") or "completed"
            out.append({"id": item_id, "type": "message", "role": role, "content": content, "status": status})
        elif kind == "reasoning":
            out.append({**item, "id": item_id})
        else:
            out.append({**item, "id": item_id, "type": kind, "status": item.get("status") or "completed"})
    return out


def _named(request: web.Request) -> tuple[str, str]:
    """The rollout a request comes from (its key checked) and the response id it names."""
    return rollout_of(request).rollout, request.match_info["response_id"]


async def _retrieve(request: web.Request) -> web.StreamResponse:
    rollout, response_id = _named(request)
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise BadRequest(
            "'stream' is not supported when retrieving a response: responses are answered in the "
            "foreground, so there are no events to replay; retrieve it without 'stream'",
            param="stream",
        )
    found = await request.app[RESPONSES].get(rollout, response_id)
    if found is None:
        raise ResponseNotFound(response_id)
    return json_answer(found.response)


def _page_query(query: Mapping[str, str]) -> tuple[str, int, str | None]:
    """``input_items``' ``order`` (desc by default), ``limit`` (1 to 100, 20 by default) and
    ``after``."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"'order' must be asc or desc; got {shown(order)}", param="order")
    raw = query.get("limit", str(PAGE_DEFAULT))
    # ASCII digits only, and few of them: str.isdigit() is true for "²" and "①", which int()
    # refuses, and int() refuses past 4,300 digits.
    limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 6 else 0
    if not 1 <= limit <= PAGE_MAX:
        raise BadRequest(f"'limit' must be an integer from 1 to {PAGE_MAX}; got {shown(raw)}", param="limit")
    return order, limit, query.get("after")


async def _input_items(request: web.Request) -> web.StreamResponse:
    rollout, response_id = _named(request)
    order, limit, after = _page_query(request.query)
    items = await request.app[RESPONSES].input_items(rollout, response_id)
    if items is None:
        raise ResponseNotFound(response_id)
    if order == "desc":
        items = items[::-1]
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), -1)
        if start < 0:
            raise BadRequest(f"'after': no input item with id {shown(after)} in {response_id}", param="after")
    page = items[start : start + limit]
    return json_answer(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }
    )


async def _delete(request: web.Request) -> web.StreamResponse:
    rollout, response_id = _named(request)
    if not await request.app[RESPONSES].delete(rollout, response_id):
        raise ResponseNotFound(response_id)
    return json_answer({"id": response_id, "object": "response", "deleted": True})


#: The app's stored responses (set by ``add_routes``).
RESPONSES = web.AppKey("responses", ResponseLog)


def add_routes(app: web.Application) -> None:
    """The stored responses' routes (``POST /v1/responses`` is the surface's); they live in the
    store of the app's ``CALLS``."""
    app[RESPONSES] = ResponseLog(app[CALLS].store)
    add_get(app, "/responses/{response_id}", _retrieve)
    add_get(app, "/responses/{response_id}/input_items", _input_items)
    for prefix in PREFIXES:
        app.router.add_delete(prefix + "/responses/{response_id}", _delete)
