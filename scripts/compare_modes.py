"""Sync against async (collocated) training on this machine, side by side in one run.

Runs the real appliance twice on the same model, agent and seeds, for the same number of
steps: once in ``sync`` mode and once in ``async`` mode, with an agent whose rollouts have
SWE-agent-like timing (a long-tailed number of calls, tool latency between them:
``harness_adapters/examples/long_tail.py``). Prints wall time per step of both, their ratio,
the mean reward of the last steps, and how much the async run preempted and dropped.

    .venv/bin/python scripts/compare_modes.py [--steps 6] [--model tiny] [--eta 1]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from appliance.app import Appliance
from appliance.config import load_config
from store.events import LLMCallCompleted, TrainStepCompleted


async def run(mode: str, steps: int, model: str, eta: int, root: Path) -> dict[str, float]:
    config = load_config(
        overrides={
            "data_dir": root / mode,
            "port": 0,
            "model": model,
            "agent": "harness_adapters.examples.long_tail:agent",
            "mode": mode,
            "eta": eta,
            "max_steps": steps,
            "group_size": 4,
            "batch_groups": 2,
            "max_tokens": 12,
        },
        env={},
    )
    async with Appliance(config) as app:
        started = time.perf_counter()
        await app.run()
        wall = time.perf_counter() - started
        events = [s.event for s in await app.store.read()]
    trained = [e for e in events if isinstance(e, TrainStepCompleted)]
    calls = [e for e in events if isinstance(e, LLMCallCompleted)]
    last = trained[-max(1, len(trained) // 2) :]
    return {
        "wall_s": wall,
        "per_step_s": wall / max(1, len(trained)),
        "reward_last_half": sum(s.metrics.get("reward_mean", 0.0) for s in last) / len(last),
        "preempted_calls": float(sum(1 for c in calls if c.preemptions)),
        "stale_dropped": sum(s.metrics.get("stale_tokens_dropped", 0.0) for s in trained),
        "staleness_mean": sum(s.metrics.get("staleness_mean", 0.0) for s in trained) / max(1, len(trained)),
    }


async def main(steps: int, model: str, eta: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: await run(mode, steps, model, eta, Path(tmp)) for mode in ("sync", "async")}
    sync, asyn = results["sync"], results["async"]
    print(f"{steps} steps, model {model}, 2 groups x 4 rollouts per step, long-tailed agent, eta={eta}")
    print(f"{'':>24} {'sync':>10} {'async':>10}")
    for key in (
        "wall_s",
        "per_step_s",
        "reward_last_half",
        "preempted_calls",
        "stale_dropped",
        "staleness_mean",
    ):
        print(f"{key:>24} {sync[key]:>10.3f} {asyn[key]:>10.3f}")
    print(f"async speedup (sync wall / async wall): {sync['wall_s'] / asyn['wall_s']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--eta", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.model, args.eta))
