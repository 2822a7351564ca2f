"""A run's log written by hand, for the dataset export's filters and its memory bound.

Each step trains two groups of two rollouts, created under the step's previous version: group 0
finishes with rewards 0.0 and 1.0; in group 1 rollout 0 finishes with 0.25 and rollout 1 fails.
Every rollout makes two chat calls through ``openai.chat`` with a tool; the second call's prompt
extends the first call's prompt and response (one sample per rollout). After the last step a
validation round plays one rollout (``val-0``, reward 0.9). ~22 events per step.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

from store.events import (
    ApplianceStarted,
    Event,
    LLMCallCompleted,
    PolicyVersionPublished,
    RewardReported,
    RolloutCreated,
    RolloutFinished,
    TrainStepCompleted,
    ValidationCompleted,
)
from store.eventstore import MAX_BATCH_EVENTS, EventStore
from store.tokens import Tokens

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
#: Events per step (see the module docstring) and outside the steps.
EVENTS_PER_STEP = 22
#: Group 0's and group 1's (rewards or None: failed) per rollout.
REWARDS = ((0.0, 1.0), (0.25, None))


def _calls(rollout: str, version: int, rng: random.Random, prompt: int, response: int) -> list[Event]:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": f"{rollout}: what is 2 + 3?"},
    ]
    prompt_ids: tuple[int, ...] = tuple(rng.randrange(1000) for _ in range(prompt))
    out: list[Event] = []
    for k in range(2):
        response_ids = tuple(rng.randrange(1000) for _ in range(response))
        text = f"answer {k} of {rollout}"
        out.append(
            LLMCallCompleted(
                ts=0.0,
                rollout=rollout,
                call_id=f"{rollout}-c{k}",
                surface="openai.chat",
                prompt_ids=Tokens(prompt_ids),
                response_ids=Tokens(response_ids),
                response_logprobs=tuple(-0.5 for _ in response_ids),
                policy_version=version,
                finish_reason="stop",
                request={"messages": list(messages), "tools": [TOOL]},
                response_text=text,
                queue_s=0.0,
                total_s=0.01,
            )
        )
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Check it."}]
        prompt_ids = (*prompt_ids, *response_ids, *(rng.randrange(1000) for _ in range(8)))
    return out


def _rollout(
    rollout: str, group: str, version: int, reward: float | None, purpose: str, **size: int
) -> list[Event]:
    rng = random.Random(rollout)
    events: list[Event] = [
        RolloutCreated(
            ts=0.0,
            rollout=rollout,
            task_id=f"task-{group}",
            group=group,
            task={"question": "2 + 3"},
            policy_version=version,
            adapter="python",
            purpose=purpose,
        ),
        *_calls(rollout, version, rng, size.get("prompt", 32), size.get("response", 8)),
    ]
    if reward is not None:
        events.append(RewardReported(ts=0.0, rollout=rollout, reward=reward, source="harness"))
    status = "finished" if reward is not None else "failed"
    events.append(
        RolloutFinished(ts=0.0, rollout=rollout, status=status, error="" if reward is not None else "boom")
    )
    return events


def log_events(steps: int, *, prompt: int = 32, response: int = 8) -> Iterator[Event]:
    """The whole log, in order (see the module docstring), made as it is consumed."""
    yield ApplianceStarted(
        ts=0.0, run_id="run", model="tiny", engine="torch", resumed_from_version=0, resumed_from_step=0
    )
    for step in range(1, steps + 1):
        rollouts: list[str] = []
        for g, rewards in enumerate(REWARDS):
            for j, reward in enumerate(rewards):
                rollout = f"s{step}-g{g}-r{j}"
                rollouts.append(rollout)
                yield from _rollout(
                    rollout, f"s{step}-g{g}", step - 1, reward, "train", prompt=prompt, response=response
                )
        yield TrainStepCompleted(
            ts=0.0, step=step, rollouts=tuple(rollouts), samples=3, tokens=0, zero_variance_groups=1
        )
        yield PolicyVersionPublished(ts=0.0, policy_version=step, step=step, checkpoint=f"v{step}")
    yield from _rollout("val-0", "val", steps, 0.9, "validation", prompt=prompt, response=response)
    yield ValidationCompleted(
        ts=0.0,
        step=steps,
        policy_version=steps,
        rollouts=("val-0",),
        reward_mean=0.9,
        reward_std=0.0,
        failed=0,
    )


def write_log(data_dir: Path, steps: int, *, prompt: int = 32, response: int = 8) -> int:
    """Write the log to ``data_dir/events.sqlite``; returns its events."""

    data_dir.mkdir(parents=True, exist_ok=True)

    async def write() -> int:
        store = await EventStore.open(data_dir / "events.sqlite")
        try:
            batch: list[Event] = []
            written = 0
            for event in log_events(steps, prompt=prompt, response=response):
                batch.append(event)
                if len(batch) == MAX_BATCH_EVENTS:
                    written += len(await store.append(batch))
                    batch = []
            if batch:
                written += len(await store.append(batch))
            return written
        finally:
            await store.close()

    return asyncio.run(write())
