"""A multi-turn example agent: answer ``a + b``, and after "wrong" try once more.

The agent talks to the model through the official ``openai`` client. Each attempt is one call;
a right answer ends the episode, a wrong one gets the feedback "Your answer was wrong. Answer
again with only the number." So rollouts make 1 to ``ATTEMPTS`` (2) calls: fewer as the policy
gets better. The reward halves with each attempt used (1, then 0.5; 0 when every attempt is
wrong), so the policy is paid most for getting it right the first time and still learns from the
retry. (Two attempts, not more: on this shared 2-core CPU each round of calls costs a minute.)

Two ways to carry the history, two agents:

* ``agent`` keeps the conversation: every call re-sends the earlier turns, so the proxy splices
  the sampled tokens back in and the trainer merges the rollout's calls into ONE sample.
* ``agent_fresh`` starts each attempt from a fresh prompt that lists the earlier wrong answers
  (a harness that summarises its history), so each call is a sample of its own: rollouts have
  1 to ``ATTEMPTS`` samples, which is what makes rollout- and sample-level loss normalization
  differ (``scripts/normalization_study.py``).

``play`` is the episode itself, for any client and sampling temperature: the demo scripts call it
with the admin token on the proxy's plain ``/v1`` at temperature 0 to score held-out tasks.
Also owns the task split used by those scripts: the 100 single-digit sums, 64 held out for
evaluation and never trained on (``addition_split``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from harness_adapters.base import ClientConfig, Task

#: Appended to the question: the format SmolLM2-135M answers best without training (FINDINGS.md).
INSTRUCTION = "Reply with only the number."
RETRY = "Your answer was wrong. Answer again with only the number."
#: Calls an episode may make.
ATTEMPTS = 2
#: Sampling temperature the agent asks for (the appliance may force its own for training calls).
TEMPERATURE = 1.0
#: Completion length per call: a number needs a few tokens; rambling gets cut (and scores 0).
MAX_TOKENS = 8
#: Seconds a call may take, connecting included (the client's 5 s connect timeout is too short
#: for a busy CPU; the appliance's rollout timeout bounds the whole episode anyway).
CALL_TIMEOUT_S = 3600.0
#: Single-digit sums held out of training (of the 100).
HELD_OUT = 64
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class Episode:
    """What one episode did: its reward, the calls it made, and at which attempt it was right."""

    reward: float
    calls: int
    solved_at: int | None
    replies: tuple[str, ...]


def first_int(reply: str) -> int | None:
    match = _INT.search(reply)
    return None if match is None else int(match.group())


def attempt_reward(solved_at: int | None) -> float:
    """1 for a right first answer, halved for each retry, 0 when never right."""
    return 0.0 if solved_at is None else 0.5 ** (solved_at - 1)


def call_seed(seed: str, attempt: int) -> int:
    """A 31-bit sampling seed for one call of an episode."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{attempt}".encode()).digest()[:4], "big") >> 1


def fresh_prompt(question: str, wrong: list[str]) -> str:
    """The user turn of an attempt: the question, in a fresh context also the rejected answers."""
    if not wrong:
        return f"{question} {INSTRUCTION}"
    return f"{question} These answers were wrong: {', '.join(wrong)}. {INSTRUCTION}"


async def play(
    task: Task,
    oai: AsyncOpenAI,
    model: str,
    *,
    keep_history: bool = True,
    attempts: int = ATTEMPTS,
    temperature: float = TEMPERATURE,
    max_tokens: int = MAX_TOKENS,
    seed: str | None = None,
) -> Episode:
    """One episode of ``task``: up to ``attempts`` calls, stopping at the first right answer.

    With ``seed``, call ``k`` asks for the sampling seed derived from ``seed`` and ``k``: two
    runs with the same weights then sample the same tokens (the agents seed by rollout id).
    """
    question, answer = str(task.data["question"]), int(task.data["answer"])
    messages: list[Any] = [{"role": "user", "content": fresh_prompt(question, [])}]
    replies: list[str] = []
    wrong: list[str] = []
    for attempt in range(1, attempts + 1):
        if not keep_history:
            messages = [{"role": "user", "content": fresh_prompt(question, wrong)}]
        response = await oai.chat.completions.create(
            model=model,
            messages=messages,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=None if seed is None else call_seed(seed, attempt),
        )
        reply = response.choices[0].message.content or ""
        replies.append(reply)
        if first_int(reply) == answer:
            return Episode(attempt_reward(attempt), attempt, attempt, tuple(replies))
        guess = first_int(reply)
        wrong.append("no number" if guess is None else str(guess))
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": RETRY})
    return Episode(0.0, attempts, None, tuple(replies))


async def _run(task: Task, client: ClientConfig, *, keep_history: bool) -> float:
    async with AsyncOpenAI(
        base_url=client.base_url, api_key=client.api_key, max_retries=0, timeout=CALL_TIMEOUT_S
    ) as oai:
        episode = await play(task, oai, client.model, keep_history=keep_history, seed=client.rollout_id)
    return episode.reward


async def agent(task: Task, client: ClientConfig) -> float:
    """The conversation variant: one growing chat, merged into one training sample."""
    return await _run(task, client, keep_history=True)


async def agent_fresh(task: Task, client: ClientConfig) -> float:
    """The fresh-context variant: each attempt a new prompt, so one training sample per call."""
    return await _run(task, client, keep_history=False)


def addition_task(a: int, b: int) -> Task:
    return Task(id=f"sum-{a}-{b}", data={"a": a, "b": b, "answer": a + b, "question": f"What is {a} + {b}?"})


def addition_split(*, held_out: int = HELD_OUT, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """(train, held-out): the 100 single-digit sums split by a seeded hash, disjoint."""
    tasks = [addition_task(a, b) for a in range(10) for b in range(10)]
    tasks.sort(key=lambda t: hashlib.sha256(f"{seed}:{t.id}".encode()).digest())
    return sorted(tasks[held_out:], key=lambda t: t.id), sorted(tasks[:held_out], key=lambda t: t.id)


def write_taskset(path: Path, *, held_out: int = HELD_OUT, seed: int = 0) -> Path:
    """The split as a JSONL task set (``split`` field: train / validation) the appliance can load."""
    train, validation = addition_split(held_out=held_out, seed=seed)
    rows = [{"id": t.id, **t.data, "split": "train"} for t in train]
    rows += [{"id": t.id, **t.data, "split": "validation"} for t in validation]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
