"""Proxy overhead, measured side by side in one run against a fast fake upstream.

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

The upstream answers instantly with fixed token ids (a real model would dominate every column),
so the figures are each proxy's own cost. Upstream, AGL's gateway and the load generator each
run in their own process; our proxy runs in this one. The load generator is a plain aiohttp
client (the same for every column), keep-alive, no retries.

    .venv/bin/python scripts/bench_proxy.py [--calls 1000] [--agl-python /work/agl-venv/bin/python]
    .venv/bin/python scripts/bench_proxy.py --tiny   # the tiny model in process vs through the proxy,
                                                     # calls/s and streaming time to first text
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 5?"},
]
MAX_TOKENS = 8
CONCURRENCY = (1, 64, 512)
AGL_KEY = "agl-bench-key"
ANSWER = "The answer is 7."


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# -- the fake upstream (its own process) ------------------------------------------------------


def upstream_app(answer_ids: list[int], max_model_len: int) -> web.Application:
    """A vLLM-shaped server that answers every completion at once with ``answer_ids``."""
    logprobs = [-0.5] * len(answer_ids)
    text = ANSWER

    def completion(ids: list[int], stream_chunk: bool = False) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": text,
            "token_ids": ids,
            "logprobs": {"token_logprobs": logprobs[: len(ids)], "top_logprobs": None},
            "finish_reason": None if stream_chunk else "stop",
        }
        return {"id": "cmpl-1", "object": "text_completion", "model": "policy", "choices": [choice]}

    def chat(ids: list[int]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "token_ids": ids, "logprobs": None, "finish_reason": "stop"}
        usage = {"prompt_tokens": 20, "completion_tokens": len(ids), "total_tokens": 20 + len(ids)}
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "policy",
            "choices": [choice],
            "usage": usage,
        }

    whole_completion = json.dumps(completion(answer_ids)).encode()
    whole_chat = json.dumps(chat(answer_ids)).encode()
    headers = {"Content-Type": "application/json"}

    async def stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=whole_completion, headers=headers)
        chunks = [completion([t], stream_chunk=True) for t in answer_ids]
        chunks[-1]["choices"][0]["finish_reason"] = "stop"
        return await stream(request, chunks)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=whole_chat, headers=headers)
        chunks = [
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": 0, "delta": {"content": text if i == 0 else ""}, "finish_reason": None}
                ],
            }
            for i in range(len(answer_ids))
        ]
        chunks[-1]["choices"] = [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]
        return await stream(request, chunks)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": max_model_len}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    return app


async def serve_upstream(answer_ids: list[int], max_model_len: int) -> None:
    runner = web.AppRunner(upstream_app(answer_ids, max_model_len), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"port": port}), flush=True)
    await asyncio.Event().wait()


# -- the load generator (its own process) -----------------------------------------------------


async def load(url: str, key: str, concurrency: int, calls: int, stream: bool) -> dict[str, Any]:
    """``calls`` chat completions, ``concurrency`` at a time; latencies, TTFTs and failures."""
    body = json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": stream})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    latencies: list[float] = []
    ttfts: list[float] = []
    failures: dict[str, int] = {}
    remaining = calls

    async def one(session: aiohttp.ClientSession) -> None:
        started = time.perf_counter()
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                failures[str(response.status)] = failures.get(str(response.status), 0) + 1
                await response.read()
                return
            if not stream:
                await response.read()
            else:
                first = 0.0
                async for line in response.content:
                    compact = line.replace(b" ", b"")
                    # The first chunk with text (ours opens with an empty role chunk).
                    if not first and b'"content":"' in compact and b'"content":""' not in compact:
                        first = time.perf_counter()
                    if line.startswith(b"data: [DONE]"):
                        break
                ttfts.append((first or time.perf_counter()) - started)
        latencies.append(time.perf_counter() - started)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            try:
                await one(session)
            except aiohttp.ClientError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        remaining = max(20, 2 * concurrency)  # warm-up: open the connections, warm the caches
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        latencies.clear()
        ttfts.clear()
        failures.clear()
        remaining = calls
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"rate": len(latencies) / elapsed, "latencies": latencies, "ttfts": ttfts, "failures": failures}


async def run_load(url: str, key: str, concurrency: int, calls: int, stream: bool) -> dict[str, Any]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--load", url, key, str(concurrency), str(calls),
        *(["--stream"] if stream else []),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await child.communicate()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


# -- the processes under test -----------------------------------------------------------------


def start_process(
    cmd: list[str], cwd: Path, *, env: dict[str, str] | None = None, pipe: bool = False
) -> subprocess.Popen[bytes]:
    """A child in its own session; its output is dropped (a full pipe would stall it) unless
    ``pipe``, for a child that prints one line and then nothing."""
    out = subprocess.PIPE if pipe else subprocess.DEVNULL
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.DEVNULL, start_new_session=True
    )


async def wait_http(url: str, timeout_s: float = 60.0) -> None:
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with session.get(url) as response:
                    if response.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout_s:g} s")
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def upstream(answer_ids: list[int], workdir: Path) -> AsyncIterator[str]:
    process = start_process(
        [sys.executable, __file__, "--upstream", json.dumps(answer_ids)], cwd=workdir, pipe=True
    )
    try:
        assert process.stdout is not None
        line = await asyncio.to_thread(process.stdout.readline)
        yield f"http://127.0.0.1:{json.loads(line)['port']}"
    finally:
        process.terminate()
        process.wait(10)


@contextlib.asynccontextmanager
async def agl_gateway(python: str, upstream_url: str, workdir: Path) -> AsyncIterator[str]:
    """AGL's server as it ships (one uvicorn worker), one model server and one rollout."""
    from appliance.engines.vllm_process import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    process = start_process(
        [python, "-m", "agentlightning.server", "host=127.0.0.1", f"port={port}", f"key={AGL_KEY}",
         "default_proxy.model_name=policy", f"hydra.run.dir={workdir / 'agl-hydra'}"],
        cwd=workdir, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_http(base + "/healthz")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {AGL_KEY}"}) as session:
            async with session.post(
                base + "/api/models", json=[{"model": "policy", "endpoint": upstream_url + "/v1"}]
            ) as response:
                response.raise_for_status()
            async with session.post(
                base + "/api/rollouts", json=[{"input": {}, "rollout_id": "bench"}]
            ) as response:
                response.raise_for_status()
        yield base + "/proxy/rollout/bench/attempt/a1/mode/train/openai/v1/chat/completions"
    finally:
        process.terminate()
        process.wait(10)


# -- the comparison ---------------------------------------------------------------------------


async def compare(calls: int, agl_python: str | None) -> None:
    from appliance.app import Appliance
    from appliance.chat.tokenizer import Tokenizer
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "tiny")
        tokenizer = Tokenizer.from_model_dir(model_dir)
        answer_ids = [*tokenizer.encode(ANSWER), tokenizer.im_end_id][:MAX_TOKENS]
        async with upstream(answer_ids, workdir) as upstream_url:
            await wait_http(upstream_url + "/v1/models")
            config = load_config(
                overrides={
                    "data_dir": workdir / "run",
                    "port": 0,
                    "model": str(model_dir),
                    "engine": "vllm",
                    "vllm_url": upstream_url,
                    "max_tokens": MAX_TOKENS,
                },
                env={},
            )
            async with Appliance(config) as app, contextlib.AsyncExitStack() as stack:
                active = app.registry.register("bench", task_id="t", group="g", task={})
                targets: dict[str, tuple[str, str] | str] = {
                    "direct": (upstream_url + "/v1/chat/completions", "none"),
                    "appliance": (f"{app.proxy_url}/rollouts/bench/v1/chat/completions", active.token),
                }
                if agl_python is None:
                    targets["agl"] = "skipped: no --agl-python given (or it does not exist)"
                else:
                    try:
                        url = await stack.enter_async_context(agl_gateway(agl_python, upstream_url, workdir))
                        targets["agl"] = (url, AGL_KEY)
                    except (RuntimeError, aiohttp.ClientError) as exc:
                        targets["agl"] = f"skipped: AGL's gateway did not start: {exc}"
                print(
                    f"fake vLLM-shaped upstream, {len(answer_ids)} tokens per answer, "
                    f"max_tokens={MAX_TOKENS}; {calls} calls per cell (1 client: {min(calls, 300)}); "
                    f"{os.cpu_count()} CPUs"
                )
                for stream in (False, True):
                    await table(targets, calls, stream)
                events = await app.store.read(types={"LLMCallCompleted"})
                print(f"\nthe appliance recorded {len(events)} LLMCallCompleted events (durable) in this run")


async def table(targets: dict[str, tuple[str, str] | str], calls: int, stream: bool) -> None:
    print(f"\n{'streaming' if stream else 'non-streaming'}:")
    header = (
        f"{'clients':>7} {'direct/s':>9} {'ours/s':>8} {'agl/s':>8} {'ours/dir':>8} {'ours/agl':>8} "
        f"{'p50 dir':>8} {'p50 ours':>8} {'p50 agl':>8} {'+p50 ours':>9} {'+p50 agl':>9} "
        f"{'p99 ours':>8} {'p99 agl':>8}"
    )
    if stream:
        header += f" {'ttft dir':>8} {'ttft ours':>9}"
    print(header)
    for concurrency in CONCURRENCY:
        n = min(calls, 300) if concurrency == 1 else calls
        results: dict[str, dict[str, Any] | str] = {}
        for name, target in targets.items():
            if isinstance(target, str):
                results[name] = target
            elif name == "agl" and stream:
                results[name] = await agl_stream_check(target)
            else:
                print(f"  ... {name}, {concurrency} clients", file=sys.stderr, flush=True)
                results[name] = await run_load(target[0], target[1], concurrency, n, stream)
        print(row(concurrency, results, stream))
    for name, result in results.items():
        if isinstance(result, str):
            print(f"  {name}: {result}")


async def agl_stream_check(target: tuple[str, str]) -> str:
    """What AGL's gateway answers a streaming call (it does not stream)."""
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(target[0], json=body, headers={"Authorization": f"Bearer {target[1]}"}) as response,
    ):
        return f"refuses streaming: HTTP {response.status} {(await response.text())[:80]}"


def row(concurrency: int, results: dict[str, dict[str, Any] | str], stream: bool) -> str:
    def rate(name: str) -> float:
        result = results[name]
        return float(result["rate"]) if isinstance(result, dict) else float("nan")

    def lat(name: str, q: float, key: str = "latencies") -> float:
        result = results[name]
        return pct(result[key], q) * 1e3 if isinstance(result, dict) else float("nan")

    failures = {n: r["failures"] for n, r in results.items() if isinstance(r, dict) and r["failures"]}
    line = (
        f"{concurrency:>7} {rate('direct'):>9.0f} {rate('appliance'):>8.0f} {rate('agl'):>8.0f} "
        f"{rate('appliance') / rate('direct'):>8.2f} {rate('appliance') / rate('agl'):>8.2f} "
        f"{lat('direct', 0.5):>8.2f} {lat('appliance', 0.5):>8.2f} {lat('agl', 0.5):>8.2f} "
        f"{lat('appliance', 0.5) - lat('direct', 0.5):>9.2f} {lat('agl', 0.5) - lat('direct', 0.5):>9.2f} "
        f"{lat('appliance', 0.99):>8.1f} {lat('agl', 0.99):>8.1f}"
    )
    if stream:
        line += f" {lat('direct', 0.5, 'ttfts'):>8.2f} {lat('appliance', 0.5, 'ttfts'):>9.2f}"
    return line + (f"  failures: {failures}" if failures else "")


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


async def tiny(calls: int) -> None:
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
            "max_tokens": MAX_TOKENS,
        }
        async with Appliance(load_config(overrides=overrides, env={})) as app:
            active = app.registry.register("bench", task_id="t", group="g", task={})
            tokenizer = app.registry._tokenizer
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=(tokenizer.im_end_id,)
            )
            prompt = active.transcript.render_chat(messages_from_openai(MESSAGES)).prompt_ids
            url = f"{app.proxy_url}/rollouts/bench/v1/chat/completions"

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
                f"tiny model, max_tokens={MAX_TOKENS}, {calls} calls per cell; the proxy records every call"
            )
            print(f"{'clients':>7} {'direct/s':>9} {'proxy/s':>8} {'ratio':>6} {'p50 dir':>8} {'p50 prx':>8}")
            for concurrency in (1, 8, 32):
                d_rate, d_lat = await timed(concurrency, calls, direct)
                proxied = await run_load(url, active.token, concurrency, calls, False)
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
                p_ttft += (await run_load(url, active.token, 1, per_round, True))["ttfts"]
            d50, p50 = statistics.median(d_ttft), statistics.median(p_ttft)
            d90, p90 = pct(d_ttft, 0.9), pct(p_ttft, 0.9)
            print(
                f"streaming time to first text, 1 client, {len(p_ttft)} calls: engine {d50 * 1e3:.2f} ms "
                f"(p90 {d90 * 1e3:.2f}), through the proxy {p50 * 1e3:.2f} ms (p90 {p90 * 1e3:.2f}), "
                f"added {(p50 - d50) * 1e3:.2f} ms at the median"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per cell (1 client: at most 300)")
    parser.add_argument("--agl-python", help="interpreter of a venv with agentlightning==1.0.2")
    parser.add_argument("--tiny", action="store_true", help="the tiny model in process vs through the proxy")
    parser.add_argument("--upstream", metavar="ANSWER_IDS", help=argparse.SUPPRESS)
    parser.add_argument(
        "--load", nargs=4, metavar=("URL", "KEY", "CONCURRENCY", "CALLS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.upstream:
        asyncio.run(serve_upstream(json.loads(args.upstream), max_model_len=2048))
    elif args.load:
        url, key, concurrency, n = args.load
        print(json.dumps(asyncio.run(load(url, key, int(concurrency), int(n), args.stream))))
    elif args.tiny:
        asyncio.run(tiny(args.calls))
    else:
        agl = args.agl_python if args.agl_python and Path(args.agl_python).exists() else None
        asyncio.run(compare(args.calls, agl))
