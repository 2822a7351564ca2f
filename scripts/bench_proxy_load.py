"""The load generator of scripts/bench_proxy.py: its own process, one per measured cell.

Owns the clients and nothing else (the servers and their clocks are ``bench_proxy``'s). A plain
aiohttp client (the same for every column), keep-alive, no retries. Two kinds of load:

* ``load``: chat completions, ``concurrency`` clients at a time, client i calling
  ``urls[i % len(urls)]`` with ``keys[i % len(keys)]`` (one URL: every client calls it; several:
  the clients spread over rollouts, or over the replicas of a direct column); a warm-up, then the
  measured calls between two marks; its result: latencies, times to first text and failures.
* ``conversation``: for each of a spec's rollouts, one conversation grown through the proxy to a
  history length, then measured calls (between two marks) that each add the last answer and a
  short user turn.

A mark is a line ``mark`` on stdout; the generator then waits for a line on stdin, so the parent
reads the servers' CPU clocks while they are idle. The result (JSON, every latency) is written to
the file ``--result`` names (a line of hundreds of kilobytes on the pipe came through cut short
about once in a dozen runs), or printed as the last line without it.

    python scripts/bench_proxy_load.py [--result FILE] load URL[,URL...] KEY[,KEY...] CONCURRENCY CALLS \
        MAX_TOKENS [--stream]
    python scripts/bench_proxy_load.py [--result FILE] conversation SPEC_JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 5?"},
]
#: Words of each user turn that grows a conversation to its length (~600 tokens: 30k in ~50 calls),
#: and of each measured call's new user turn.
GROW_WORDS = 420
NEW_WORDS = 40
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "was", "with", "be", "on", "not",
         "this", "are", "from", "at", "which", "have", "they", "you", "were", "there", "one", "all",
         "file", "line", "error", "test", "function", "value", "return", "list", "import")  # fmt: skip


def mark() -> None:
    """Tell the parent a measured stretch starts or ends, and wait until it has read the CPU
    clocks (the servers are idle meanwhile)."""
    print("mark", flush=True)
    sys.stdin.readline()


async def load(
    urls: list[str], keys: list[str], concurrency: int, calls: int, max_tokens: int, stream: bool
) -> dict[str, Any]:
    """``calls`` chat completions, ``concurrency`` at a time (client i on ``urls[i % len]``);
    latencies, TTFTs and failures."""
    body = json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream})
    latencies: list[float] = []
    ttfts: list[float] = []
    failures: dict[str, int] = {}
    remaining = calls

    async def one(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> None:
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

    async def worker(session: aiohttp.ClientSession, client: int) -> None:
        nonlocal remaining
        url = urls[client % len(urls)]
        headers = {"Authorization": f"Bearer {keys[client % len(keys)]}", "Content-Type": "application/json"}
        while remaining > 0:
            remaining -= 1
            try:
                await one(session, url, headers)
            except aiohttp.ClientError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        remaining = max(20, 2 * concurrency)  # warm-up: open the connections, warm the caches
        await asyncio.gather(*(worker(session, i) for i in range(concurrency)))
        latencies.clear()
        ttfts.clear()
        failures.clear()
        remaining = calls
        mark()
        started = time.perf_counter()
        await asyncio.gather(*(worker(session, i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
        mark()
    return {
        "rate": len(latencies) / elapsed,
        "served": len(latencies),
        "latencies": latencies,
        "ttfts": ttfts,
        "failures": failures,
    }


async def turn(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    max_tokens: int,
    messages: list[dict[str, Any]],
    rng: random.Random,
    words: int,
) -> int:
    """One call adding a user turn of ``words`` words, its answer appended; the prompt's tokens."""
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    messages.append({"role": "user", "content": text})
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens})
    async with session.post(url, data=body, headers=headers) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {answer}")
    messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return int(answer["usage"]["prompt_tokens"])


async def conversation(spec: dict[str, Any]) -> dict[str, Any]:
    """For each rollout: grow one conversation (a user turn, the proxy's answer, ...) to its
    history length, then make ``calls`` calls that each add the last answer and a short user turn,
    between two marks. What the proxy answered goes back verbatim, so every earlier turn splices.
    A rollout given as ``[length, url, key, messages]`` grows to that many messages instead (for a
    server that does not count tokens: the same words as its length's conversation elsewhere)."""
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        for length, url, key, *target in spec["rollouts"]:
            rng = random.Random(length)
            messages: list[dict[str, Any]] = [MESSAGES[0]]
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

            call = partial(turn, session, url, headers, spec["max_tokens"], messages, rng)
            prompt_tokens = 0
            while (len(messages) < target[0]) if target else (prompt_tokens < length):
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--result", help="write the result's JSON to this file (else: stdout)")
    kinds = parser.add_subparsers(dest="kind", required=True)
    load_args = kinds.add_parser("load")
    load_args.add_argument("urls", help="comma-separated")
    load_args.add_argument("keys", help="comma-separated")
    load_args.add_argument("concurrency", type=int)
    load_args.add_argument("calls", type=int)
    load_args.add_argument("max_tokens", type=int)
    load_args.add_argument("--stream", action="store_true")
    kinds.add_parser("conversation").add_argument("spec", help="JSON: rollouts, calls, max_tokens")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.kind == "load":
        urls, keys = args.urls.split(","), args.keys.split(",")
        result = load(urls, keys, args.concurrency, args.calls, args.max_tokens, args.stream)
    else:
        result = conversation(json.loads(args.spec))
    out = json.dumps(asyncio.run(result))
    if args.result:
        Path(args.result).write_text(out)
    else:
        print(out)
