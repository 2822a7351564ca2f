"""Proxy overhead, measured side by side in one run against fast fake upstreams.

Three ways to get the same chat completion, each timed at 1, 64 and 512 concurrent clients,
streaming and not:

* direct: the clients call a fake vLLM-shaped upstream's ``/v1/chat/completions`` themselves
  (the limit: no proxy at all);
* appliance: the clients call our proxy (Chat Completions under a rollout's base URL), which
  renders the conversation to token ids, sends them to the same upstream's ``/v1/completions``
  through its vLLM engine client (attached with ``vllm_url``, nothing spawned), decodes the
  answer, makes the call durable in the event log and only then answers;
* agl: the clients call Agent Lightning 1.0.2's gateway (``python -m agentlightning.server``,
  FastAPI + httpx + uvicorn, one worker, its default configuration), which forwards to the same
  upstream's ``/v1/chat/completions`` and keeps its events in memory. It refuses streaming.
  It runs in its own Python 3.12 virtualenv, given with ``--agl-python``; without it that
  column says ``skipped``.

The upstream (``bench_proxy_upstream.py``) answers instantly with fixed token ids (a real model
would dominate every column), so the figures are each proxy's own cost. It streams as vLLM 0.32
does: one token per event, or with a request's ``stream_interval`` the first token alone, then
that many per event, the rest at the end; and it writes what vLLM writes for the request's asks
(``return_token_ids`` echoes the whole prompt's ids in the first event). ``--answer-tokens N``
makes every answer N tokens long (``ANSWER``'s ids repeated as often as they fit, then
``<|im_end|>``: 256 gives 253), a list (``8,256,1024``) one table per length (default 8: a short
answer).
``--pace-ms X`` (default 0: at once) makes the upstreams stream as fast as a GPU that samples one
token per X ms: each upstream takes a decode step every X ms, at which every running stream gets
its next token at once (as vLLM's engine steps all its running requests together); an event of one
token comes a step after the last, and for a request that asks a ``stream_interval`` an event of
that many that many steps after (as vLLM sends them at that decode speed); the direct column's
streams come at the same pace. Where nothing is paced, every
stream's tokens come as fast as the processes go and a proxy can group them; paced, each token
comes alone, as from a real model, and costs a read, a relay step and a client write.
``--replicas N`` starts N upstream processes, as a box of N vLLM replicas: the appliance serves
them as the engine fleet it builds for ``engine_replicas`` (``EngineFleet``, one vLLM engine client
attached to each with its ``vllm_url``), with one rollout per client so that the fleet spreads
the rollouts over its replicas (one replica: every client on one rollout, as always); the direct
column's clients spread over the N upstreams (client i on upstream i mod N), AGL's gateway
forwards to the first. The upstreams' CPU is summed.
``--rounds N`` measures each row N times, the three taking turns (direct, ours, AGL, direct, ...):
a row then gives the rounds' medians, and a line below it each round's ratios, from the same
few seconds of the machine. Upstreams, AGL's gateway and the load generator
(``bench_proxy_load.py``: a plain aiohttp client, the same for every column, keep-alive, no
retries) each run in their own process; our proxy runs in this one. Next to calls/s and
latencies each row gives the serving process's CPU time per call (user + system, all threads):
ours from this process's clock, AGL's gateway's and the upstreams' from ``/proc/<pid>/task``,
read when the load generator says its measured calls start and end (it waits meanwhile). Ours is
also split between the event loop's thread (the proxy's Python) and the process's other threads
(the event store's writer and its commits).

Then per token (an answer's tokens, streamed or whole; the tokens answered are the calls served
times the answer's length), the columns after the existing ones:

* ``tok/s dir``, ``tok/s ours``: tokens answered per second of wall time (the aggregate of the
  box: with ``--replicas N``, of N upstreams through one proxy process);
* ``tok/s/core ours``: tokens answered per CPU second of the proxy's process (one core busy for
  one second serves that many), and ``cpu/tok ours`` its inverse in microseconds;
* ``tok/s/core up``, ``cpu/tok up``: the same for the upstreams serving the direct column (the
  upstream's own cost of a token, one per event: what vLLM's server spends), and ``ours/up`` the
  ratio of the two CPU figures per token (at most 1: the proxy costs no more per token than the
  server it carries);
* ``cpu/tok up@ours``: the upstreams' CPU per token while they served our calls (their
  ``/v1/completions``, grouped as the proxy asks).

``--json FILE`` writes every row's figures (the columns above, by name) to ``FILE``.

``--history`` measures our proxy on long conversations (``bench_proxy_history.py``): one
conversation per history length (1k to 30k prompt tokens) grown through the proxy, then calls
that each add the last answer and a short user turn; the proxy's CPU per call at each length, its
tokens answered per CPU second, the upstream's CPU per call, and the CPU per call of a
pass-through relay on the same conversations (the floor: the conversation's bytes in and out
once). With ``--rounds N`` every length is measured N times, each time on a new conversation and
the lengths in another order (medians; lines give each round's CPU per call at 30k and 1k and their
ratio, ours and the relay's, and how much each grew: how flat the cost is, side by side). ``--profile FILE``
cProfiles this process during the measured calls (by thread CPU time; profiling slows the calls,
so its figures are shares, not costs).

This file holds the modes and the command line; the clocks, the load generator's runs, the
processes under test and the profiler are ``bench_proxy_measure.py``'s, the comparison's tables
(rounds, figures, columns) ``bench_proxy_table.py``'s.

    .venv/bin/python scripts/bench_proxy.py [--calls 1000] [--clients 1,64,512]
                                            [--agl-python /work/agl-venv/bin/python] [--profile FILE]
                                            [--modes whole,streamed] [--answer-tokens 8[,256,...]]
                                            [--rounds 1]   # N: the targets take turns N times
                                            [--replicas 1] [--pace-ms 0] [--json FILE]
    .venv/bin/python scripts/bench_proxy.py --history [--calls 30] [--rounds N] [--profile FILE]
    .venv/bin/python scripts/bench_proxy.py --tiny   # the tiny model in process vs through the proxy,
                                                     # calls/s and streaming time to first text
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_proxy_history import history  # noqa: E402
from bench_proxy_load import MESSAGES  # noqa: E402
from bench_proxy_measure import (  # noqa: E402
    CONCURRENCY,
    MAX_TOKENS,
    Target,
    agl_gateway,
    fleet_of,
    pct,
    profiled,
    run_load,
    tiny_answer,
    upstreams,
)
from bench_proxy_table import Cell, table  # noqa: E402

# -- the comparison ---------------------------------------------------------------------------


async def compare(
    calls: int,
    agl_python: str | None,
    profile: Path | None,
    clients: tuple[int, ...] = CONCURRENCY,
    streamed: tuple[bool, ...] = (False, True),
    rounds: int = 1,
    answer_tokens: tuple[int, ...] = (MAX_TOKENS,),
    replicas: int = 1,
    pace_ms: float = 0.0,
    warmup_rounds: int = 0,
) -> list[dict[str, Any]]:
    """The tables (one per mode and answer length, a row per client count); every row's figures
    (``pace_ms``: the upstreams stream one token per that many milliseconds; ``warmup_rounds``:
    rounds each target runs first, left out)."""
    from appliance.app import Appliance
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    rows: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model_dir = build_tiny_model(workdir / "tiny")
        answer = tiny_answer(model_dir)
        served = await stack.enter_async_context(upstreams(answer, workdir, replicas, pace_ms=pace_ms))
        urls = [upstream.url for upstream in served]
        upstream_pids = tuple(upstream.pid for upstream in served)
        engine_urls = [upstream.engine_url for upstream in served]
        overrides = {"data_dir": workdir / "run", "port": 0, "model": str(model_dir), "engine": "vllm",
                     "vllm_url": engine_urls[0], "max_tokens": max(answer_tokens)}  # fmt: skip
        stack.enter_context(fleet_of(engine_urls))
        app = await stack.enter_async_context(Appliance(load_config(overrides=overrides, env={})))
        # Every client on one rollout; with several replicas one rollout per client, which the
        # fleet spreads over them (a rollout's calls stay on its replica).
        rollouts = []
        for number in range(1 if replicas == 1 else max(clients)):
            active = app.registry.register(f"bench-{number}", task_id="t", group="g", task={})
            rollouts.append((f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions", active.token))
        targets: dict[str, Target | str] = {
            "direct": Target(tuple(url + "/v1/chat/completions" for url in urls), ("none",), upstream_pids),
            "appliance": Target(tuple(url for url, _ in rollouts), tuple(key for _, key in rollouts)),
        }
        if agl_python is None:
            targets["agl"] = "skipped: no --agl-python given (or it does not exist)"
        else:
            try:
                targets["agl"] = await stack.enter_async_context(agl_gateway(agl_python, urls[0], workdir))
            except (RuntimeError, aiohttp.ClientError) as exc:
                targets["agl"] = f"skipped: AGL's gateway did not start: {exc}"
        fleet = (
            f"{replicas} fake vLLM-shaped upstreams behind the appliance's engine fleet, one rollout per "
            "client (direct: the clients spread over the upstreams)"
            if replicas > 1
            else "fake vLLM-shaped upstream"
        )
        print(
            f"{fleet}, {'/'.join(str(answer.length(n)) for n in answer_tokens)} tokens per answer "
            f"(max_tokens={'/'.join(str(n) for n in answer_tokens)}); {calls} calls per cell "
            f"(1 client: {min(calls, 300)})"
            + (f" in each of {rounds} rounds, the targets taking turns" if rounds > 1 else "")
            + (f", after {warmup_rounds} left out" if warmup_rounds else "")
            + (f"; streams paced at {pace_ms:g} ms per token" if pace_ms > 0 else "")
            + f"; {os.cpu_count()} CPUs"
        )
        cell = Cell(calls, clients, rounds, upstream_pids, replicas, pace_ms, warmup_rounds)
        with profiled(profile) as profiler:
            for stream in streamed:
                for max_tokens in answer_tokens:
                    length = answer.length(max_tokens)
                    rows += await table(targets, cell, stream, max_tokens, length, profiler)
        events = await app.store.read(types={"LLMCallCompleted"})
        print(f"\nthe appliance recorded {len(events)} LLMCallCompleted events (durable) in this run")
        if replicas > 1:
            status = getattr(app.engine, "status", lambda: ())()
            spread = ", ".join(f"replica {r.index}: {r.rollouts} ({r.state})" for r in status)
            print(f"rollouts per replica of the fleet: {spread or 'no fleet'}")
    return rows


# -- the tiny model in process vs through the proxy ------------------------------------------


async def timed(
    concurrency: int, calls: int, one: Callable[[], Awaitable[float]]
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    remaining = calls

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            latencies.append(await one())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return calls / (time.perf_counter() - started), latencies


async def tiny(calls: int, max_tokens: int = MAX_TOKENS) -> None:
    """The tiny model called in process vs through the proxy (the proxy's share of a real call)."""
    import torch

    from appliance.app import Appliance
    from appliance.chat.messages import messages_from_openai
    from appliance.chat.tokenizer import IncrementalDecoder
    from appliance.config import load_config
    from appliance.engines.base import GenerateRequest, SamplingParams
    from appliance.engines.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        overrides = {
            "data_dir": Path(tmp) / "run",
            "port": 0,
            "model": str(model_dir),
            "max_tokens": max_tokens,
        }
        async with Appliance(load_config(overrides=overrides, env={})) as app:
            active = app.registry.register("bench", task_id="t", group="g", task={})
            tokenizer = app.registry._tokenizer
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0, stop_token_ids=(tokenizer.im_end_id,)
            )
            prompt = active.transcript.render_chat(messages_from_openai(MESSAGES)).prompt_ids
            url = f"{app.proxy_url}/rollouts/bench/v1/chat/completions"
            target = Target((url,), (active.token,))

            async def direct() -> float:
                t = time.perf_counter()
                await app.engine.generate(GenerateRequest(prompt_ids=prompt, params=params))
                return time.perf_counter() - t

            async def direct_ttft() -> float:
                # Time to the first visible text, as a streaming client sees it: a byte-level
                # token can be half a character, which no stream may send on its own.
                t = time.perf_counter()
                first: list[float] = []
                decoder = IncrementalDecoder(tokenizer)

                def on_token(token: int, _logprob: float) -> None:
                    if not first and token != tokenizer.im_end_id and decoder.push(token):
                        first.append(time.perf_counter())

                request = GenerateRequest(prompt_ids=prompt, params=params, on_token=on_token)
                await app.engine.generate(request)
                return (first[0] if first else time.perf_counter()) - t

            await timed(2, 10, direct)
            print(
                f"tiny model, max_tokens={max_tokens}, {calls} calls per cell; the proxy records every call"
            )
            print(f"{'clients':>7} {'direct/s':>9} {'proxy/s':>8} {'ratio':>6} {'p50 dir':>8} {'p50 prx':>8}")
            for concurrency in (1, 8, 32):
                d_rate, d_lat = await timed(concurrency, calls, direct)
                proxied = await run_load(target, concurrency, calls, False, max_tokens=max_tokens)
                p_lat = proxied["latencies"]
                ratio = proxied["rate"] / d_rate
                print(
                    f"{concurrency:>7} {d_rate:>9.1f} {proxied['rate']:>8.1f} {ratio:>6.2f} "
                    f"{statistics.median(d_lat) * 1e3:>8.1f} {statistics.median(p_lat) * 1e3:>8.1f}"
                )
            # Streaming time to first text, 1 client: engine in process vs through the proxy over
            # HTTP, in alternating rounds so that both sides see the same machine load.
            d_ttft: list[float] = []
            p_ttft: list[float] = []
            per_round = max(10, min(calls, 300) // 5)
            for _ in range(5):
                d_ttft += [await direct_ttft() for _ in range(per_round)]
                p_ttft += (await run_load(target, 1, per_round, True, max_tokens=max_tokens))["ttfts"]
            d50, p50 = statistics.median(d_ttft), statistics.median(p_ttft)
            d90, p90 = pct(d_ttft, 0.9), pct(p_ttft, 0.9)
            print(
                f"streaming time to first text, 1 client, {len(p_ttft)} calls: engine {d50 * 1e3:.2f} ms "
                f"(p90 {d90 * 1e3:.2f}), through the proxy {p50 * 1e3:.2f} ms (p90 {p90 * 1e3:.2f}), "
                f"added {(p50 - d50) * 1e3:.2f} ms at the median"
            )


def integers(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per cell (1 client: at most 300)")
    parser.add_argument("--agl-python", help="interpreter of a venv with agentlightning==1.0.2")
    parser.add_argument("--tiny", action="store_true", help="the tiny model in process vs through the proxy")
    parser.add_argument(
        "--history", action="store_true", help="CPU per call as a conversation grows from 1k to 30k tokens"
    )
    parser.add_argument("--profile", type=Path, help="cProfile the proxy's process into this file")
    parser.add_argument(
        "--modes",
        default="whole,streamed",
        help="which tables: whole (non-streaming), streamed, or both (comma-separated)",
    )
    parser.add_argument(
        "--clients", default="1,64,512", help="concurrent clients of each row, comma-separated (1,64,512)"
    )
    parser.add_argument(
        "--answer-tokens",
        type=integers,
        default=(MAX_TOKENS,),
        help=f"tokens per answer, comma-separated: a table each (default {MAX_TOKENS}; --history and "
        "--tiny take the first)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each row this many times, the targets taking turns (medians; ratios per round); "
        "--history: each length this many times",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="fake upstreams, served by the appliance as an engine fleet (the direct column's clients "
        "spread over them)",
    )
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="the upstreams stream one token per this many milliseconds, as a GPU decodes (default 0: "
        "at once)",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="rounds each target runs first, taking turns, whose figures are left out (default 1: "
        "AGL's gateway serves faster over its first few thousand calls)",
    )
    parser.add_argument("--json", type=Path, help="write every row's figures to this file")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    first = args.answer_tokens[0]
    if args.history:
        asyncio.run(history(args.calls, args.profile, first, max(1, args.rounds)))
    elif args.tiny:
        asyncio.run(tiny(args.calls, first))
    else:
        agl = args.agl_python if args.agl_python and Path(args.agl_python).exists() else None
        clients = integers(args.clients)
        modes = tuple(mode == "streamed" for mode in args.modes.split(","))
        rows = asyncio.run(
            compare(args.calls, agl, args.profile, clients, modes, max(1, args.rounds), args.answer_tokens,
                    max(1, args.replicas), max(0.0, args.pace_ms), max(0, args.warmup_rounds))
        )  # fmt: skip
        if args.json:
            # NaN (a column without a result) as null: strict JSON.
            clean = [
                {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows
            ]
            args.json.write_text(json.dumps(clean, indent=1) + "\n")
            print(f"rows written to {args.json}")
