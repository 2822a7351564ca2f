"""A rollout offered to external runners and not claimed yet is "offered" in every view: ``status``
(text and JSON), ``GET /admin/status``, and the dashboard's overview and rollouts table; once a
runner claims it (``RolloutClaimed``), it is "running" in every one."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.cli import main
from appliance.cli.status import status_report
from harness_adapters import runner
from store.events import RolloutClaimed
from store.eventstore import read_events_sync
from tests.support import make_config
from tui.model import DashboardModel
from tui.widgets.overview import OverviewPanel


async def test_every_view_names_an_unclaimed_external_rollout_offered(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(tmp_path, tiny_model_dir, adapter="external", runner_claim_wait_s=5.0)
    async with Appliance(config) as app:
        group = await app.controller.start_group(2)
        claim = await runner.claim(app.proxy_url, app.admin_token)
        assert claim.rollout_id == f"{group}-r0"
        headers = {"Authorization": f"Bearer {app.admin_token}"}
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.get(f"{app.proxy_url}/admin/status") as response,
        ):
            admin = await response.json()
        assert (admin["rollouts"], admin["offered"]) == (2, 1)

        events = [s.event for s in read_events_sync(config.db_path)]
        assert [e.rollout for e in events if isinstance(e, RolloutClaimed)] == [claim.rollout_id]
        report = status_report(config.data_dir)
        assert report["rollouts"] == {"offered": 1, "running": 1, "finished": 0, "failed": 0}
        assert main(["status", "--data-dir", str(config.data_dir)]) == 0
        assert "rollouts offered 1  running 1  finished 0  failed 0" in capsys.readouterr().out

        model = DashboardModel()
        model.extend(read_events_sync(config.db_path))
        assert {row.rollout: row.status for row in model.rows()} == {
            f"{group}-r0": "running",
            f"{group}-r1": "offered",
        }
        counts = model.counts()
        assert (counts.offered, counts.running) == (1, 1)
        overview = str(OverviewPanel.render_text(model, model.last_ts, [], True, 100))
        assert "offered 1  running 1  finished 0  failed 0" in overview
