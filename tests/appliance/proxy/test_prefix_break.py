"""A harness that rewrites history: the break is recorded, and only sampled tokens are trained."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from appliance.app import Appliance
from store.events import LLMCallCompleted
from tests.support import make_config
from trainer.samples import build_samples


@pytest.fixture
async def app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Appliance]:
    async with Appliance(make_config(tmp_path, tiny_model_dir)) as appliance:
        yield appliance


async def test_rewritten_history_breaks_the_prefix_and_is_never_trained(app: Appliance) -> None:
    active = app.registry.register("r1", task_id="t", group="g", task={})
    history = [{"role": "user", "content": "What is 1 + 1?"}]
    async with AsyncOpenAI(
        base_url=f"{app.proxy_url}/rollouts/r1/v1", api_key=active.token, max_retries=0
    ) as oai:
        first = await oai.chat.completions.create(model="m", messages=history, max_tokens=6)  # type: ignore[arg-type]
        sampled_text = first.choices[0].message.content or ""
        rewritten = "I think the answer is two."  # what the harness claims the model said
        assert rewritten != sampled_text
        follow_up = [
            *history,
            {"role": "assistant", "content": rewritten},
            {"role": "user", "content": "Are you sure?"},
        ]
        await oai.chat.completions.create(model="m", messages=follow_up, max_tokens=6)  # type: ignore[arg-type]

    events = [s.event for s in await app.store.read(types={"LLMCallCompleted"})]
    one, two = (e for e in events if isinstance(e, LLMCallCompleted))
    assert one.unmatched_assistant_turns == 0
    assert two.unmatched_assistant_turns == 1
    assert two.spliced_tokens == 0

    samples = build_samples([one, two])
    assert len(samples) == 2, "the rewritten turn must start a new segment"
    tokenizer = app.registry._tokenizer
    for sample, call in zip(samples, (one, two), strict=True):
        trained = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
        assert trained == list(call.response_ids)
    # The rewritten text is in the second segment's prompt only, never under the loss mask.
    second = samples[1]
    prompt_text = tokenizer.decode([t for t, m in zip(second.tokens, second.loss_mask, strict=True) if not m])
    assert rewritten in prompt_text
