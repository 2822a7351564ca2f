"""Helpers shared by tests that run a whole appliance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from appliance.app import Appliance
from appliance.config import ApplianceConfig, load_config
from appliance.rollouts.registry import ActiveRollout
from store.events import LLMCallCompleted


def make_config(tmp_path: Path, model_dir: Path, **overrides: object) -> ApplianceConfig:
    """A small, fast run: tiny model, port 0, two groups of two, short completions."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "run",
        "port": 0,
        "model": str(model_dir),
        "group_size": 2,
        "batch_groups": 2,
        "max_tokens": 8,
        # Always two calls per rollout (the default agent of `up` makes one or two).
        "agent": "harness_adapters.examples.arithmetic:agent",
        # Validation rounds are tested on their own (tests/appliance/rollouts/test_validation.py).
        "validate_every": 0,
    }
    values.update(overrides)
    return load_config(overrides=values, env={})


def local_engine(app: Appliance) -> Any:
    """The appliance's one engine that it launched (its fleet's first replica: the fleet of one
    that remote replicas may join)."""
    (engine, *remote) = app.engine.replicas  # type: ignore[attr-defined]
    assert not remote, "this appliance has more than its own engine"
    return engine


def register_rollout(app: Appliance, name: str = "r1") -> ActiveRollout:
    """A live rollout registered with the proxy directly (no harness, no RolloutCreated event)."""
    return app.registry.register(name, task_id="t", group="g", task={})


def rollout_base(app: Appliance, active: ActiveRollout) -> str:
    """The rollout's base URL without ``/v1`` (what Anthropic clients take)."""
    return f"{app.proxy_url}/rollouts/{active.rollout}"


def openai_client(app: Appliance, active: ActiveRollout) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=rollout_base(app, active) + "/v1", api_key=active.token, max_retries=0)


async def recorded_calls(app: Appliance) -> list[LLMCallCompleted]:
    """Every model call in the store, in order."""
    return [
        s.event
        for s in await app.store.read(types={"LLMCallCompleted"})
        if isinstance(s.event, LLMCallCompleted)
    ]
