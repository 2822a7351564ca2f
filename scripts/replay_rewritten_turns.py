"""Replay recorded harness requests through the proxy and count the assistant turns it could not
splice from sampled ids, per harness.

Each fixture in tests/appliance/proxy/fixtures/rewritten_turns/ is one rollout: per call, what
the model samples (a text, encoded with the tiny model's tokenizer, then ``<|im_end|>`` unless
``"length"``; the request's token limit may cut it) and the request the harness sent (recorded
from the harness run against the proxy with that sampling, or built from its source: each
fixture's ``how``). The real proxy serves them on the tiny model with
that scripted sampling, so the counts depend on the proxy's matching alone.

"before": assistant turns not spliced exactly as returned (what a proxy that only splices turns
sent back unchanged renders from text); "after": those still unmatched. Also printed: the
trainer's samples for the rollout (one per prefix break) and each non-exact turn's match.

    .venv/bin/python scripts/replay_rewritten_turns.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.app import Appliance
from appliance.config import load_config
from appliance.engines.base import GenerateRequest, GenerateResult
from appliance.engines.tiny_model import TINY_MODEL_NAME, build_tiny_model
from store.events import LLMCallCompleted
from trainer.samples import build_samples

FIXTURES = Path(__file__).resolve().parents[1] / "tests/appliance/proxy/fixtures/rewritten_turns"


async def replay(fixture: dict[str, Any], model_dir: Path, data_dir: Path) -> list[LLMCallCompleted]:
    config = load_config(
        overrides={"data_dir": data_dir, "port": 0, "model": str(model_dir), "max_tokens": 256},
        env={},
    )
    async with Appliance(config) as app:
        tokenizer = app.registry._tokenizer
        answers = [
            [*tokenizer.encode(c["sample"]), *([] if c.get("length") else [tokenizer.im_end_id])]
            for c in fixture["calls"]
        ]

        async def generate(request: GenerateRequest) -> GenerateResult:
            ids = answers.pop(0)[: request.params.max_tokens]
            for token in ids:
                if request.on_token is not None:
                    request.on_token(token, -1.0)
                await asyncio.sleep(0)
            finish = "stop" if ids and ids[-1] == tokenizer.im_end_id else "length"
            return GenerateResult(
                token_ids=tuple(ids), logprobs=(-1.0,) * len(ids), finish_reason=finish, policy_version=0
            )

        app.engine.generate = generate  # type: ignore[method-assign]
        # The scripted sampling has no context limit; smolagents' system prompt alone is longer
        # than the tiny model's 2,048 positions.
        for engine in app.engine.replicas:  # type: ignore[attr-defined]
            engine._max_context = 32_768
        active = app.registry.register("replay", task_id="t", group="g", task={})
        base = f"{app.proxy_url}/rollouts/{active.rollout}/v1"
        async with AsyncOpenAI(base_url=base, api_key=active.token, max_retries=0) as oai:
            for call in fixture["calls"]:
                await oai.chat.completions.create(model="m", **call["request"])
        return [
            s.event
            for s in await app.store.read(types={"LLMCallCompleted"})
            if isinstance(s.event, LLMCallCompleted)
        ]


def counts(calls: list[LLMCallCompleted]) -> tuple[int, int, int]:
    """Turns not spliced before matching, turns unmatched now, and the trainer's samples."""
    # A "cut" turn was sent back as returned: spliced before too (with the cut call's ids).
    before = sum(t["kind"] != "cut" for c in calls for t in c.assistant_turns)
    after = sum(c.unmatched_assistant_turns for c in calls)
    return before, after, len(build_samples(calls))


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / TINY_MODEL_NAME, seed=0)
        print(f"{'harness':<58} {'calls':>5} {'before':>6} {'after':>5} {'samples':>7}")
        for i, path in enumerate(sorted(FIXTURES.glob("*.json"))):
            fixture = json.loads(path.read_text())
            calls = await replay(fixture, model_dir, Path(tmp) / f"run{i}")
            before, after, samples = counts(calls)
            print(f"{fixture['harness']:<58} {len(calls):>5} {before:>6} {after:>5} {samples:>7}")
            for n, call in enumerate(calls):
                for turn in call.assistant_turns:
                    print(
                        f"    call {n} message {turn['message']}: {turn['kind']}, {turn['reason']} "
                        f"({turn['spliced']}/{turn['sampled']} sampled ids spliced)"
                    )


if __name__ == "__main__":
    asyncio.run(main())
