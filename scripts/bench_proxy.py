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
so the figures are each proxy's own cost. It streams as vLLM 0.32 does: one token per event, or
with a request's ``stream_interval`` the first token alone, then that many per event, the rest at
the end; and it writes what vLLM writes for the request's asks (``return_token_ids`` echoes the
whole prompt's ids in the first event). ``--answer-tokens N`` makes every answer N tokens long
(default 8: a short answer).
``--rounds N`` measures each row N times, the three taking turns (direct, ours, AGL, direct, ...):
a row then gives the rounds' medians, and a line below it each round's ratios, from the same
few seconds of the machine. Upstream, AGL's gateway and the load generator each run in their
own process; our proxy runs in this one. The load generator is a plain aiohttp client (the same
for every column), keep-alive, no retries. Next to calls/s and latencies each
row gives the serving process's CPU time per call (user + system, all threads): ours from this
process's clock, AGL's gateway's and the upstream's from ``/proc/<pid>/stat``, read when the
load generator says its measured calls start and end (it waits meanwhile). Ours is also split
between the event loop's thread (the proxy's Python) and the process's other threads (the event
store's writer and its commits).

``--history`` measures our proxy alone on long conversations: one conversation per history
length (1k to 30k prompt tokens) grown through the proxy, then calls that each add the last
answer and a short user turn; the proxy's CPU per call at each length. ``--profile FILE``
cProfiles this process during the measured calls (by thread CPU time; profiling slows the calls,
so its figures are shares, not costs).

    .venv/bin/python scripts/bench_proxy.py [--calls 1000] [--clients 1,64,512]
                                            [--agl-python /work/agl-venv/bin/python] [--profile FILE]
                                            [--modes whole,streamed] [--answer-tokens 8]
                                            [--rounds 1]   # N: the targets take turns N times
    .venv/bin/python scripts/bench_proxy.py --history [--calls 30] [--profile FILE]
    .venv/bin/python scripts/bench_proxy.py --tiny   # the tiny model in process vs through the proxy,
                                                     # calls/s and streaming time to first text
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 5?"},
]
#: Tokens per answer (and the calls' max_tokens); ``--answer-tokens`` sets it for every process.
MAX_TOKENS = int(os.environ.get("BENCH_ANSWER_TOKENS", "8"))
CONCURRENCY = (1, 64, 512)
AGL_KEY = "agl-bench-key"
ANSWER = "The answer is 7."


@dataclass(frozen=True, slots=True)
class Target:
    """Where a column's clients send their calls, and the process that serves them (None: this
    one, where the appliance runs)."""

    url: str
    key: str
    pid: int | None


def answer_tokens(tokenizer: Any) -> list[int]:
    """The upstream's answer: ``ANSWER`` (repeated up to ``MAX_TOKENS``), then ``<|im_end|>``."""
    ids = tokenizer.encode(ANSWER)
    return [*(ids * max(1, (MAX_TOKENS - 1) // len(ids))), tokenizer.im_end_id][:MAX_TOKENS]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# -- the fake upstream (its own process) ------------------------------------------------------


def upstream_app(answer_ids: list[int], max_model_len: int) -> web.Application:
    """A vLLM-shaped server that answers every completion at once with ``answer_ids``."""
    logprobs = [-0.5] * len(answer_ids)
    text = ANSWER

    def completion(
        ids: list[int], body: dict[str, Any], stream_chunk: bool = False, first: bool = True
    ) -> dict[str, Any]:
        """A completion (or one event of its stream) as vLLM 0.32 writes it for ``body``'s asks:
        ``return_tokens_as_token_ids`` writes the log-probs' tokens as ``token_id:N``;
        ``return_token_ids`` adds the sampled ids and, in a stream's first event or a whole
        answer, the prompt's ids (all of them: a long conversation's are a long array)."""
        tokens = [f"token_id:{t}" if body.get("return_tokens_as_token_ids") else "7" for t in ids]
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": {"token_logprobs": logprobs[: len(ids)], "tokens": tokens, "top_logprobs": None},
            "finish_reason": None if stream_chunk else "stop",
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = body["prompt"]
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

    whole_chat = json.dumps(chat(answer_ids)).encode()
    headers = {"Content-Type": "application/json"}

    async def stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=orjson.dumps(completion(answer_ids, body)), headers=headers)
        every = int(body.get("stream_interval") or 1)
        groups = [answer_ids[:1], *(answer_ids[i : i + every] for i in range(1, len(answer_ids), every))]
        chunks = [completion(group, body, stream_chunk=True, first=i == 0) for i, group in enumerate(groups)]
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
        mark()
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        mark()
    return {
        "rate": len(latencies) / elapsed,
        "served": len(latencies),
        "latencies": latencies,
        "ttfts": ttfts,
        "failures": failures,
    }


def mark() -> None:
    """Tell the parent a measured stretch starts or ends, and wait until it has read the CPU
    clocks (the servers are idle meanwhile)."""
    print("mark", flush=True)
    sys.stdin.readline()


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system, every thread) of process ``pid`` so far; None: this process,
    where the appliance's proxy runs (read with nanosecond resolution)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def event_loop_seconds() -> float:
    """CPU time (user + system) of this process's main thread so far, where its event loop (the
    proxy's Python) runs; the rest of ``cpu_seconds(None)`` is its other threads' (the event
    store's writer, the tokenizer's). Clock ticks: read over hundreds of calls."""
    fields = Path(f"/proc/self/task/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_child(
    args: list[str], server_pid: int | None, profiler: cProfile.Profile | None = None
) -> tuple[dict[str, Any], list[float]]:
    """A load-generator child; the server's CPU seconds at each of its marks, and its result.
    ``profiler`` (this process's) runs between the first and second mark, the third and fourth..."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 24,  # the result's line holds every latency
    )
    assert child.stdout is not None and child.stdin is not None
    marks: list[float] = []
    loop_marks: list[float] = []
    last = b""
    while line := await child.stdout.readline():
        if line.strip() == b"mark":
            if profiler is not None and len(marks) % 2:
                profiler.disable()
            marks.append(cpu_seconds(server_pid))
            if server_pid is None:
                loop_marks.append(event_loop_seconds())
            if profiler is not None and len(marks) % 2:
                profiler.enable()
            child.stdin.write(b"ok\n")
            await child.stdin.drain()
        else:
            last = line
    await child.wait()
    result: dict[str, Any] = json.loads(last.decode())
    if len(loop_marks) >= 2:
        result["loop_cpu"] = loop_marks[1] - loop_marks[0]
    return result, marks


async def run_load(
    target: Target, concurrency: int, calls: int, stream: bool, profiler: cProfile.Profile | None = None
) -> dict[str, Any]:
    args = ["--load", target.url, target.key, str(concurrency), str(calls), *(["--stream"] if stream else [])]
    result, (before, after) = await run_child(args, target.pid, profiler if target.pid is None else None)
    result["cpu_per_call"] = (after - before) / max(1, result["served"])
    if "loop_cpu" in result:
        result["loop_cpu_per_call"] = result["loop_cpu"] / max(1, result["served"])
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
async def upstream(
    answer_ids: list[int], workdir: Path, max_model_len: int = 2048
) -> AsyncIterator[tuple[str, int]]:
    """The fake upstream's base URL and process id."""
    process = start_process(
        [
            sys.executable,
            __file__,
            "--upstream",
            json.dumps(answer_ids),
            "--max-model-len",
            str(max_model_len),
        ],
        cwd=workdir,
        pipe=True,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.to_thread(process.stdout.readline)
        yield f"http://127.0.0.1:{json.loads(line)['port']}", process.pid
    finally:
        process.terminate()
        process.wait(10)


@contextlib.asynccontextmanager
async def agl_gateway(python: str, upstream_url: str, workdir: Path) -> AsyncIterator[Target]:
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
        path = "/proxy/rollout/bench/attempt/a1/mode/train/openai/v1/chat/completions"
        yield Target(base + path, AGL_KEY, process.pid)
    finally:
        process.terminate()
        process.wait(10)


# -- the comparison ---------------------------------------------------------------------------


async def compare(
    calls: int,
    agl_python: str | None,
    profile: Path | None,
    clients: tuple[int, ...] = CONCURRENCY,
    streamed: tuple[bool, ...] = (False, True),
    rounds: int = 1,
) -> None:
    from appliance.app import Appliance
    from appliance.chat.tokenizer import Tokenizer
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "tiny")
        tokenizer = Tokenizer.from_model_dir(model_dir)
        answer_ids = answer_tokens(tokenizer)
        async with upstream(answer_ids, workdir) as (upstream_url, upstream_pid):
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
                targets: dict[str, Target | str] = {
                    "direct": Target(upstream_url + "/v1/chat/completions", "none", upstream_pid),
                    "appliance": Target(
                        f"{app.proxy_url}/rollouts/bench/v1/chat/completions", active.token, None
                    ),
                }
                if agl_python is None:
                    targets["agl"] = "skipped: no --agl-python given (or it does not exist)"
                else:
                    try:
                        targets["agl"] = await stack.enter_async_context(
                            agl_gateway(agl_python, upstream_url, workdir)
                        )
                    except (RuntimeError, aiohttp.ClientError) as exc:
                        targets["agl"] = f"skipped: AGL's gateway did not start: {exc}"
                print(
                    f"fake vLLM-shaped upstream, {len(answer_ids)} tokens per answer, "
                    f"max_tokens={MAX_TOKENS}; {calls} calls per cell (1 client: {min(calls, 300)})"
                    + (f" in each of {rounds} rounds, the targets taking turns" if rounds > 1 else "")
                    + f"; {os.cpu_count()} CPUs"
                )
                with profiled(profile) as profiler:
                    for stream in streamed:
                        await table(targets, calls, stream, profiler, clients, rounds)
                events = await app.store.read(types={"LLMCallCompleted"})
                print(f"\nthe appliance recorded {len(events)} LLMCallCompleted events (durable) in this run")


async def table(
    targets: dict[str, Target | str],
    calls: int,
    stream: bool,
    profiler: cProfile.Profile | None = None,
    clients: tuple[int, ...] = CONCURRENCY,
    rounds: int = 1,
) -> None:
    print(f"\n{'streaming' if stream else 'non-streaming'}:")
    header = (
        f"{'clients':>7} {'direct/s':>9} {'ours/s':>8} {'agl/s':>8} {'ours/dir':>8} {'ours/agl':>8} "
        f"{'p50 dir':>8} {'p50 ours':>8} {'p50 agl':>8} {'+p50 ours':>9} {'+p50 agl':>9} "
        f"{'p99 ours':>8} {'p99 agl':>8} {'cpu/call ours':>13} {'cpu/call agl':>12} {'cpu/call up':>11}"
    )
    if stream:
        header += f" {'ttft dir':>8} {'ttft ours':>9}"
    print(header)
    for concurrency in clients:
        n = min(calls, 300) if concurrency == 1 else calls
        results: dict[str, dict[str, Any] | str] = {}
        live: dict[str, Target] = {}
        for name, target in targets.items():
            if isinstance(target, str):
                results[name] = target
            elif name == "agl" and stream:
                results[name] = await agl_stream_check(target)
            else:
                live[name] = target
        measured: dict[str, list[dict[str, Any]]] = {name: [] for name in live}
        # The targets take turns, round after round: each round's figures come from the same few
        # seconds of the machine, so a drift in its speed moves every column of a round alike.
        for number in range(1, rounds + 1):
            for name, runs in measured.items():
                label = f", round {number} of {rounds}" if rounds > 1 else ""
                print(f"  ... {name}, {concurrency} clients{label}", file=sys.stderr, flush=True)
                runs.append(await run_load(live[name], concurrency, n, stream, profiler))
        results.update({name: merged(runs) for name, runs in measured.items()})
        print(row(concurrency, results, stream))
        ours = results.get("appliance")
        if isinstance(ours, dict) and "loop_cpu_per_call" in ours:
            loop = ours["loop_cpu_per_call"] * 1e6
            rest = ours["cpu_per_call"] * 1e6 - loop
            print(f"  ours' CPU/call: event loop {loop:.0f} us, other threads {rest:.0f} us")
        if rounds > 1:
            print("  " + per_round(measured))
    for name, result in results.items():
        if isinstance(result, str):
            print(f"  {name}: {result}")


async def agl_stream_check(target: Target) -> str:
    """What AGL's gateway answers a streaming call (it does not stream)."""
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(target.url, json=body, headers={"Authorization": f"Bearer {target.key}"}) as response,
    ):
        return f"refuses streaming: HTTP {response.status} {(await response.text())[:80]}"


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's rounds as one result: the median round's calls/s and CPU per call, the
    latencies of every round together, the failures summed."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {
        "rate": statistics.median(r["rate"] for r in runs),
        "served": sum(r["served"] for r in runs),
        "latencies": [x for r in runs for x in r["latencies"]],
        "ttfts": [x for r in runs for x in r["ttfts"]],
        "failures": {},
        "cpu_per_call": statistics.median(r["cpu_per_call"] for r in runs),
    }
    if all("loop_cpu_per_call" in r for r in runs):
        out["loop_cpu_per_call"] = statistics.median(r["loop_cpu_per_call"] for r in runs)
    for r in runs:
        for kind, count in r["failures"].items():
            out["failures"][kind] = out["failures"].get(kind, 0) + count
    return out


def per_round(measured: dict[str, list[dict[str, Any]]]) -> str:
    """Each round's ratios of ours to the others' calls/s, and our added p50 over direct's."""
    ours = measured.get("appliance")
    if not ours:
        return "no rounds of ours"
    parts = []
    for name in ("direct", "agl"):
        if name in measured:
            ratios = [o["rate"] / t["rate"] for o, t in zip(ours, measured[name], strict=True)]
            parts.append(
                f"ours/{'dir' if name == 'direct' else name} "
                + " ".join(f"{x:.2f}" for x in ratios)
                + f" (median {statistics.median(ratios):.2f})"
            )
    if "direct" in measured:
        added = [
            (pct(o["latencies"], 0.5) - pct(d["latencies"], 0.5)) * 1e3
            for o, d in zip(ours, measured["direct"], strict=True)
        ]
        parts.append(
            "+p50 ours "
            + " ".join(f"{x:.2f}" for x in added)
            + f" ms (median {statistics.median(added):.2f})"
        )
    return "per round: " + "; ".join(parts)


def row(concurrency: int, results: dict[str, dict[str, Any] | str], stream: bool) -> str:
    def rate(name: str) -> float:
        result = results[name]
        return float(result["rate"]) if isinstance(result, dict) else float("nan")

    def lat(name: str, q: float, key: str = "latencies") -> float:
        result = results[name]
        return pct(result[key], q) * 1e3 if isinstance(result, dict) else float("nan")

    def cpu(name: str) -> float:
        result = results[name]
        return float(result["cpu_per_call"]) * 1e6 if isinstance(result, dict) else float("nan")

    failures = {n: r["failures"] for n, r in results.items() if isinstance(r, dict) and r["failures"]}
    line = (
        f"{concurrency:>7} {rate('direct'):>9.0f} {rate('appliance'):>8.0f} {rate('agl'):>8.0f} "
        f"{rate('appliance') / rate('direct'):>8.2f} {rate('appliance') / rate('agl'):>8.2f} "
        f"{lat('direct', 0.5):>8.2f} {lat('appliance', 0.5):>8.2f} {lat('agl', 0.5):>8.2f} "
        f"{lat('appliance', 0.5) - lat('direct', 0.5):>9.2f} {lat('agl', 0.5) - lat('direct', 0.5):>9.2f} "
        f"{lat('appliance', 0.99):>8.1f} {lat('agl', 0.99):>8.1f} "
        f"{cpu('appliance'):>10.0f} us {cpu('agl'):>9.0f} us {cpu('direct'):>8.0f} us"
    )
    if stream:
        line += f" {lat('direct', 0.5, 'ttfts'):>8.2f} {lat('appliance', 0.5, 'ttfts'):>9.2f}"
    return line + (f"  failures: {failures}" if failures else "")


# -- profiling the proxy -----------------------------------------------------------------------


@contextlib.contextmanager
def profiled(path: Path | None) -> Iterator[cProfile.Profile | None]:
    """A cProfile profiler for the measured stretches of the block (``run_child`` turns it on and
    off; it sees the event loop's thread, where the proxy's Python runs); its top entries by own
    CPU time are printed and the whole profile is written to ``path``."""
    if path is None:
        yield None
        return
    # Timed by the thread's CPU clock: on a shared machine, wall time would count the moments
    # the process waited for a core.
    profiler = cProfile.Profile(time.thread_time)
    try:
        yield profiler
    finally:
        profiler.dump_stats(path)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(f"\nprofile of the proxy's measured calls (written to {path}), top entries by own time:")
        print(out.getvalue())


# -- long conversations -------------------------------------------------------------------------

#: History lengths (prompt tokens) at which the proxy's CPU per call is measured.
HISTORY_LENGTHS = (1_000, 2_000, 5_000, 10_000, 20_000, 30_000)
#: Words of each user turn that grows a conversation to its length (~600 tokens: 30k in ~50 calls),
#: and of each measured call's new user turn.
GROW_WORDS = 420
NEW_WORDS = 40
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "was", "with", "be", "on", "not",
         "this", "are", "from", "at", "which", "have", "they", "you", "were", "there", "one", "all",
         "file", "line", "error", "test", "function", "value", "return", "list", "import")  # fmt: skip


async def turn(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    messages: list[dict[str, Any]],
    rng: random.Random,
    words: int,
) -> int:
    """One call adding a user turn of ``words`` words, its answer appended; the prompt's tokens."""
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    messages.append({"role": "user", "content": text})
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS})
    async with session.post(url, data=body, headers=headers) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {answer}")
    messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return int(answer["usage"]["prompt_tokens"])


async def conversation(spec: dict[str, Any]) -> dict[str, Any]:
    """For each rollout: grow one conversation (a user turn, the proxy's answer, ...) to its
    history length, then make ``calls`` calls that each add the last answer and a short user turn,
    between two marks. What the proxy answered goes back verbatim, so every earlier turn splices."""
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        for length, url, key in spec["rollouts"]:
            rng = random.Random(length)
            messages: list[dict[str, Any]] = [MESSAGES[0]]
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

            call = partial(turn, session, url, headers, messages, rng)
            prompt_tokens = 0
            while prompt_tokens < length:
                prompt_tokens = await call(GROW_WORDS)
            grown = (len(messages), prompt_tokens)
            latencies: list[float] = []
            mark()
            for _ in range(spec["calls"]):
                started = time.perf_counter()
                prompt_tokens = await call(NEW_WORDS)
                latencies.append(time.perf_counter() - started)
            mark()
            out.append({"length": length, "messages": grown[0], "start": grown[1], "end": prompt_tokens,
                        "latencies": latencies})  # fmt: skip
    return {"rollouts": out}


async def history(calls: int, profile: Path | None) -> None:
    """The proxy's CPU per call as a conversation's history grows from 1k to 30k tokens."""
    from appliance.app import Appliance
    from appliance.chat.tokenizer import Tokenizer
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "tiny")
        tokenizer = Tokenizer.from_model_dir(model_dir)
        answer_ids = answer_tokens(tokenizer)
        async with upstream(answer_ids, workdir, max_model_len=40_000) as (upstream_url, _):
            await wait_http(upstream_url + "/v1/models")
            overrides = {"data_dir": workdir / "run", "port": 0, "model": str(model_dir), "engine": "vllm",
                         "vllm_url": upstream_url, "max_tokens": MAX_TOKENS}  # fmt: skip
            async with Appliance(load_config(overrides=overrides, env={})) as app:
                rollouts = []
                for length in HISTORY_LENGTHS:
                    active = app.registry.register(f"history-{length}", task_id="t", group="g", task={})
                    rollouts.append((length, f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions",
                                     active.token))  # fmt: skip
                spec = {"rollouts": rollouts, "calls": calls}
                resident = resident_bytes()
                with profiled(profile) as profiler:
                    result, marks = await run_child(["--conversation", json.dumps(spec)], None, profiler)
                gc.collect()
                grown = resident_bytes() - resident
    print(
        f"one client; each conversation grown with ~{GROW_WORDS}-word user turns to its length, then "
        f"{calls} calls each adding the last answer and a {NEW_WORDS}-word user turn; "
        "the proxy records every call (durable before answered)"
    )
    print(f"{'history':>8} {'messages':>8} {'prompt tokens':>15} {'cpu/call':>10} {'p50':>8}")
    for i, r in enumerate(result["rollouts"]):
        cpu = (marks[2 * i + 1] - marks[2 * i]) / calls
        print(
            f"{r['length']:>8} {r['messages']:>8} {r['start']:>7}-{r['end']:<7} "
            f"{cpu * 1e6:>7.0f} us {statistics.median(r['latencies']) * 1e3:>6.2f} ms"
        )
    print(
        f"the appliance's resident memory grew by {grown / 2**20:.1f} MiB over the conversations' "
        f"{calls * len(result['rollouts'])} measured and their growing calls (it keeps the calls of "
        "rollouts no step consumed)"
    )


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
                proxied = await run_load(Target(url, active.token, None), concurrency, calls, False)
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
                p_ttft += (await run_load(Target(url, active.token, None), 1, per_round, True))["ttfts"]
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
        "--answer-tokens", type=int, help=f"tokens per answer (default {MAX_TOKENS}; sets every process's)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each row this many times, the targets taking turns (medians; ratios per round)",
    )
    parser.add_argument("--upstream", metavar="ANSWER_IDS", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--conversation", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument(
        "--load", nargs=4, metavar=("URL", "KEY", "CONCURRENCY", "CALLS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.answer_tokens:
        os.environ["BENCH_ANSWER_TOKENS"] = str(args.answer_tokens)  # the children read it
        MAX_TOKENS = args.answer_tokens
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.upstream:
        asyncio.run(serve_upstream(json.loads(args.upstream), max_model_len=args.max_model_len))
    elif args.conversation:
        print(json.dumps(asyncio.run(conversation(json.loads(args.conversation)))))
    elif args.history:
        asyncio.run(history(args.calls, args.profile))
    elif args.load:
        url, key, concurrency, n = args.load
        print(json.dumps(asyncio.run(load(url, key, int(concurrency), int(n), args.stream))))
    elif args.tiny:
        asyncio.run(tiny(args.calls))
    else:
        agl = args.agl_python if args.agl_python and Path(args.agl_python).exists() else None
        clients = tuple(int(c) for c in args.clients.split(","))
        modes = tuple(mode == "streamed" for mode in args.modes.split(","))
        asyncio.run(compare(args.calls, agl, args.profile, clients, modes, max(1, args.rounds)))
