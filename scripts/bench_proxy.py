"""Proxy overhead, measured side by side against the engine it fronts, in one run.

For the same prompts and sampling settings, this times (a) calls made straight to the engine
in process and (b) the same calls through the proxy over HTTP (Chat Completions, the official
``openai`` client, each call rendered, generated, made durable in the event log and answered).
The HTTP clients run in a separate process, so their own CPU is not charged to the proxy.
It prints, at several concurrency levels: calls/s both ways and their ratio, the p50 / p99
latency both ways and the added latency per call, and for streaming the time to first token
both ways.

    .venv/bin/python scripts/bench_proxy.py [--calls 200] [--max-tokens 8]

The tiny offline model is used, so the numbers show the proxy's cost, not the model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from appliance.app import Appliance
from appliance.chat.messages import messages_from_openai
from appliance.chat.tokenizer import IncrementalDecoder
from appliance.config import load_config
from appliance.engines.base import GenerateRequest, SamplingParams
from appliance.engines.tiny_model import build_tiny_model

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 5?"},
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(
    concurrency: int, calls: int, one: Callable[[], Awaitable[float]]
) -> tuple[float, list[float]]:
    """Run ``calls`` calls, ``concurrency`` at a time; returns (calls/s, per-call latencies)."""
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


async def client_process(
    url: str, key: str, concurrency: int, calls: int, max_tokens: int, stream: bool
) -> None:
    """Run in a child process: make the calls, print the latencies (or TTFTs) as JSON."""
    async with AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as oai:

        async def one() -> float:
            t = time.perf_counter()
            if not stream:
                await oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens)
                return time.perf_counter() - t
            first = 0.0
            chunks = await oai.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=max_tokens, stream=True
            )
            async for chunk in chunks:
                if not first and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            return (first or time.perf_counter()) - t

        await timed(min(concurrency, 2), 5, one)  # warm the connection pool
        rate, latencies = await timed(concurrency, calls, one)
    print(json.dumps({"rate": rate, "latencies": latencies}))


async def through_proxy(
    url: str, key: str, concurrency: int, calls: int, max_tokens: int, stream: bool = False
) -> tuple[float, list[float]]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", url, key, str(concurrency), str(calls), str(max_tokens),
        *(["--stream"] if stream else []),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await child.communicate()
    result = json.loads(out.decode().strip().splitlines()[-1])
    return float(result["rate"]), [float(x) for x in result["latencies"]]


async def main(calls: int, max_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        config = load_config(
            overrides={
                "data_dir": Path(tmp) / "run",
                "port": 0,
                "model": str(model_dir),
                "max_tokens": max_tokens,
            },
            env={},
        )
        async with Appliance(config) as app:
            active = app.registry.register("bench", task_id="t", group="g", task={})
            engine = app.engine
            tokenizer = app.registry._tokenizer
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0, stop_token_ids=(tokenizer.im_end_id,)
            )
            prompt = active.conversation.render(messages_from_openai(MESSAGES)).prompt_ids
            url = f"{app.proxy_url}/rollouts/bench/v1"

            async def direct() -> float:
                t = time.perf_counter()
                await engine.generate(GenerateRequest(prompt_ids=prompt, params=params))
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

                await engine.generate(GenerateRequest(prompt_ids=prompt, params=params, on_token=on_token))
                return (first[0] if first else time.perf_counter()) - t

            await timed(2, 10, direct)  # warm-up

            print(
                f"tiny model, max_tokens={max_tokens}, {calls} calls per cell; proxy path records every call"
            )
            columns = ("clients", "direct/s", "proxy/s", "ratio", "p50 direct", "p50 proxy", "added p50")
            widths = (7, 9, 9, 6, 11, 10, 10, 11, 10)
            header = (*columns, "p99 direct", "p99 proxy")
            print(" ".join(f"{name:>{width}}" for name, width in zip(header, widths, strict=True)))
            for concurrency in (1, 8, 32):
                d_rate, d_lat = await timed(concurrency, calls, direct)
                p_rate, p_lat = await through_proxy(url, active.token, concurrency, calls, max_tokens)
                print(
                    f"{concurrency:>7} {d_rate:>9.1f} {p_rate:>9.1f} {p_rate / d_rate:>6.2f} "
                    f"{pct(d_lat, 0.5) * 1e3:>9.1f}ms {pct(p_lat, 0.5) * 1e3:>8.1f}ms "
                    f"{(pct(p_lat, 0.5) - pct(d_lat, 0.5)) * 1e3:>8.1f}ms "
                    f"{pct(d_lat, 0.99) * 1e3:>9.1f}ms {pct(p_lat, 0.99) * 1e3:>8.1f}ms"
                )
            d_ttft = [await direct_ttft() for _ in range(min(calls, 50))]
            _, p_ttft = await through_proxy(url, active.token, 1, min(calls, 50), max_tokens, stream=True)
            d50, p50 = statistics.median(d_ttft), statistics.median(p_ttft)
            print(
                f"streaming time to first text (1 client, median): direct {d50 * 1e3:.2f} ms, "
                f"proxy {p50 * 1e3:.2f} ms, added {(p50 - d50) * 1e3:.2f} ms"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--client", nargs=5, metavar=("URL", "KEY", "CONCURRENCY", "CALLS", "MAX_TOKENS"))
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    if args.client:
        url, key, concurrency, n, max_tokens = args.client
        asyncio.run(client_process(url, key, int(concurrency), int(n), int(max_tokens), args.stream))
    else:
        asyncio.run(main(args.calls, args.max_tokens))
