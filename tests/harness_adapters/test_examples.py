"""The multi-turn example agent (``retry_arithmetic``) and the held-out helpers (``heldout``).

The agent runs with the real ``openai`` client against a real aiohttp server on port 0 that
answers from a script, so every branch (right first, right on a retry, never right; history
kept or a fresh prompt per attempt) is exercised deterministically.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from openai import AsyncOpenAI

from harness_adapters.base import ClientConfig, Task
from harness_adapters.examples.heldout import HeldBackAdapter, evaluate
from harness_adapters.examples.retry_arithmetic import (
    RETRY,
    addition_split,
    addition_task,
    agent,
    agent_fresh,
    attempt_reward,
    call_seed,
    play,
    write_taskset,
)
from harness_adapters.tasks import TaskSet


class ScriptedModel:
    """A chat-completions server whose replies come from a list; it records every request body."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        content = self.replies[min(len(self.bodies) - 1, len(self.replies) - 1)]
        return web.json_response(
            {
                "id": f"c{len(self.bodies)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": content},
                    }
                ],
            }
        )


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(model: ScriptedModel) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", model.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def client_for(url: str) -> ClientConfig:
    return ClientConfig(
        rollout_id="r", base_url=url + "/v1", api_key="k", reward_url=url + "/reward", model="m"
    )


@pytest.mark.parametrize(
    ("replies", "calls", "solved_at", "reward"),
    [
        (["7"], 1, 1, 1.0),
        (["The answer is 5", "7"], 2, 2, 0.5),
        (["5", "6", "7"], 3, 3, 0.25),
        (["5", "no idea", "8"], 3, None, 0.0),
    ],
)
async def test_play_stops_at_the_first_right_answer(
    serve: Any, replies: list[str], calls: int, solved_at: int | None, reward: float
) -> None:
    model = ScriptedModel(replies)
    url = await serve(model)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as oai:
        episode = await play(addition_task(3, 4), oai, "m", attempts=3, temperature=0.0)
    assert (episode.calls, episode.solved_at, episode.reward) == (calls, solved_at, reward)
    assert len(model.bodies) == calls
    assert all(body["temperature"] == 0.0 and body["max_tokens"] == 8 for body in model.bodies)


async def test_agent_keeps_the_conversation(serve: Any) -> None:
    model = ScriptedModel(["5", "7"])
    url = await serve(model)
    assert await agent(addition_task(3, 4), client_for(url)) == 0.5
    second = model.bodies[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0]["content"] == "What is 3 + 4? Reply with only the number."
    assert second[1]["content"] == "5" and second[2]["content"] == RETRY
    assert model.bodies[0]["temperature"] == 1.0
    # Seeded by rollout id and attempt: reproducible across runs, different per call.
    seeds = [body["seed"] for body in model.bodies]
    assert seeds == [call_seed("r", 1), call_seed("r", 2)] and seeds[0] != seeds[1]


async def test_agent_fresh_starts_each_attempt_from_a_new_prompt(serve: Any) -> None:
    model = ScriptedModel(["eleven", "7"])
    url = await serve(model)
    assert await agent_fresh(addition_task(3, 4), client_for(url)) == 0.5
    first, second = (body["messages"] for body in model.bodies)
    assert [m["content"] for m in first] == ["What is 3 + 4? Reply with only the number."]
    wanted = "What is 3 + 4? These answers were wrong: no number. Reply with only the number."
    assert [m["content"] for m in second] == [wanted]


def test_attempt_reward_halves_per_retry() -> None:
    assert [attempt_reward(k) for k in (1, 2, 3, None)] == [1.0, 0.5, 0.25, 0.0]


def test_addition_split_is_disjoint_and_complete(tmp_path: Path) -> None:
    train, held = addition_split(held_out=64, seed=0)
    assert (len(train), len(held)) == (36, 64)
    assert not {t.id for t in train} & {t.id for t in held}
    assert addition_split(held_out=64, seed=0) == (train, held)
    assert {t.id for t in addition_split(held_out=64, seed=1)[1]} != {t.id for t in held}
    path = write_taskset(tmp_path / "tasks.jsonl", held_out=64, seed=0)
    for split, tasks in (("train", train), ("validation", held)):
        loaded = TaskSet.load(path, split=split)
        assert [(t.id, t.data["question"], t.data["answer"]) for t in loaded] == [
            (t.id, t.data["question"], t.data["answer"]) for t in tasks
        ]


async def test_evaluate_scores_every_task_through_the_admin_route(serve: Any) -> None:
    model = ScriptedModel(["7"])  # right for 3 + 4 only
    url = await serve(model)
    tasks = [addition_task(3, 4), addition_task(1, 1)]
    result = await evaluate(url, "admin", "m", tasks, attempts=2)
    assert (result.tasks, result.reward, result.first_try, result.solved) == (2, 0.5, 0.5, 0.5)
    assert result.calls == 1.5


async def test_held_back_adapter_waits_until_released() -> None:
    started: list[str] = []

    class Inner:
        name = "inner"

        async def run(self, task: Task, client: ClientConfig) -> float | None:
            started.append(task.id)
            return 1.0

    adapter = HeldBackAdapter(Inner())
    adapter.hold()
    running = asyncio.ensure_future(adapter.run(Task(id="t"), client_for("http://x")))
    await asyncio.sleep(0.01)
    assert started == [] and not running.done() and adapter.held
    adapter.release()
    assert await running == 1.0
    assert started == ["t"] and adapter.name == "inner"
