"""The external runners test's agent: one chat call with the official openai client, a reward.

Run by ``python -m harness_adapters.runner --agent tests.appliance.external_agent:agent`` in
processes of their own (``tests/appliance/rollouts/test_external.py``). A plain function, so the
runner calls it in a thread and heartbeats go on meanwhile. The reward varies with the sampled
text (1 for the right sum, else a little for brevity), so a group of the tiny model's answers is
rarely all alike.
"""

from __future__ import annotations

from typing import Any

from openai import OpenAI

from harness_adapters.runner import Claim


def agent(task: dict[str, Any], claim: Claim) -> float:
    client = OpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=2)
    answer = client.chat.completions.create(
        model=claim.model,
        messages=[{"role": "user", "content": str(task.get("question", "Say hello."))}],
        max_tokens=8,
    )
    text = answer.choices[0].message.content or ""
    if str(task.get("answer", "")) in text.split():
        return 1.0
    return 1.0 / (1 + len(text))
