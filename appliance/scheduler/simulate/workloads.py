"""The rollouts the simulator runs: how many calls, how many tokens, how long in tools.

Owns :class:`Call` (one model call of a rollout), :class:`Workload` (how a group's rollouts are
drawn from a seeded generator) and the two shipped workloads, ``SWE`` (long-tailed, SWE-agent
like) and ``UNIFORM`` (every rollout the same: :meth:`Workload.constant`), by name in
``WORKLOADS``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Call:
    """One model call of a rollout."""

    #: New prompt tokens before the call (the task for the first call, tool output after).
    prompt_tokens: int
    #: Tokens the call samples.
    gen_tokens: int
    #: Seconds the harness spends in tools after this call (0 after the last).
    tool_s: float


@dataclass(frozen=True, slots=True)
class Workload:
    """How rollouts are drawn. Counts are lognormal around a median (``sigma`` of the log; 0 makes
    them constant); tool time is log-uniform in ``[tool_min_s, tool_max_s]``."""

    name: str
    #: Model calls per rollout: median, log-spread, cap (the harness's step limit).
    calls_median: float
    calls_sigma: float
    max_calls: int
    #: Log-spread of a task's difficulty: one factor per group scales its rollouts' call counts.
    task_sigma: float
    #: Sampled tokens per call: median, log-spread, cap (max_tokens).
    gen_median: float
    gen_sigma: float
    max_gen_tokens: int
    #: Tokens of the first prompt (system prompt + task).
    first_prompt_tokens: int
    #: Tool output tokens added before each later call: median and log-spread.
    obs_median: float
    obs_sigma: float
    tool_min_s: float
    tool_max_s: float
    #: A rollout ends once its context would exceed this (the last call is cut to fit).
    max_context_tokens: int

    @classmethod
    def constant(
        cls,
        name: str,
        *,
        calls: int,
        gen_tokens: int,
        first_prompt_tokens: int,
        obs_tokens: int,
        tool_s: float,
        max_context_tokens: int,
    ) -> Workload:
        """Every rollout the same: ``calls`` calls of ``gen_tokens`` each, ``obs_tokens`` of tool
        output and ``tool_s`` seconds in tools between them (no spread, no task difficulty)."""
        return cls(
            name,
            calls_median=calls,
            calls_sigma=0.0,
            max_calls=calls,
            task_sigma=0.0,
            gen_median=gen_tokens,
            gen_sigma=0.0,
            max_gen_tokens=gen_tokens,
            first_prompt_tokens=first_prompt_tokens,
            obs_median=obs_tokens,
            obs_sigma=0.0,
            tool_min_s=tool_s,
            tool_max_s=tool_s,
            max_context_tokens=max_context_tokens,
        )

    def draw_group(self, rng: random.Random, size: int) -> list[tuple[Call, ...]]:
        """The calls of each rollout of one group (one task)."""
        task = rng.lognormvariate(0.0, self.task_sigma)
        return [self._draw_rollout(rng, task) for _ in range(size)]

    def _draw_rollout(self, rng: random.Random, task: float) -> tuple[Call, ...]:
        def lognormal(median: float, sigma: float, cap: int) -> int:
            return max(1, min(cap, round(median * rng.lognormvariate(0.0, sigma))))

        n_calls = lognormal(self.calls_median * task, self.calls_sigma, self.max_calls)
        calls: list[Call] = []
        context = 0
        for i in range(n_calls):
            prompt = self.first_prompt_tokens if i == 0 else lognormal(self.obs_median, self.obs_sigma, 10**9)
            gen = lognormal(self.gen_median, self.gen_sigma, self.max_gen_tokens)
            tool_s = math.exp(rng.uniform(math.log(self.tool_min_s), math.log(self.tool_max_s)))
            room = self.max_context_tokens - context - prompt
            if room < 1 and calls:
                break
            gen = max(1, min(gen, room))
            context += prompt + gen
            calls.append(Call(prompt, gen, tool_s))
            if gen >= room:
                break
        calls[-1] = replace(calls[-1], tool_s=0.0)
        return tuple(calls)


#: SWE-agent-like: many short rollouts, a few very long ones (hard tasks, long calls, long tool
#: output), 1-20 s of tool time between calls, a 64k context. Per rollout (seed 0): calls p50 18,
#: p90 53, max ~100; context p50 17k, p90 47k tokens; tool time p50 ~110 s, max ~620 s.
SWE = Workload(
    name="swe",
    calls_median=18,
    calls_sigma=0.7,
    max_calls=100,
    task_sigma=0.5,
    gen_median=150,
    gen_sigma=1.0,
    max_gen_tokens=4096,
    first_prompt_tokens=3000,
    obs_median=350,
    obs_sigma=1.0,
    tool_min_s=1.0,
    tool_max_s=20.0,
    max_context_tokens=65536,
)

#: Every rollout the same: 12 calls of 200 tokens, 500 tokens of tool output, 5 s of tool time.
UNIFORM = Workload.constant(
    "uniform",
    calls=12,
    gen_tokens=200,
    first_prompt_tokens=3000,
    obs_tokens=500,
    tool_s=5.0,
    max_context_tokens=32768,
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (SWE, UNIFORM)}
