"""GET /admin/events: the read-only event feed the dashboard polls, on a real appliance."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from appliance.app import Appliance
from store.codec import StoredEvent
from store.events import LLMCallCompleted
from tests.support import make_config
from tests.tui.run_events import run_events
from tui.source import HttpSource, SqliteSource, decode_feed_event


async def test_feed_pages_the_log_exactly_and_needs_the_admin_token(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        await app.store.append(run_events())  # calls whose prompts share prefixes, rewards, steps
        stored = await app.store.read()
        url = f"{app.proxy_url}/admin/events"
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as response:
                assert response.status == 401
                assert "admin token" in (await response.json())["error"]["message"]
            headers = {"Authorization": f"Bearer {app.admin_token}"}
            async with session.get(url, params={"limit": "0"}, headers=headers) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == "limit"
            async with session.get(url, params={"after": "x"}, headers=headers) as response:
                assert response.status == 400
            async with session.get(url, params={"after": "3", "limit": "2"}, headers=headers) as response:
                body = await response.json()
            assert [e["position"] for e in body["events"]] == [4, 5]
            assert body["last_position"] == stored[-1].position

        source = HttpSource(app.proxy_url, app.admin_token)
        try:
            fetched: list[StoredEvent] = []
            while page := await source.poll(fetched[-1].position if fetched else 0, limit=25):
                fetched += page
        finally:
            await source.close()
    assert fetched == stored


async def test_a_rollouts_calls_read_over_the_feed_and_from_the_file_are_the_logs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the dashboard opens for a trained rollout (its state no longer holds the calls)."""
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as app:
        await app.store.append(run_events())
        wanted = {
            rollout: [s.event for s in await app.store.read(rollout=rollout, types=[LLMCallCompleted.type])]
            for rollout in ("r-0-0", "r-1-1")
        }
        assert len(wanted["r-1-1"]) == 2  # the second call's prompt shares the first's prefix
        url = f"{app.proxy_url}/admin/events"
        headers = {"Authorization": f"Bearer {app.admin_token}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(url, params={"rollout": ""}) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == "rollout"
            async with session.get(url, params={"rollout": "r-1-1"}) as response:
                body = await response.json()
            assert {e["type"] for e in body["events"]} >= {"RolloutCreated", "LLMCallCompleted"}
            assert all(s.event.rollout_id == "r-1-1" for s in map(decode_feed_event, body["events"]))
        monkeypatch.setattr("tui.source.PAGE", 1)  # a rollout's events over several pages
        source = HttpSource(app.proxy_url, app.admin_token)
        try:
            over_http = {rollout: await source.calls(rollout) for rollout in wanted}
            assert await source.calls("no-such-rollout") == []
        finally:
            await source.close()
        from_file = {rollout: await SqliteSource(app.config.db_path).calls(rollout) for rollout in wanted}
    assert over_http == wanted
    assert from_file == wanted
