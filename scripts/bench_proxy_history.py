"""``scripts/bench_proxy.py --history``: the proxy's CPU per call as a conversation grows.

Owns that mode: one conversation per history length (1k to 30k prompt tokens) grown through the
appliance's proxy, then calls that each add the last answer and a short user turn; beside it the
same conversations (the same words, as many messages) through a pass-through relay
(``bench_proxy_relay.py``, its own process: the bytes in and out once, nothing else), the floor of
what a conversation's length costs any proxy of these APIs on this machine. The clocks, the load
generator's runs and the processes under test are ``bench_proxy_measure``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench_proxy_load import GROW_WORDS, NEW_WORDS
from bench_proxy_measure import (
    HERE,
    MAX_TOKENS,
    profiled,
    resident_bytes,
    run_child,
    start_process,
    tiny_answer,
    upstreams,
    wait_http,
)

#: History lengths (prompt tokens) at which the proxy's CPU per call is measured.
HISTORY_LENGTHS = (1_000, 2_000, 5_000, 10_000, 20_000, 30_000)
RELAY = HERE / "bench_proxy_relay.py"


@contextlib.asynccontextmanager
async def relay(upstream_socket: str, workdir: Path) -> AsyncIterator[tuple[str, int]]:
    """The pass-through relay to the upstream at ``upstream_socket``: its chat URL and pid."""
    process = start_process([sys.executable, str(RELAY), upstream_socket], cwd=workdir, pipe=True)
    try:
        assert process.stdout is not None
        port = json.loads(await asyncio.to_thread(process.stdout.readline))["port"]
        await wait_http(f"http://127.0.0.1:{port}/")
        yield f"http://127.0.0.1:{port}/v1/chat/completions", process.pid
    finally:
        process.terminate()
        process.wait(10)


def spent(clock: list[float], i: int) -> float:
    """The clock's advance over the ``i``-th measured stretch (between marks 2i and 2i + 1)."""
    return clock[2 * i + 1] - clock[2 * i]


async def history(calls: int, profile: Path | None, max_tokens: int = MAX_TOKENS, rounds: int = 1) -> None:
    """The proxy's CPU per call as a conversation's history grows from 1k to 30k tokens, and the
    relay's on the same conversations; with ``rounds``, each length measured that many times on a
    conversation of its own, the lengths taking turns in a different order each round (medians,
    and each round's 30k/1k ratios)."""
    from appliance.app import Appliance
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    cpu: dict[int, list[float]] = {length: [] for length in HISTORY_LENGTHS}
    floor: dict[int, list[float]] = {length: [] for length in HISTORY_LENGTHS}
    up: dict[int, list[float]] = {length: [] for length in HISTORY_LENGTHS}
    latencies: dict[int, list[float]] = {length: [] for length in HISTORY_LENGTHS}
    sizes: dict[int, tuple[int, int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "tiny")
        answer = tiny_answer(model_dir)
        async with (
            upstreams(answer, workdir, max_model_len=40_000) as ((_url, upstream_pid, engine_url),),
            relay(engine_url.removeprefix("unix:"), workdir) as (relay_url, relay_pid),
        ):
            overrides = {"data_dir": workdir / "run", "port": 0, "model": str(model_dir), "engine": "vllm",
                         "vllm_url": engine_url, "max_tokens": max_tokens}  # fmt: skip
            async with Appliance(load_config(overrides=overrides, env={})) as app:
                resident = resident_bytes()
                with profiled(profile) as profiler:
                    for turn in range(rounds):
                        # Each round its own order: the first length is another each time, and
                        # every other round runs them backwards (and the relay first).
                        shift = turn % len(HISTORY_LENGTHS)
                        order = HISTORY_LENGTHS[shift:] + HISTORY_LENGTHS[:shift]
                        order = order[::-1] if turn % 2 else order
                        rollouts = []
                        for length in order:
                            active = app.registry.register(
                                f"history-{length}-{turn}", task_id="t", group="g", task={}
                            )
                            url = f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions"
                            rollouts.append((length, url, active.token))
                        spec = {"rollouts": rollouts, "calls": calls, "max_tokens": max_tokens}
                        # As many messages as the proxy's conversation of each length held.
                        relayed: dict[str, Any] = {"calls": calls, "max_tokens": max_tokens}
                        for step in ("relay", "ours") if turn % 2 else ("ours", "relay"):
                            if step == "ours":
                                result, marks = await run_child(
                                    ["conversation", json.dumps(spec)], (), (upstream_pid,), profiler
                                )
                                for i, r in enumerate(result["rollouts"]):
                                    length = r["length"]
                                    cpu[length].append(spent(marks.server, i) / calls)
                                    up[length].append(spent(marks.upstream, i) / calls)
                                    latencies[length].extend(r["latencies"])
                                    sizes.setdefault(length, (r["messages"], r["start"], r["end"]))
                            else:
                                relayed["rollouts"] = [(n, relay_url, "-", sizes[n][0]) for n in order]
                                args = ["conversation", json.dumps(relayed)]
                                result, marks = await run_child(args, (relay_pid,))
                                for i, r in enumerate(result["rollouts"]):
                                    length = r["length"]
                                    if r["messages"] != sizes[length][0]:
                                        raise RuntimeError(f"the relay's {length} conversation grew apart")
                                    floor[length].append(spent(marks.server, i) / calls)
                gc.collect()
                grown = resident_bytes() - resident
    tokens = answer.length(max_tokens)
    print(
        f"one client; each conversation grown with ~{GROW_WORDS}-word user turns to its length, then "
        f"{calls} calls each adding the last answer and a {NEW_WORDS}-word user turn, {tokens} tokens per "
        "answer; the proxy records every call (durable before answered); the relay passes each "
        "call's bytes through to the upstream's chat route and back, nothing else"
        + (f"; {rounds} rounds, each length on a conversation of its own (medians)" if rounds > 1 else "")
    )
    print(f"{'history':>8} {'messages':>8} {'prompt tokens':>15} {'cpu/call':>10} {'p50':>8} "
          f"{'tok/s/core ours':>15} {'cpu/call up':>11} {'cpu/call relay':>14}")  # fmt: skip
    for length in HISTORY_LENGTHS:
        messages, start, end = sizes[length]
        ours = statistics.median(cpu[length])
        print(
            f"{length:>8} {messages:>8} {start:>7}-{end:<7} "
            f"{ours * 1e6:>7.0f} us {statistics.median(latencies[length]) * 1e3:>6.2f} ms "
            f"{tokens / ours if ours > 0 else math.nan:>15.0f} {statistics.median(up[length]) * 1e6:>8.0f} us"
            f" {statistics.median(floor[length]) * 1e6:>11.0f} us"
        )
    low, high = HISTORY_LENGTHS[0], HISTORY_LENGTHS[-1]
    if rounds > 1:
        for name, figures in (("ours", cpu), ("relay", floor)):
            ratios = [b / a for a, b in zip(figures[low], figures[high], strict=True) if a > 0]
            print(
                f"per round, {name}: cpu/call at {high // 1000}k "
                + " ".join(f"{v * 1e6:.0f}" for v in figures[high])
                + f" us; at {low // 1000}k "
                + " ".join(f"{v * 1e6:.0f}" for v in figures[low])
                + f" us; {high // 1000}k/{low // 1000}k "
                + " ".join(f"{r:.2f}" for r in ratios)
                + f" (median {statistics.median(ratios):.2f})"
            )
    growth = statistics.median(b - a for a, b in zip(cpu[low], cpu[high], strict=True))
    relay_growth = statistics.median(b - a for a, b in zip(floor[low], floor[high], strict=True))
    print(
        f"cpu/call growth from {low // 1000}k to {high // 1000}k, median of rounds: ours "
        f"{growth * 1e6:.0f} us, the relay's {relay_growth * 1e6:.0f} us (the conversation's bytes in "
        "and out)"
    )
    print(
        f"the appliance's resident memory grew by {grown / 2**20:.1f} MiB over the conversations' "
        f"{calls * len(HISTORY_LENGTHS) * rounds} measured and their growing calls (it keeps the calls "
        "of rollouts no step consumed)"
    )
