"""The proxy through real clients: the openai SDK for the happy path, raw HTTP for bad input."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.proxy import server
from appliance.rollouts import registry
from store.events import LLMCallCompleted, RewardReported
from tests.support import make_config
from tests.support import recorded_calls as calls_recorded
from tests.support import register_rollout as rollout
from tests.support import rollout_base as base


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


async def test_chat_completion_through_the_openai_sdk(app: Appliance) -> None:
    active = rollout(app)
    async with AsyncOpenAI(base_url=base(app, active) + "/v1", api_key=active.token, max_retries=0) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [app.model_name]
        response = await client.chat.completions.create(
            model=app.model_name, messages=[{"role": "user", "content": "What is 1 + 2?"}], max_tokens=6
        )
    (call,) = await calls_recorded(app)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(call.prompt_ids)
    assert response.usage.completion_tokens == len(call.response_ids) <= 6
    assert call.rollout == "r1"
    assert call.surface == "openai.chat"
    assert call.request["messages"] == [{"role": "user", "content": "What is 1 + 2?"}]
    assert len(call.response_logprobs) == len(call.response_ids)
    assert call.policy_version == 0
    assert "OpenAI" in call.user_agent or "openai" in call.user_agent.lower()
    assert (choice.message.content or "") in call.response_text


async def test_reward_endpoint_records_an_event(app: Appliance) -> None:
    active = rollout(app)
    async with aiohttp.ClientSession() as http:
        ok = await http.post(
            base(app, active) + "/reward",
            json={"reward": 0.5},
            headers={"Authorization": f"Bearer {active.token}"},
        )
        assert ok.status == 200
        bad = await http.post(
            base(app, active) + "/reward", json={"reward": "high"}, headers={"x-api-key": active.token}
        )
        assert bad.status == 400
    rewards = [s.event for s in await app.store.read(types={"RewardReported"})]
    assert [(r.rollout, r.reward) for r in rewards if isinstance(r, RewardReported)] == [("r1", 0.5)]


GOOD: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"messages": GOOD["messages"]}, 400, "model"),
        ({"model": "m"}, 400, "messages"),
        ({"model": "m", "messages": []}, 400, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ({**GOOD, "temperature": "hot"}, 400, "temperature"),
        ({**GOOD, "max_tokens": -1}, 400, "max_tokens"),
        ({**GOOD, "n": 99}, 400, "n"),
        ({**GOOD, "n": 2, "stream": True}, 400, "n"),
        ({**GOOD, "stream": "yes"}, 400, "stream"),
        ({**GOOD, "stop": [1]}, 400, "stop"),
        ({**GOOD, "tool_choice": "sometimes"}, 400, "tool_choice"),
        ({**GOOD, "response_format": {"type": "xml"}}, 400, "response_format"),
        ({**GOOD, "tools": [{"type": "function", "function": {}}]}, 400, "tools[0]"),
        ({**GOOD, "messages": [{"role": "user", "content": "1 2 3 4 5 6 7 8 9 " * 400}]}, 400, "messages"),
        (b"x" * (5 * 1024 * 1024), 413, None),
    ],
)
async def test_bad_input_gets_an_openai_error_and_nothing_is_recorded(
    app: Appliance, body: Any, status: int, param: str | None
) -> None:
    active = rollout(app)
    headers = {"Authorization": f"Bearer {active.token}", "Content-Type": "application/json"}
    url = base(app, active) + "/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        response = await http.post(url, headers=headers, **kwargs)
        payload = await response.json()
        assert response.status == status, payload
        assert set(payload["error"]) >= {"message", "type", "param", "code"}
        assert payload["error"]["message"]
        assert payload["error"]["param"] == param
        # The appliance keeps serving after the bad request.
        again = await http.post(url, headers=headers, json=GOOD)
        assert again.status == 200
    assert len(await calls_recorded(app)) == 1


async def test_auth_and_unknown_rollouts(app: Appliance) -> None:
    """A wrong key and a rollout that does not exist answer alike (the same status and body, but
    for the id the client sent), on every rollout route: which rollout ids exist cannot be
    probed without a key."""
    mine, other = rollout(app, "mine"), rollout(app, "other")
    async with aiohttp.ClientSession() as http:
        cases = [
            (base(app, mine), None),
            (base(app, mine), "wrong"),
            (base(app, mine), other.token),
            (f"{app.proxy_url}/rollouts/nope", mine.token),
            (f"{app.proxy_url}/rollouts/nope", None),
        ]
        for route in ("/v1/chat/completions", "/v1/responses/resp_x", "/reward"):
            answers = set()
            for url, token in cases:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                method = http.get if route.startswith("/v1/responses/") else http.post
                response = await method(url + route, json=GOOD, headers=headers)
                payload = await response.text()
                name = url.rsplit("/", 1)[-1]
                answers.add((response.status, payload.replace(repr(name), "'<rollout>'")))
            ((status, payload),) = answers
            assert status == 401, route
            assert json.loads(payload)["error"]["type"] == "authentication_error"
        unknown_route = await http.get(f"{app.proxy_url}/nothing-here")
        assert unknown_route.status == 404
        assert "error" in await unknown_route.json()
    assert await calls_recorded(app) == []


async def test_rollout_less_v1_needs_the_admin_token(app: Appliance) -> None:
    mine = rollout(app)
    async with aiohttp.ClientSession() as http:
        url = f"{app.proxy_url}/v1/chat/completions"
        denied = await http.post(url, json=GOOD, headers={"Authorization": f"Bearer {mine.token}"})
        assert denied.status == 401
        ok = await http.post(url, json=GOOD, headers={"Authorization": f"Bearer {app.admin_token}"})
        assert ok.status == 200
        status = await http.get(f"{app.proxy_url}/admin/status", headers={"x-api-key": app.admin_token})
        assert (await status.json())["serving"] is True
        assert (await http.get(f"{app.proxy_url}/admin/status")).status == 401
    (call,) = await calls_recorded(app)
    assert call.rollout == "default"
    token_file = app.config.data_dir / "admin_token"
    assert token_file.read_text().strip() == app.admin_token
    assert token_file.stat().st_mode & 0o077 == 0


#: A streamed call per surface, long enough to be under way when its client goes away.
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {**GOOD, "max_tokens": 400, "stream": True}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "Count:", "max_tokens": 400, "stream": True}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 400, "stream": True}),
    "messages": ("/v1/messages", {**GOOD, "max_tokens": 400, "stream": True}),
}


async def _drop_mid_stream(
    app: Appliance, surface: str, caplog: pytest.LogCaptureFixture, name: str
) -> LLMCallCompleted:
    """One streamed call whose client closes after the first event; the call as recorded once
    the handler has met the closed connection (or logged anything louder than INFO)."""
    path, body = STREAMS[surface]
    active = rollout(app, name)
    before = app.live.position
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            base(app, active) + path, json=body, headers={"Authorization": f"Bearer {active.token}"}
        )
        assert response.status == 200
        await response.content.readline()  # the first event arrived: generation is under way
        response.close()
    async with asyncio.timeout(30):
        await app.live.wait_for(before + 1)
        # The handler meets the closed connection at its next write, after the call is recorded.
        while not [r for r in caplog.records if r.levelno >= logging.INFO and "went away" in r.getMessage()]:
            if any(r.levelno >= logging.WARNING for r in caplog.records):
                break
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # anything logged late would show now
    return (await calls_recorded(app))[-1]


@pytest.mark.parametrize("surface", sorted(STREAMS))
async def test_a_client_gone_mid_stream_is_one_info_line_without_a_traceback(
    app: Appliance, surface: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A harness that drops its connection mid-stream is routine: its call is recorded as
    cancelled, and the log says so once at INFO, with no ERROR traceback from aiohttp.

    The tiny model's weights are random: now and then it samples its end token within the few
    milliseconds the close takes to reach the handler, and the call ends ``stop`` on its own. Such
    a try tests nothing and is made again (at most five tries; each is a fresh call)."""
    caplog.set_level(logging.INFO)
    for attempt in range(5):
        caplog.clear()
        call = await _drop_mid_stream(app, surface, caplog, f"r{attempt}")
        if call.finish_reason != "stop":
            break
    assert call.finish_reason == "cancelled"
    loud = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == []
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert [(r.name, r.levelno, r.exc_info) for r in gone] == [("appliance.proxy.server", logging.INFO, None)]


@pytest.mark.parametrize(
    ("path", "headers", "status", "shape"),
    [
        ("/v1/chat/completions?x=" + "a" * 10_000, {}, 414, "openai"),  # a 10 KB URL
        ("/v1/chat/completions", {"Authorization": "Bearer " + "t" * 60_000}, 431, "openai"),
        ("/v1/messages", {"x-api-key": "k" * 60_000, "anthropic-version": "2023-06-01"}, 431, "anthropic"),
        # Past what the HTTP parser reads: refused before the path is known, with the same status,
        # in both shapes at once.
        ("/v1/messages", {"x-api-key": "k" * 100_000}, 431, "both"),
        ("/v1/chat/completions?x=" + "a" * 100_000, {}, 414, "openai"),  # within the parser's reach
        ("/v1/chat/completions?x=" + "a" * 200_000, {}, 414, "both"),
    ],
    ids=["url-10k", "bearer-60k", "anthropic-key-60k", "header-100k", "url-100k", "url-200k"],
)
async def test_an_oversized_url_or_header_is_refused_in_json(
    app: Appliance, path: str, headers: dict[str, str], status: int, shape: str
) -> None:
    """A URL or header past the proxy's limits is a 414 or 431 in the surface's error shape;
    past the HTTP parser's, the same status with a body both SDKs read (OpenAI's error fields
    inside Anthropic's envelope); never aiohttp's plain text, and never the oversized value
    repeated."""
    active = rollout(app)
    host, port = app.proxy_url.removeprefix("http://").rsplit(":", 1)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    lines = [
        f"POST /rollouts/{active.rollout}{path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    assert int(status_line.split()[1]) == status, raw[:300]
    assert any(h.lower().startswith("content-type: application/json") for h in header_lines), head
    error = json.loads(payload)
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]
    if shape in ("openai", "both"):
        assert {"message", "param", "code"} <= set(error["error"])
        assert error["error"]["code"] == {414: "url_too_long", 431: "header_too_large"}[status]
    if shape in ("anthropic", "both"):
        assert error["type"] == "error"
    if shape == "openai":
        assert set(error) == {"error"}
    assert "aaaa" not in error["error"]["message"] and "kkkk" not in error["error"]["message"]
    assert "tttt" not in error["error"]["message"]
    assert await calls_recorded(app) == []


async def _raw(app: Appliance, head: bytes) -> int:
    """Send ``head`` as a request's head; the status answered."""
    host, port = app.proxy_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(raw.split(b" ", 2)[1])


async def test_malformed_requests_are_one_throttled_warning_each_never_a_traceback(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the HTTP parser refuses is the client's doing: one WARNING line each (no traceback,
    nothing of the request repeated), at most ``MALFORMED_LOGS`` per interval, and the first line
    after an interval counts the lines held back, so a client cannot fill the log."""
    monkeypatch.setattr(server, "MALFORMED_LOGS", (3, 0.5))
    caplog.set_level(logging.DEBUG)
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        url = b"GET /v1/models?x=" + b"s" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        bad = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n"
        assert [await _raw(app, url if i % 2 else bad) for i in range(8)] == [400, 414] * 4
        await asyncio.sleep(0.6)
        assert await _raw(app, bad) == 400
    loud = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "could not be read" in r.getMessage()
    ]
    assert [r.levelno for r in loud] == [logging.WARNING] * 4
    assert all(r.exc_info is None and "ssss" not in r.getMessage() for r in loud)
    assert "5 more like it not logged" in loud[-1].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_a_log_throttle_writes_at_most_its_lines_per_interval_then_counts_the_rest() -> None:
    now = [0.0]
    written: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            written.append(record.getMessage())

    logger = logging.getLogger("tests.throttle")
    logger.addHandler(handler := Catch())
    try:
        throttle = server.LogThrottle(logger, 2, 10.0, clock=lambda: now[0])
        for i in range(5):
            throttle.warning(f"line {i}")
        now[0] = 10.0
        throttle.warning("line 5")
        throttle.warning("line 6")
    finally:
        logger.removeHandler(handler)
    assert written == ["line 0", "line 1", "line 5 (3 more like it not logged before this one)", "line 6"]


async def test_the_rollout_less_conversation_splices_only_its_newest_turns(
    app: Appliance, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /v1 has one conversation for the life of the process: it remembers its newest
    # DEFAULT_SAMPLED_TURNS answers (two here), so its memory stays bounded however many come.
    monkeypatch.setattr(registry, "DEFAULT_SAMPLED_TURNS", 2)
    oai = AsyncOpenAI(base_url=f"{app.proxy_url}/v1", api_key=app.admin_token, max_retries=0)
    asked = [f"What is {i} + {i}?" for i in range(4)]
    answers = []
    for question in asked:
        answer = await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], max_tokens=4
        )
        answers.append(answer.choices[0].message.content or "")
    for i in (0, 3):
        await oai.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": asked[i]},
                {"role": "assistant", "content": answers[i]},
                {"role": "user", "content": "And then?"},
            ],
            max_tokens=2,
        )
    *_, oldest, newest = await calls_recorded(app)
    assert (oldest.spliced_tokens, oldest.unmatched_assistant_turns) == (0, 1)
    assert newest.spliced_tokens > 0 and newest.unmatched_assistant_turns == 0
