"""Security of the proxy and of what it starts: token scoping, the admin token, the bind
address, task fields in command templates, and secrets kept out of the event log and the logs.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic

from appliance.app import Appliance
from harness_adapters.base import Task
from harness_adapters.command import CommandAdapter
from tests.harness_adapters.support import client_config
from tests.support import make_config, openai_client, recorded_calls, register_rollout, rollout_base

ADMIN_TOKEN = "la-admin-test-SECRET-0123456789"
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, admin_token=ADMIN_TOKEN)) as appliance:
        yield appliance


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def request(
    app: Appliance, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, app.proxy_url + path, json=body, headers=headers) as response,
    ):
        return response.status, await response.json()


async def test_a_rollout_token_cannot_call_or_reward_another_rollout(app: Appliance) -> None:
    mine, theirs = register_rollout(app, "mine"), register_rollout(app, "theirs")
    before = app.store.last_position
    for path, body in (
        ("/rollouts/theirs/v1/chat/completions", CHAT),
        ("/rollouts/theirs/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
        ("/rollouts/theirs/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}),
        ("/rollouts/theirs/reward", {"reward": 1.0}),
    ):
        status, payload = await request(app, "POST", path, bearer(mine.token), body)
        assert status == 401, path
        assert payload["error"]["code"] == "invalid_api_key"
        # The x-api-key header (Anthropic clients) is held to the same rule.
        status, _ = await request(app, "POST", path, {"x-api-key": mine.token}, body)
        assert status == 401, path
    status, _ = await request(app, "GET", "/rollouts/theirs/v1/models", bearer(mine.token))
    assert status == 401
    # Neither the admin token nor no token at all opens a rollout's routes.
    status, _ = await request(app, "POST", "/rollouts/theirs/v1/chat/completions", bearer(ADMIN_TOKEN), CHAT)
    assert status == 401
    status, _ = await request(app, "POST", "/rollouts/theirs/v1/chat/completions", {}, CHAT)
    assert status == 401
    status, payload = await request(
        app, "POST", "/rollouts/nobody/v1/chat/completions", bearer(mine.token), CHAT
    )
    # A rollout that does not exist answers as a wrong key does: its existence cannot be probed.
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    assert app.store.last_position == before
    assert theirs.reward is None and theirs.calls == 0
    # Its own token works.
    status, _ = await request(app, "POST", "/rollouts/theirs/reward", bearer(theirs.token), {"reward": 0.5})
    assert status == 200 and theirs.reward == 0.5


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/messages", CHAT),
        ("GET", "/v1/models", None),
        ("GET", "/admin/status", None),
        ("GET", "/admin/events", None),
    ],
)
async def test_admin_routes_need_the_admin_token(
    app: Appliance, method: str, path: str, body: dict[str, Any] | None
) -> None:
    rollout = register_rollout(app)
    before = app.store.last_position
    for headers in ({}, bearer(rollout.token), bearer(ADMIN_TOKEN + "x"), {"x-api-key": rollout.token}):
        status, _ = await request(app, method, path, headers, body)
        assert status == 401, headers
    assert app.store.last_position == before
    status, _ = await request(app, method, path, bearer(ADMIN_TOKEN), body)
    assert status == 200


async def test_health_is_open_but_tells_nothing_secret(app: Appliance) -> None:
    rollout = register_rollout(app)
    status, payload = await request(app, "GET", "/healthz", {})
    assert status == 200
    assert rollout.token not in str(payload) and ADMIN_TOKEN not in str(payload)


async def test_loopback_by_default_and_a_loud_warning_elsewhere(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="appliance.app")
    async with Appliance(make_config(tmp_path / "a", tiny_model_dir)) as app:
        assert app.config.proxy.host == "127.0.0.1" and app.proxy_url.startswith("http://127.0.0.1:")
    assert not [r for r in caplog.records if "listens on" in r.getMessage()]

    async with Appliance(make_config(tmp_path / "b", tiny_model_dir, host="0.0.0.0")) as app:
        assert app.proxy_url.startswith("http://0.0.0.0:")
    (warning,) = [r for r in caplog.records if "listens on" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "0.0.0.0" in warning.getMessage() and "any host" in warning.getMessage()


async def test_task_fields_cannot_run_shell_commands(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    payload = (
        f"$(touch {marks}/dollar); `touch {marks}/backtick`; touch {marks}/semicolon && "
        f"touch {marks}/and | touch {marks}/pipe $(id) `id`"
    )
    script = 'printf "%s" "$1" > arg.txt; printf "%s" "$TASK_TITLE" > env.txt'
    adapter = CommandAdapter(
        command=["sh", "-c", script, "sh", "{title}"],
        verifier=[sys.executable, "-c", "import sys; print(1.0 if sys.argv[1:] else 0.0)", "{title}"],
        reward_from="stdout",
        workdir_root=tmp_path / "rollouts",
        keep_workdirs="always",
    )
    reward = await adapter.run(Task("t", {"title": payload}), client_config())
    assert reward == 1.0  # the verifier got the field as one argument
    (rdir,) = [p for p in (tmp_path / "rollouts").iterdir() if p.is_dir()]
    assert (rdir / "work" / "arg.txt").read_text() == payload
    assert (rdir / "work" / "env.txt").read_text() == payload
    assert sorted(p.name for p in marks.iterdir()) == []


async def test_secrets_never_reach_the_event_log_or_the_logs(
    app: Appliance, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rollout = register_rollout(app)
    async with openai_client(app, rollout) as oai:
        await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        stream = await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        async for _ in stream:
            pass
        await oai.completions.create(model="m", prompt="hi", max_tokens=2)
        await oai.responses.create(model="m", input="hi", max_output_tokens=2)
    async with AsyncAnthropic(
        base_url=rollout_base(app, rollout), api_key=rollout.token, max_retries=0
    ) as ant:
        await ant.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    status, _ = await request(app, "POST", "/v1/chat/completions", {"x-api-key": ADMIN_TOKEN}, CHAT)
    assert status == 200
    status, _ = await request(
        app, "POST", f"/rollouts/{rollout.rollout}/reward", bearer(rollout.token), {"reward": 1}
    )
    assert status == 200
    # A refused token must not be logged either.
    await request(
        app, "POST", f"/rollouts/{rollout.rollout}/reward", bearer("la-wrong-SECRET"), {"reward": 1}
    )
    assert len(await recorded_calls(app)) == 6

    secrets = [rollout.token, ADMIN_TOKEN, "la-wrong-SECRET"]
    rows = 0
    with sqlite3.connect(app.config.db_path) as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for row in db.execute(f"SELECT * FROM {table}"):
                rows += 1
                raw = b"".join(v if isinstance(v, bytes) else str(v).encode() for v in row)
                assert not [s for s in secrets if s.encode() in raw], (table, row[:3])
    assert rows >= 8
    for path in app.config.data_dir.rglob("events.sqlite*"):  # the database and its WAL
        data = path.read_bytes()
        assert not [s for s in secrets if s.encode() in data], path
    assert not [s for s in secrets if s in caplog.text]
