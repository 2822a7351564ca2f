"""Fixtures for the dashboard tests: a store filled by a real short run, and a hand-built one.

``real_run`` runs a real Appliance (tiny model, two steps) once per session, in its own thread and
event loop, while a dashboard model follows it live through ``GET /admin/events``; the tests then
open its store read-only. ``fixture_db`` writes the deterministic events of ``run_events`` for
snapshots.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.app import Appliance
from tests.support import make_config
from tests.tui.run_events import write_run
from tui.app import DashboardApp
from tui.model import DashboardModel
from tui.source import ControlClient, HttpSource, SqliteSource
from tui.system import Usage


@dataclass(frozen=True)
class RealRun:
    data_dir: Path
    db: Path
    #: Folded from the admin event feed while the appliance ran (it stops before ApplianceStopped).
    live: DashboardModel
    #: Position of the ControlRequested the run's dashboard client sent mid-run.
    control_position: int


async def _run_and_follow(tmp: Path, model_dir: Path) -> RealRun:
    config = make_config(tmp, model_dir, max_steps=2)
    live = DashboardModel()
    async with Appliance(config) as app:
        source = HttpSource(app.proxy_url, app.admin_token)
        control_position = await ControlClient(app.proxy_url, app.admin_token).send("checkpoint")
        run = asyncio.create_task(app.run())
        try:
            while not run.done():
                live.extend(await source.poll(live.position))
                await asyncio.sleep(0.05)
            await run
            while page := await source.poll(live.position):
                live.extend(page)
        finally:
            await source.close()
    return RealRun(config.data_dir, config.db_path, live, control_position)


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> RealRun:
    """A real two-step run (about 10-20 s), shared by the session's dashboard tests."""
    tmp = tmp_path_factory.mktemp("tui-real-run")
    out: list[RealRun | BaseException] = []

    def main() -> None:
        try:
            out.append(asyncio.run(_run_and_follow(tmp, tiny_model_dir)))
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=main, name="real run")
    thread.start()
    thread.join()
    (result,) = out
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.fixture
async def fixture_db(tmp_path: Path) -> Path:
    """The hand-built run of ``run_events`` in a store file."""
    return await write_run(tmp_path / "events.sqlite")


FIXED_USAGE = [Usage("GPU 0", 12.5, 80.0, 37.0)]


def fixed_usage() -> list[Usage]:
    return FIXED_USAGE


def fixture_app(db: Path) -> DashboardApp:
    """The dashboard on the hand-built run: read-only, fixed machine usage, no tokenizer."""
    return DashboardApp(
        SqliteSource(db, label="fixture run"), usage=fixed_usage, find_tokenizer=False, usage_interval_s=0
    )


AppFactory = Callable[[Path], DashboardApp]
