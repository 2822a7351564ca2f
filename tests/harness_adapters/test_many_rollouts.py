"""200 rollouts, 32 agents at once, through the ``command`` adapter: none is lost.

Groups of 4 are admitted while fewer than 32 rollouts run (as a scheduler with
``max_inflight_rollouts = 32`` would), and the adapter's own ``max_concurrency = 32`` bounds the
agents in any case. Most agents make a model call and POST their reward; some crash, some
outlive their timeout, and some name a repository that is not there (an infrastructure
failure). Every one of the 200 must end up in the store as finished (with its reward and
call) or failed (with its reason), and no agent process may be left running.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from appliance.app import Appliance
from harness_adapters.base import ClientConfig, Task
from harness_adapters.command import CommandAdapter
from store.events import LLMCallCompleted, RewardReported, RolloutCreated, RolloutFinished
from store.eventstore import EventStore
from tests.harness_adapters.agents.chat_agent import CRASH_MARKER
from tests.harness_adapters.support import agent_cmd, alive, wait_ended
from tests.support import make_config

ROLLOUTS, GROUP, CONCURRENT = 200, 4, 32
TIMEOUT_S = 30.0


class Counting(CommandAdapter):
    """The command adapter, counting the agents inside it."""

    running = 0
    peak = 0

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        type(self).running += 1
        type(self).peak = max(type(self).peak, type(self).running)
        try:
            return await super().run(task, client)
        finally:
            type(self).running -= 1


def tasks(pid_dir: Path, missing: Path) -> Iterator[Task]:
    """Group i: a hanging agent for i in (7, 31), a crash every 10th, a missing repo every 25th."""
    for i in range(ROLLOUTS // GROUP):
        data: dict[str, object] = {"behavior": "ok", "reward": 0.5, "pid_dir": str(pid_dir)}
        if i in (7, 31):
            data["behavior"] = "hang"
        elif i % 10 == 3:
            data["behavior"] = "crash"
        elif i % 25 == 11:
            data["repo"] = str(missing)
        yield Task(f"many-{i}", data)


async def test_200_rollouts_32_at_once_all_accounted_for(tmp_path: Path, tiny_model_dir: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    adapter = Counting(
        command=agent_cmd(), workdir_root=tmp_path / "rollouts", max_concurrency=CONCURRENT, kill_grace_s=1.0
    )
    config = make_config(tmp_path, tiny_model_dir, rollout_timeout_s=TIMEOUT_S)
    started = time.perf_counter()
    async with Appliance(config, adapter=adapter) as app:
        app.controller._tasks = tasks(pid_dir, tmp_path / "no-such-repo")
        for _ in range(ROLLOUTS // GROUP):
            while app.controller.running > CONCURRENT - GROUP:
                await app.live.wait_change(app.live.position)
            await app.controller.start_group(GROUP)
        await wait_ended(app, ROLLOUTS, timeout_s=600)
        elapsed = time.perf_counter() - started
    print(f"\n{ROLLOUTS} rollouts, at most {Counting.peak} agents at once: {elapsed:.1f} s")
    assert Counting.peak == CONCURRENT

    store = await EventStore.open(tmp_path / "run" / "events.sqlite", readonly=True)
    try:
        events = [s.event for s in await store.read()]
    finally:
        await store.close()
    created = {e.rollout: e for e in events if isinstance(e, RolloutCreated)}
    ended = [e for e in events if isinstance(e, RolloutFinished)]
    assert len(created) == ROLLOUTS
    assert sorted(e.rollout for e in ended) == sorted(created), "each rollout ends exactly once"
    rewards = {e.rollout: e.reward for e in events if isinstance(e, RewardReported)}
    calls = Counter(e.rollout for e in events if isinstance(e, LLMCallCompleted))

    outcomes: Counter[str] = Counter()
    for end in ended:
        behavior = created[end.rollout].task["behavior"]
        if end.status == "finished":
            assert behavior == "ok" and "repo" not in created[end.rollout].task
            assert rewards[end.rollout] == 0.5 and calls[end.rollout] == 1
            outcomes["finished"] += 1
        else:
            assert end.status == "failed" and end.error, end
            kind = end.error.split(":")[0] if behavior == "ok" else behavior
            outcomes[kind] += 1
            if behavior == "crash":
                assert end.error.endswith(CRASH_MARKER)
            elif behavior == "hang":
                assert end.error == f"timed out after {TIMEOUT_S:g} s (rollout_timeout_s)"
            else:
                assert end.error.startswith("InfraError: task ") and "does not exist" in end.error
    assert outcomes == {"finished": 164, "crash": 20, "hang": 8, "InfraError": 8}, outcomes
    hung = [int(pid) for path in pid_dir.glob("*.pids") for pid in path.read_text().split()]
    assert len(hung) == 8 * 3
    await asyncio.sleep(0)
    assert [pid for pid in hung if alive(pid)] == []
