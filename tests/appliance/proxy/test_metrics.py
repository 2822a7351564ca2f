"""``GET /metrics``: Prometheus' text format read back with prometheus_client's own parser, from
a real appliance on the tiny model, and who may read it."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from unittest import mock

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from appliance.app import Appliance
from appliance.proxy.metrics import loopback
from tests.support import make_config, openai_client, recorded_calls
from tests.support import register_rollout as rollout

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(app: Appliance, token: str | None = None, *, url: str = "") -> tuple[int, str, str]:
    """GET /metrics of ``app`` (at ``url`` if given) with ``token``: status, type and body."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as http,
        http.get((url or app.proxy_url) + "/metrics", headers=headers) as answer,
    ):
        return answer.status, answer.headers["Content-Type"], await answer.text()


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir, max_steps=1)) as appliance:
        yield appliance


async def test_a_run_is_counted_as_it_goes(app: Appliance) -> None:
    status, content_type, text = await scrape(app, app.admin_token)
    assert status == 200 and content_type.startswith("text/plain")
    before = parse(text)
    active = rollout(app)
    async with openai_client(app, active) as client:
        await client.chat.completions.create(
            model=app.model_name, messages=[{"role": "user", "content": "1 + 2?"}], max_tokens=4
        )
        stream = await client.completions.create(
            model=app.model_name, prompt="1 + 2 =", max_tokens=3, stream=True
        )
        async for _ in stream:
            pass
    async with aiohttp.ClientSession() as http:
        url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {active.token}"}
        async with http.post(url, data=b"{not json", headers=headers) as bad:
            assert bad.status == 400
        async with AsyncOpenAI(
            base_url=url.rsplit("/chat", 1)[0], api_key="wrong", max_retries=0
        ) as stranger:
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
    run = asyncio.create_task(app.run())
    during = parse((await scrape(app, app.admin_token))[2])
    assert await run == "reached step 1"
    after = parse((await scrape(app, app.admin_token))[2])
    # Counters only grow, scrape after scrape.
    for (name, labels), figure in during.items():
        if name.endswith(("_total", "_count", "_bucket")):
            assert value(before, name, **dict(labels)) <= figure <= value(after, name, **dict(labels)), name

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    chat, completions = "openai.chat", "openai.completions"
    assert grew("appliance_calls_total", surface=chat, status="200") >= 1
    assert grew("appliance_calls_total", surface=completions, status="200") >= 1
    assert grew("appliance_calls_total", surface=chat, status="400") == 1
    assert grew("appliance_calls_total", surface=chat, status="401") == 1
    calls = await recorded_calls(app)
    assert grew("appliance_prompt_tokens_total", surface=chat) + grew(
        "appliance_prompt_tokens_total", surface=completions
    ) == sum(len(c.prompt_ids) for c in calls)
    sampled = sum(len(c.response_ids) for c in calls)
    assert sampled > 0
    assert sum(grew("appliance_sampled_tokens_total", surface=s) for s in (chat, completions)) == sampled
    assert grew("appliance_call_seconds_count", surface=chat) == len([c for c in calls if c.surface == chat])
    assert grew("appliance_call_seconds_bucket", surface=chat, le="+Inf") >= 1
    assert grew("appliance_time_to_first_token_seconds_count", surface=completions) == 1
    assert grew("appliance_store_events_total") == app.store.last_position - value(
        before, "appliance_store_events_total"
    )
    assert grew("appliance_store_commit_seconds_count") >= 1
    assert value(after, "appliance_store_commits_total") >= value(
        after, "appliance_store_commit_seconds_count"
    )
    # The run: a step trained on finished rollouts, the version it published served.
    assert value(after, "appliance_rollouts", state="finished") >= 4
    assert {labels for name, labels in after if name == "appliance_rollouts"} == {
        frozenset({("state", s)}) for s in ("offered", "running", "finished", "failed")
    }
    assert value(before, "appliance_policy_version") == 0
    assert value(after, "appliance_policy_version") == 1
    assert value(after, "appliance_training_step") == 1
    assert sum(value(after, "appliance_scheduler_phase", phase=p) for p in ("idle", "generate", "train")) == 1
    assert value(after, "appliance_breaker_paused") == 0
    assert ("appliance_engine_requests", frozenset({("state", "waiting")})) in after


async def test_only_the_admin_token_reads_it(app: Appliance) -> None:
    active = rollout(app)
    for token in (None, active.token):
        status, content_type, text = await scrape(app, token)
        assert status == 401 and content_type.startswith("application/json")
        assert "admin token" in json.loads(text)["error"]["message"]
    assert (await scrape(app, app.admin_token))[0] == 200


async def test_metrics_public_opens_it_to_this_host_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    outward = _outward_address()
    config = make_config(tmp_path, tiny_model_dir, metrics_public=True, host="0.0.0.0")
    async with Appliance(config) as app:
        port = app.proxy_url.rsplit(":", 1)[1]
        status, _, text = await scrape(app, url=f"http://127.0.0.1:{port}")
        assert status == 200 and "appliance_calls" in text
        # From another address of this machine the peer is not loopback: the token is still due.
        status, _, text = await scrape(app, url=f"http://{outward}:{port}")
        assert status == 401 and "admin token" in json.loads(text)["error"]["message"]
        assert (await scrape(app, app.admin_token, url=f"http://{outward}:{port}"))[0] == 200


def _outward_address() -> str:
    """An address of this machine that is not loopback (the route a datagram would leave by)."""
    for destination in ("10.255.255.255", "192.168.255.255", "8.8.8.8"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((destination, 9))  # a datagram socket sends nothing to connect
            except OSError:
                continue
            address = str(probe.getsockname()[0])
        if not ipaddress.ip_address(address).is_loopback:
            return address
    pytest.skip("this machine has no address but loopback")


def _request(app: web.Application, peer: str, token: str | None = None) -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 4242) if name == "peername" else default
    )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request("GET", "/metrics", headers=headers, app=app, transport=transport)


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("2001:db8::1", False),
        ("", False),
    ],
)
def test_loopback_is_the_socket_peer(peer: str, local: bool) -> None:
    assert loopback(_request(web.Application(), peer)) is local
