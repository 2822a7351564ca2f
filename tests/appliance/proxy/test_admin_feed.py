"""GET /admin/events: the read-only event feed the dashboard polls, on a real appliance."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from appliance.app import Appliance
from store.codec import StoredEvent
from tests.support import make_config
from tests.tui.run_events import run_events
from tui.source import HttpSource


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
