"""Intermediate rewards on single calls: ``POST /rollouts/<id>/reward`` with a ``call_id``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from appliance.app import Appliance
from appliance.rollouts.registry import ActiveRollout
from store.events import CallRewardReported, RewardReported
from tests.support import make_config, openai_client, register_rollout, rollout_base


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


async def reward(app: Appliance, active: ActiveRollout, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {active.token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(rollout_base(app, active) + "/reward", json=body, headers=headers) as response,
    ):
        return response.status, await response.json()


async def test_a_call_reward_is_recorded_against_that_call(app: Appliance) -> None:
    mine, other = register_rollout(app, "mine"), register_rollout(app, "other")
    async with openai_client(app, mine) as client:
        first = await client.chat.completions.create(
            model=app.model_name, messages=[{"role": "user", "content": "1 + 1?"}], max_tokens=3
        )
    async with openai_client(app, other) as client:
        theirs = await client.chat.completions.create(
            model=app.model_name, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=3
        )

    # The id as the client saw it, or bare.
    status, body = await reward(app, mine, {"reward": 0.5, "call_id": first.id, "name": "format"})
    assert status == 200, body
    bare = first.id.removeprefix("chatcmpl-")
    assert body == {"rollout": "mine", "call_id": bare, "reward": 0.5, "name": "format"}
    status, _ = await reward(app, mine, {"reward": -1, "call_id": bare})
    assert status == 200

    # Another rollout's call, an unknown call, a bad id, a bad name: refused, nothing recorded.
    for request, expected in (
        ({"reward": 1.0, "call_id": theirs.id}, 404),
        ({"reward": 1.0, "call_id": "chatcmpl-nope"}, 404),
        ({"reward": 1.0, "call_id": 7}, 400),
        ({"reward": 1.0, "call_id": first.id, "name": ["x"]}, 400),
        ({"reward": "high", "call_id": first.id}, 400),
    ):
        status, body = await reward(app, mine, request)
        assert status == expected, request
        assert body["error"]["param"] in ("call_id", "name", "reward")

    stored = [s.event for s in await app.store.read(types={"CallRewardReported", "RewardReported"})]
    assert stored == [
        CallRewardReported(
            ts=stored[0].ts, rollout="mine", call_id=bare, reward=0.5, source="http", name="format"
        ),
        CallRewardReported(ts=stored[1].ts, rollout="mine", call_id=bare, reward=-1.0, source="http"),
    ]
    assert mine.reward is None, "a call reward is not the rollout's reward"

    # Without a call id the rollout's reward is recorded, as before.
    status, _ = await reward(app, mine, {"reward": 1.0})
    assert status == 200
    (last,) = await app.store.read(after=app.store.last_position - 1)
    assert isinstance(last.event, RewardReported) and last.event.reward == 1.0
