"""``served_model_names``: the policy answers to several names, as vLLM's --served-model-name, so a
harness that only works with a name it knows (AutoGen's model_info, DSPy's native tools, a
client that checks ``GET /models``) runs unchanged. Every surface answers each name, the models
routes list and retrieve them all, and the recorded call keeps the name the client asked for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.config import load_config
from contracts.errors import ConfigError
from harness_adapters import runner
from harness_adapters.base import ClientConfig, Task
from harness_adapters.python import PythonAdapter
from tests.support import make_config, recorded_calls
from tests.support import openai_client as sdk
from tests.support import register_rollout as rollout
from tests.support import rollout_base as base

NAMES = ("gpt-4o-mini", "claude-sonnet-4-5")


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    config = make_config(tmp_path, tiny_model_dir, served_model_names=NAMES)
    async with Appliance(config) as appliance:
        yield appliance


def test_names_come_from_toml_and_the_environment(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[proxy]\nserved_model_names = ["gpt-4o-mini", "claude-sonnet-4-5"]\n')
    assert load_config(toml, env={}).proxy.served_model_names == NAMES
    env = {"APPLIANCE_SERVED_MODEL_NAMES": "gpt-4o-mini, claude-sonnet-4-5"}
    assert load_config(env=env).proxy.served_model_names == NAMES
    assert load_config(env={}).proxy.served_names("smollm2-135m") == ("smollm2-135m",)
    with pytest.raises(ConfigError, match="names a model twice"):
        load_config(env={"APPLIANCE_SERVED_MODEL_NAMES": "a,a"})
    toml.write_text("[proxy]\nserved_model_names = [1]\n")
    with pytest.raises(ConfigError, match="served_model_names"):
        load_config(toml, env={})


async def test_the_models_routes_list_and_retrieve_every_name(app: Appliance) -> None:
    assert app.served_names == NAMES
    active = rollout(app)
    async with sdk(app, active) as client:
        assert [m.id for m in (await client.models.list()).data] == list(NAMES)
        for name in NAMES:
            assert (await client.models.retrieve(name)).id == name
        # The model's own name is not served once names are configured; unknown names stay a 404.
        for other in (app.model_name, "gpt-4o"):
            with pytest.raises(openai.NotFoundError) as caught:
                await client.models.retrieve(other)
            assert caught.value.code == "model_not_found"
            assert "'gpt-4o-mini', 'claude-sonnet-4-5'" in caught.value.message
    async with AsyncAnthropic(base_url=base(app, active), api_key=active.token, max_retries=0) as claude:
        page = await claude.models.list()
        assert [m.id for m in page.data] == list(NAMES)
        assert (page.first_id, page.last_id) == NAMES
        assert (await claude.models.retrieve("claude-sonnet-4-5")).display_name == "claude-sonnet-4-5"
    # The rollout-less prefix, with the admin token, lists them too.
    headers = {"Authorization": f"Bearer {app.admin_token}"}
    async with aiohttp.ClientSession() as http, http.get(f"{app.proxy_url}/v1/models", headers=headers) as r:
        assert [m["id"] for m in (await r.json())["data"]] == list(NAMES)


async def test_every_surface_answers_each_name_and_records_the_name_asked(app: Appliance) -> None:
    active = rollout(app)
    async with sdk(app, active) as client:
        for name in NAMES:
            chat = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            assert chat.model == name
            legacy = await client.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert legacy.model == name
            response = await client.responses.create(model=name, input="Hi", max_output_tokens=16)
            assert response.model == name
    async with AsyncAnthropic(base_url=base(app, active), api_key=active.token, max_retries=0) as claude:
        message = await claude.messages.create(
            model="claude-sonnet-4-5", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.model == "claude-sonnet-4-5"
    calls = await recorded_calls(app)
    asked = [(call.surface, call.request["model"]) for call in calls]
    assert asked == [
        (surface, name)
        for name in NAMES
        for surface in ("openai.chat", "openai.completions", "openai.responses")
    ] + [("anthropic.messages", "claude-sonnet-4-5")]


async def test_harnesses_and_runners_are_given_the_first_name(tmp_path: Path, tiny_model_dir: Path) -> None:
    given: list[str] = []

    async def agent(task: Task, client: ClientConfig) -> float:
        given.append(client.model)
        oai = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        await oai.chat.completions.create(
            model=client.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        return 1.0

    config = make_config(tmp_path / "own", tiny_model_dir, served_model_names=NAMES)
    async with Appliance(config, adapter=PythonAdapter(agent)) as app:
        group = await app.controller.start_group(1)
        async with asyncio.timeout(30):
            while (view := app.live.state.rollouts.get(f"{group}-r0")) is None or view.status == "running":
                await app.live.wait_change(app.live.position)
        assert app.live.state.rollouts[f"{group}-r0"].status == "finished"
    assert given == ["gpt-4o-mini"]

    config = make_config(tmp_path / "ext", tiny_model_dir, served_model_names=NAMES, adapter="external")
    async with Appliance(config) as app:
        await app.controller.start_group(1)
        claim = await runner.claim(app.proxy_url, app.admin_token)
        assert claim.model == "gpt-4o-mini"
        await runner.finish(claim)


def test_ups_banner_says_the_names_served() -> None:
    from appliance.cli.up import _served_as

    assert _served_as(SimpleNamespace(model_name="m", served_names=("m",))) == ""
    named = SimpleNamespace(model_name="m", served_names=NAMES)
    assert _served_as(named) == " served as gpt-4o-mini, claude-sonnet-4-5"
