"""A whole appliance running hostile agents in bubblewrap: the rollouts reach their own routes
only, and the run goes on (it serves, trains, and its log verifies).

The agents (``tests/harness_adapters/agents/hostile.py probe``) run under the ``command``
adapter with the default ``sandbox = "auto"``; each reaches the proxy through its own Unix
socket (``appliance.proxy.endpoints``), which answers nothing but its rollout's routes, not
even to the admin token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from appliance.app import Appliance
from harness_adapters.sandbox import bwrap_problem
from store.events import RolloutFinished
from store.eventstore import EventStore
from tests.harness_adapters.support import AGENTS
from tests.support import make_config, openai_client, register_rollout

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")

ADMIN_TOKEN = "la-admin-test-token"


async def test_sandboxed_rollouts_reach_only_their_own_routes(tmp_path: Path, tiny_model_dir: Path) -> None:
    data_dir = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    secrets = [str(data_dir / "admin_token"), str(data_dir / "events.sqlite")]
    rows = [
        {"id": f"t{i}", "chat": True, "try_admin": True, "admin_token": ADMIN_TOKEN, "secrets": secrets}
        for i in range(2)
    ]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    adapter = {
        "adapter": "command",
        "command": [sys.executable, str(AGENTS / "hostile.py"), "probe"],
        "read_only_paths": [str(AGENTS)],
        "keep_workdirs": "always",
    }
    config = make_config(
        tmp_path,
        tiny_model_dir,
        adapter=adapter,
        tasks=tasks,
        max_steps=1,
        batch_groups=1,
        admin_token=ADMIN_TOKEN,
    )
    assert config.harness.sandbox == "auto"
    async with Appliance(config) as app:
        assert app.isolation.kind == "bwrap" and app.isolation.endpoint_sockets
        assert await app.run() == "reached step 1"
        assert len(app.proxy.sockets) == 0, "each rollout's socket is closed when it ends"
        recorded = app.config.harness.sandbox
    assert recorded == "bwrap"

    store = await EventStore.open(data_dir / "events.sqlite")
    try:
        report = await store.verify()
        ended = [s.event for s in await store.read(types={"RolloutFinished"})]
    finally:
        await store.close()
    assert report.events > 0
    # The startup, status and the dashboard say where the agents ran.
    from appliance.cli.status import status_report
    from tui.model import DashboardModel

    line = status_report(data_dir)["agents"]
    assert line == "agents run sandboxed (bwrap; no network but the rollout's endpoint)"
    model = DashboardModel()
    store = await EventStore.open(data_dir / "events.sqlite", readonly=True)
    try:
        model.extend(await store.read(types={"ApplianceStarted"}))
    finally:
        await store.close()
    assert model.agents == line
    assert ended and all(isinstance(e, RolloutFinished) and e.status == "finished" for e in ended), ended
    reports = [json.loads(p.read_text()) for p in (data_dir / "rollouts").glob("*/agent.stdout")]
    assert len(reports) == 2
    for probe in reports:
        assert all(v.startswith("denied") for v in probe["secrets"].values()), probe["secrets"]
        assert probe["endpoint"] == "200" and probe["chat"] == 200
        # The admin API, /metrics, the rollout-less /v1 and another rollout's routes: 403, even
        # with the admin token.
        assert probe["admin_with_token"] == "403"
        assert probe["metrics"] == "403"
        assert probe["plain_v1"] == "403"
        assert probe["other_rollout"] == "403"
        assert probe["interfaces"] == ["lo"]


def _alive_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                stat = (entry / "stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_each_escape_ends_its_rollout_and_the_run_goes_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    marker = f"la-escape-{tmp_path.name}"
    modes = ["probe", "forkbomb", "memory", "bigfile", "daemon", "sleep"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": mode, "mode": mode, "chat": True}) + "\n" for mode in modes))
    adapter = {
        "adapter": "command",
        "command": [sys.executable, str(AGENTS / "hostile.py"), "{mode}", marker],
        "read_only_paths": [str(AGENTS)],
        "kill_grace_s": 1.0,
        "keep_workdirs": "never",
    }
    config = make_config(
        tmp_path,
        tiny_model_dir,
        adapter=adapter,
        tasks=tasks,
        max_steps=1,
        group_size=1,
        batch_groups=len(modes),
        rollout_timeout_s=8.0,
        sandbox_memory_mb=512,
        sandbox_processes=64,
        sandbox_disk_mb=64,
        breaker_failures=0,
    )
    async with Appliance(config) as app:
        assert await app.run() == "reached step 1"
        # It still serves: a model call on a fresh rollout.
        active = register_rollout(app, "after")
        answer = await openai_client(app, active).chat.completions.create(
            model=app.served_names[0], messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.choices[0].message is not None
    store = await EventStore.open(tmp_path / "run" / "events.sqlite")
    try:
        await store.verify()
        created = {s.event.rollout: s.event.task_id for s in await store.read(types={"RolloutCreated"})}  # type: ignore[attr-defined]
        ended = {s.event.rollout: s.event for s in await store.read(types={"RolloutFinished"})}  # type: ignore[attr-defined]
        steps = await store.read(types={"TrainStepCompleted"})
    finally:
        await store.close()
    assert len(steps) == 1
    by_task = {created[r]: e for r, e in ended.items() if isinstance(e, RolloutFinished)}
    assert by_task["probe"].status == "finished"
    expected = {
        "forkbomb": "process limit reached (64 processes)",
        "memory": "memory limit reached (512 MiB)",
        "bigfile": "disk limit reached (64 MiB",
        "sleep": "timed out after 8 s (rollout_timeout_s)",
        "daemon": "made no model call",
    }
    for mode, reason in expected.items():
        assert by_task[mode].status == "failed" and reason in by_task[mode].error, (mode, by_task[mode].error)
    assert _alive_with(marker) == [], "a process outlived its rollout"
