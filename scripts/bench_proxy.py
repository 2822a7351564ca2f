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
token per X ms: they wait X ms before each event of one token, and for a request that asks a
``stream_interval`` X ms per token before each event of that many (as vLLM sends them at that
decode speed); the direct column's streams come at the same pace. Where nothing is paced, every
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

``--history`` measures our proxy alone on long conversations: one conversation per history
length (1k to 30k prompt tokens) grown through the proxy, then calls that each add the last
answer and a short user turn; the proxy's CPU per call at each length, its tokens answered per
CPU second, and the upstream's CPU per call. ``--profile FILE``
cProfiles this process during the measured calls (by thread CPU time; profiling slows the calls,
so its figures are shares, not costs).

    .venv/bin/python scripts/bench_proxy.py [--calls 1000] [--clients 1,64,512]
                                            [--agl-python /work/agl-venv/bin/python] [--profile FILE]
                                            [--modes whole,streamed] [--answer-tokens 8[,256,...]]
                                            [--rounds 1]   # N: the targets take turns N times
                                            [--replicas 1] [--pace-ms 0] [--json FILE]
    .venv/bin/python scripts/bench_proxy.py --history [--calls 30] [--profile FILE]
    .venv/bin/python scripts/bench_proxy.py --tiny   # the tiny model in process vs through the proxy,
                                                     # calls/s and streaming time to first text
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_proxy_load import GROW_WORDS, MESSAGES, NEW_WORDS  # noqa: E402
from bench_proxy_upstream import ANSWER, answer_ids  # noqa: E402

#: Tokens per answer (and the calls' max_tokens) unless ``--answer-tokens`` says.
MAX_TOKENS = int(os.environ.get("BENCH_ANSWER_TOKENS", "8"))
CONCURRENCY = (1, 64, 512)
AGL_KEY = "agl-bench-key"
LOAD = HERE / "bench_proxy_load.py"
UPSTREAM = HERE / "bench_proxy_upstream.py"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a column's clients send their calls (client i to ``urls[i % len]`` with
    ``keys[i % len]``), and the processes that serve them (empty: this one, where the appliance
    runs)."""

    urls: tuple[str, ...]
    keys: tuple[str, ...]
    pids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Answer:
    """The upstream's answer ids: ``ANSWER``'s (``ids``) and the end token (``end``)."""

    ids: list[int]
    end: int

    def length(self, max_tokens: int) -> int:
        """Tokens of every answer to a call asking for ``max_tokens``."""
        return len(answer_ids(self.ids, self.end, max_tokens))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# -- clocks ------------------------------------------------------------------------------------


#: Whether this kernel writes each thread's time on a core (``/proc/<pid>/task/<tid>/schedstat``).
SCHEDSTAT = Path("/proc/self/schedstat").exists()


def cpu_seconds(pids: Sequence[int] = ()) -> float:
    """CPU time (user + system, every thread) of processes ``pids`` so far, summed; none: this
    process, where the appliance's proxy runs (read with nanosecond resolution). Another
    process's is its threads' time on a core (``/proc/<pid>/task/*/schedstat``, nanoseconds: a
    few calls' worth shows), or where the kernel does not write those its clock ticks
    (``/proc/<pid>/stat``, 10 ms)."""
    if not pids:
        return time.process_time()
    if not SCHEDSTAT:
        ticks = 0
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")
    nanoseconds = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
                nanoseconds += int((task / "schedstat").read_text().split()[0])
    return nanoseconds / 1e9


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def event_loop_seconds() -> float:
    """CPU time (user + system) of this process's main thread so far, where its event loop (the
    proxy's Python) runs; the rest of ``cpu_seconds()`` is its other threads' (the event
    store's writer, the tokenizer's). Clock ticks: read over hundreds of calls."""
    fields = Path(f"/proc/self/task/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the load generator's runs -----------------------------------------------------------------


@dataclass(slots=True)
class Marks:
    """The clocks read at each of a load generator's marks: the serving processes', this
    process's event loop's (when this process serves) and the upstreams'."""

    server: list[float] = dataclasses.field(default_factory=list)
    loop: list[float] = dataclasses.field(default_factory=list)
    upstream: list[float] = dataclasses.field(default_factory=list)


async def run_child(
    args: list[str],
    server_pids: Sequence[int],
    upstream_pids: Sequence[int] = (),
    profiler: cProfile.Profile | None = None,
) -> tuple[dict[str, Any], Marks]:
    """A load-generator child (``bench_proxy_load.py args``); the clocks at each of its marks,
    and its result. ``profiler`` (this process's) runs between the first and second mark, the
    third and fourth..."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(LOAD),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 24,  # the result's line holds every latency
    )
    assert child.stdout is not None and child.stdin is not None
    marks = Marks()
    last = b""
    while line := await child.stdout.readline():
        if line.strip() == b"mark":
            if profiler is not None and len(marks.server) % 2:
                profiler.disable()
            marks.server.append(cpu_seconds(server_pids))
            if not server_pids:
                marks.loop.append(event_loop_seconds())
            if upstream_pids:
                marks.upstream.append(cpu_seconds(upstream_pids))
            if profiler is not None and len(marks.server) % 2:
                profiler.enable()
            child.stdin.write(b"ok\n")
            await child.stdin.drain()
        else:
            last = line
    await child.wait()
    result: dict[str, Any] = json.loads(last.decode())
    return result, marks


async def run_load(
    target: Target,
    concurrency: int,
    calls: int,
    stream: bool,
    profiler: cProfile.Profile | None = None,
    *,
    max_tokens: int = MAX_TOKENS,
    answer_length: int | None = None,
    upstream_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """One measured cell: ``calls`` calls of ``concurrency`` clients to ``target``; its result
    with the CPU per call of the serving processes (and of the upstreams, ``upstream_pids``,
    while they served these calls), and per token when ``answer_length`` is given."""
    args = ["load", ",".join(target.urls), ",".join(target.keys), str(concurrency), str(calls),
            str(max_tokens), *(["--stream"] if stream else [])]  # fmt: skip
    result, marks = await run_child(args, target.pids, upstream_pids, profiler if not target.pids else None)
    served = max(1, result["served"])
    before, after = marks.server
    result["cpu_per_call"] = (after - before) / served
    if len(marks.loop) >= 2:
        result["loop_cpu"] = marks.loop[1] - marks.loop[0]
        result["loop_cpu_per_call"] = result["loop_cpu"] / served
    if len(marks.upstream) >= 2:
        result["upstream_cpu_per_call"] = (marks.upstream[1] - marks.upstream[0]) / served
    if answer_length:
        result["answer_tokens"] = answer_length
        result["token_rate"] = result["rate"] * answer_length
        result["cpu_per_token"] = result["cpu_per_call"] / answer_length
        if "upstream_cpu_per_call" in result:
            result["upstream_cpu_per_token"] = result["upstream_cpu_per_call"] / answer_length
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
async def upstreams(
    answer: Answer, workdir: Path, count: int = 1, max_model_len: int = 2048, pace_ms: float = 0.0
) -> AsyncIterator[list[tuple[str, int]]]:
    """``count`` fake upstreams (``bench_proxy_upstream.py``), started together, streaming one
    token per ``pace_ms`` (0: at once); each one's base URL and process id, once each answers."""
    spec = json.dumps({"ids": answer.ids, "end": answer.end})
    cmd = [sys.executable, str(UPSTREAM), spec, "--max-model-len", str(max_model_len),
           "--pace-ms", str(pace_ms)]  # fmt: skip
    processes = [start_process(cmd, cwd=workdir, pipe=True) for _ in range(count)]
    try:
        started = []
        for process in processes:
            assert process.stdout is not None
            line = await asyncio.to_thread(process.stdout.readline)
            started.append((f"http://127.0.0.1:{json.loads(line)['port']}", process.pid))
        for url, _ in started:
            await wait_http(url + "/v1/models")
        yield started
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


@contextlib.contextmanager
def fleet_of(urls: Sequence[str]) -> Iterator[None]:
    """While open, the appliance built in this process serves the upstreams at ``urls`` as one
    engine fleet: ``EngineFleet`` over one vLLM engine client attached to each (``vllm_url``),
    each built by the factory as for a single attached server. One URL: nothing changes (the
    appliance attaches to it as configured)."""
    if len(urls) <= 1:
        yield
        return
    from appliance.config import ApplianceConfig
    from appliance.engines.base import Engine
    from appliance.engines.factory import create_engine
    from appliance.engines.fleet import EngineFleet

    def create(config: ApplianceConfig, model_dir: Path, *_: Any) -> Engine:
        engines = [dataclasses.replace(config.engine, vllm_url=url) for url in urls]
        return EngineFleet([create_engine(dataclasses.replace(config, engine=e), model_dir) for e in engines])

    with mock.patch("appliance.app.create_engine", create):
        yield


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
        yield Target((base + path,), (AGL_KEY,), (process.pid,))
    finally:
        process.terminate()
        process.wait(10)


def tiny_answer(model_dir: Path) -> Answer:
    """The upstream's answer for the tiny model's tokenizer."""
    from appliance.chat.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model_dir)
    return Answer(tokenizer.encode(ANSWER), tokenizer.im_end_id)


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
) -> list[dict[str, Any]]:
    """The tables (one per mode and answer length, a row per client count); every row's figures
    (``pace_ms``: the upstreams stream one token per that many milliseconds)."""
    from appliance.app import Appliance
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    rows: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model_dir = build_tiny_model(workdir / "tiny")
        answer = tiny_answer(model_dir)
        served = await stack.enter_async_context(upstreams(answer, workdir, replicas, pace_ms=pace_ms))
        urls = [url for url, _ in served]
        upstream_pids = tuple(pid for _, pid in served)
        overrides = {"data_dir": workdir / "run", "port": 0, "model": str(model_dir), "engine": "vllm",
                     "vllm_url": urls[0], "max_tokens": max(answer_tokens)}  # fmt: skip
        stack.enter_context(fleet_of(urls))
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
            + (f"; streams paced at {pace_ms:g} ms per token" if pace_ms > 0 else "")
            + f"; {os.cpu_count()} CPUs"
        )
        cell = Cell(calls, clients, rounds, upstream_pids, replicas, pace_ms)
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


@dataclass(frozen=True, slots=True)
class Cell:
    """How each row of a table is measured."""

    calls: int
    clients: tuple[int, ...] = CONCURRENCY
    rounds: int = 1
    #: The upstreams' processes (their CPU is read in every column).
    upstream_pids: tuple[int, ...] = ()
    replicas: int = 1
    #: Milliseconds per streamed token of the upstreams (0: at once).
    pace_ms: float = 0.0


async def table(
    targets: dict[str, Target | str],
    cell: Cell,
    stream: bool,
    max_tokens: int = MAX_TOKENS,
    answer_length: int = MAX_TOKENS,
    profiler: cProfile.Profile | None = None,
) -> list[dict[str, Any]]:
    """One table (streamed or not, one answer length): a row per client count; the rows' figures."""
    columns = [c for c in COLUMNS if stream or not c.streamed]
    print(f"\n{'streaming' if stream else 'non-streaming'}, {answer_length} tokens per answer:")
    print(" ".join(f"{c.label:>{c.width}}" for c in columns))
    rows = []
    for concurrency in cell.clients:
        n = min(cell.calls, 300) if concurrency == 1 else cell.calls
        results: dict[str, dict[str, Any] | str] = {}
        live: dict[str, Target] = {}
        for name, target in targets.items():
            if isinstance(target, str):
                results[name] = target
            elif name == "agl" and stream:
                results[name] = await agl_stream_check(target, max_tokens)
            else:
                # Every client on a rollout of its own where there is one per client.
                live[name] = dataclasses.replace(
                    target, urls=target.urls[:concurrency], keys=target.keys[:concurrency]
                )
        measured: dict[str, list[dict[str, Any]]] = {name: [] for name in live}
        # The targets take turns, round after round: each round's figures come from the same few
        # seconds of the machine, so a drift in its speed moves every column of a round alike.
        for number in range(1, cell.rounds + 1):
            for name, runs in measured.items():
                label = f", round {number} of {cell.rounds}" if cell.rounds > 1 else ""
                print(f"  ... {name}, {concurrency} clients{label}", file=sys.stderr, flush=True)
                runs.append(
                    await run_load(
                        live[name], concurrency, n, stream, profiler, max_tokens=max_tokens,
                        answer_length=answer_length, upstream_pids=cell.upstream_pids,
                    )
                )  # fmt: skip
        results.update({name: merged(runs) for name, runs in measured.items()})
        print(row(concurrency, results, stream))
        ours = results.get("appliance")
        if isinstance(ours, dict) and "loop_cpu_per_call" in ours:
            loop = ours["loop_cpu_per_call"] * 1e6
            rest = ours["cpu_per_call"] * 1e6 - loop
            print(f"  ours' CPU/call: event loop {loop:.0f} us, other threads {rest:.0f} us")
        if cell.rounds > 1:
            print("  " + per_round(measured))
        failures = {n: r["failures"] for n, r in results.items() if isinstance(r, dict) and r["failures"]}
        rows.append(
            {"mode": "streamed" if stream else "whole", "max_tokens": max_tokens, "replicas": cell.replicas,
             "pace_ms": cell.pace_ms, "calls": n, "rounds": cell.rounds, **figures(concurrency, results),
             "failures": failures}
        )  # fmt: skip
    for name, result in results.items():
        if isinstance(result, str):
            print(f"  {name}: {result}")
    return rows


async def agl_stream_check(target: Target, max_tokens: int = MAX_TOKENS) -> str:
    """What AGL's gateway answers a streaming call (it does not stream)."""
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {target.keys[0]}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(target.urls[0], json=body, headers=headers) as response,
    ):
        return f"refuses streaming: HTTP {response.status} {(await response.text())[:80]}"


#: Figures of a run that ``merged`` takes the rounds' median of.
MEDIANS = ("cpu_per_call", "loop_cpu_per_call", "upstream_cpu_per_call", "token_rate", "cpu_per_token",
           "upstream_cpu_per_token")  # fmt: skip


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's rounds as one result: the median round's calls/s and CPU per call (and per
    token), the latencies of every round together, the failures summed."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {
        "rate": statistics.median(r["rate"] for r in runs),
        "served": sum(r["served"] for r in runs),
        "latencies": [x for r in runs for x in r["latencies"]],
        "ttfts": [x for r in runs for x in r["ttfts"]],
        "failures": {},
    }
    for key in MEDIANS:
        if all(key in r for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    if "answer_tokens" in runs[0]:
        out["answer_tokens"] = runs[0]["answer_tokens"]
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


@dataclass(frozen=True, slots=True)
class Column:
    """A column of the printed tables: its header, its figure's name (``figures``), width,
    decimals and unit."""

    label: str
    key: str
    width: int
    decimals: int = 0
    unit: str = ""
    #: Only in streaming tables.
    streamed: bool = False

    def cell(self, value: float) -> str:
        return f"{value:>{self.width - len(self.unit)}.{self.decimals}f}{self.unit}"


COLUMNS = (
    Column("clients", "clients", 7),
    Column("direct/s", "direct_calls_per_s", 9),
    Column("ours/s", "ours_calls_per_s", 8),
    Column("agl/s", "agl_calls_per_s", 8),
    Column("ours/dir", "ours_over_direct", 8, 2),
    Column("ours/agl", "ours_over_agl", 8, 2),
    Column("p50 dir", "direct_p50_ms", 8, 2),
    Column("p50 ours", "ours_p50_ms", 8, 2),
    Column("p50 agl", "agl_p50_ms", 8, 2),
    Column("+p50 ours", "ours_added_p50_ms", 9, 2),
    Column("+p50 agl", "agl_added_p50_ms", 9, 2),
    Column("p99 ours", "ours_p99_ms", 8, 1),
    Column("p99 agl", "agl_p99_ms", 8, 1),
    Column("cpu/call ours", "ours_cpu_per_call_us", 13, 0, " us"),
    Column("cpu/call agl", "agl_cpu_per_call_us", 12, 0, " us"),
    Column("cpu/call up", "upstream_cpu_per_call_us", 11, 0, " us"),
    Column("ttft dir", "direct_ttft_p50_ms", 8, 2, streamed=True),
    Column("ttft ours", "ours_ttft_p50_ms", 9, 2, streamed=True),
    # Per token.
    Column("tok/s dir", "direct_tokens_per_s", 9),
    Column("tok/s ours", "ours_tokens_per_s", 10),
    Column("tok/s/core ours", "ours_tokens_per_core_s", 15),
    Column("tok/s/core up", "upstream_tokens_per_core_s", 13),
    Column("cpu/tok ours", "ours_cpu_per_token_us", 12, 2, " us"),
    Column("cpu/tok up", "upstream_cpu_per_token_us", 10, 2, " us"),
    Column("ours/up", "ours_over_upstream_per_token", 7, 2),
    Column("cpu/tok up@ours", "upstream_cpu_per_token_under_ours_us", 15, 2, " us"),
)


def figures(concurrency: int, results: dict[str, dict[str, Any] | str]) -> dict[str, float]:
    """A row's figures by name (NaN where a column has no result: AGL skipped or refusing)."""
    nan = float("nan")

    def get(name: str, key: str, scale: float = 1.0) -> float:
        result = results.get(name)
        return float(result[key]) * scale if isinstance(result, dict) and key in result else nan

    def lat(name: str, q: float, key: str = "latencies") -> float:
        result = results.get(name)
        return pct(result[key], q) * 1e3 if isinstance(result, dict) else nan

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else nan

    rate = {name: get(name, "rate") for name in ("direct", "appliance", "agl")}
    ours_token, up_token = get("appliance", "cpu_per_token"), get("direct", "cpu_per_token")
    return {
        "clients": concurrency,
        "direct_calls_per_s": rate["direct"],
        "ours_calls_per_s": rate["appliance"],
        "agl_calls_per_s": rate["agl"],
        "ours_over_direct": ratio(rate["appliance"], rate["direct"]),
        "ours_over_agl": ratio(rate["appliance"], rate["agl"]),
        "direct_p50_ms": lat("direct", 0.5),
        "ours_p50_ms": lat("appliance", 0.5),
        "agl_p50_ms": lat("agl", 0.5),
        "ours_added_p50_ms": lat("appliance", 0.5) - lat("direct", 0.5),
        "agl_added_p50_ms": lat("agl", 0.5) - lat("direct", 0.5),
        "ours_p99_ms": lat("appliance", 0.99),
        "agl_p99_ms": lat("agl", 0.99),
        "ours_cpu_per_call_us": get("appliance", "cpu_per_call", 1e6),
        "agl_cpu_per_call_us": get("agl", "cpu_per_call", 1e6),
        "upstream_cpu_per_call_us": get("direct", "cpu_per_call", 1e6),
        "direct_ttft_p50_ms": lat("direct", 0.5, "ttfts"),
        "ours_ttft_p50_ms": lat("appliance", 0.5, "ttfts"),
        "direct_tokens_per_s": get("direct", "token_rate"),
        "ours_tokens_per_s": get("appliance", "token_rate"),
        "ours_tokens_per_core_s": ratio(1.0, ours_token),
        "upstream_tokens_per_core_s": ratio(1.0, up_token),
        "ours_cpu_per_token_us": ours_token * 1e6,
        "upstream_cpu_per_token_us": up_token * 1e6,
        "ours_over_upstream_per_token": ratio(ours_token, up_token),
        "upstream_cpu_per_token_under_ours_us": get("appliance", "upstream_cpu_per_token", 1e6),
    }


def row(concurrency: int, results: dict[str, dict[str, Any] | str], stream: bool) -> str:
    values = figures(concurrency, results)
    line = " ".join(c.cell(values[c.key]) for c in COLUMNS if stream or not c.streamed)
    failures = {n: r["failures"] for n, r in results.items() if isinstance(r, dict) and r["failures"]}
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


async def history(calls: int, profile: Path | None, max_tokens: int = MAX_TOKENS) -> None:
    """The proxy's CPU per call as a conversation's history grows from 1k to 30k tokens."""
    from appliance.app import Appliance
    from appliance.config import load_config
    from appliance.engines.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "tiny")
        answer = tiny_answer(model_dir)
        async with upstreams(answer, workdir, max_model_len=40_000) as served:
            ((upstream_url, upstream_pid),) = served
            overrides = {"data_dir": workdir / "run", "port": 0, "model": str(model_dir), "engine": "vllm",
                         "vllm_url": upstream_url, "max_tokens": max_tokens}  # fmt: skip
            async with Appliance(load_config(overrides=overrides, env={})) as app:
                rollouts = []
                for length in HISTORY_LENGTHS:
                    active = app.registry.register(f"history-{length}", task_id="t", group="g", task={})
                    rollouts.append((length, f"{app.proxy_url}/rollouts/{active.rollout}/v1/chat/completions",
                                     active.token))  # fmt: skip
                spec = {"rollouts": rollouts, "calls": calls, "max_tokens": max_tokens}
                resident = resident_bytes()
                with profiled(profile) as profiler:
                    result, marks = await run_child(
                        ["conversation", json.dumps(spec)], (), (upstream_pid,), profiler
                    )
                gc.collect()
                grown = resident_bytes() - resident
    tokens = answer.length(max_tokens)
    print(
        f"one client; each conversation grown with ~{GROW_WORDS}-word user turns to its length, then "
        f"{calls} calls each adding the last answer and a {NEW_WORDS}-word user turn, {tokens} tokens per "
        "answer; the proxy records every call (durable before answered)"
    )
    print(f"{'history':>8} {'messages':>8} {'prompt tokens':>15} {'cpu/call':>10} {'p50':>8} "
          f"{'tok/s/core ours':>15} {'cpu/call up':>11}")  # fmt: skip
    for i, r in enumerate(result["rollouts"]):
        cpu = (marks.server[2 * i + 1] - marks.server[2 * i]) / calls
        up = (marks.upstream[2 * i + 1] - marks.upstream[2 * i]) / calls
        print(
            f"{r['length']:>8} {r['messages']:>8} {r['start']:>7}-{r['end']:<7} "
            f"{cpu * 1e6:>7.0f} us {statistics.median(r['latencies']) * 1e3:>6.2f} ms "
            f"{tokens / cpu if cpu > 0 else math.nan:>15.0f} {up * 1e6:>8.0f} us"
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
        help="measure each row this many times, the targets taking turns (medians; ratios per round)",
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
    parser.add_argument("--json", type=Path, help="write every row's figures to this file")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    first = args.answer_tokens[0]
    if args.history:
        asyncio.run(history(args.calls, args.profile, first))
    elif args.tiny:
        asyncio.run(tiny(args.calls, first))
    else:
        agl = args.agl_python if args.agl_python and Path(args.agl_python).exists() else None
        clients = integers(args.clients)
        modes = tuple(mode == "streamed" for mode in args.modes.split(","))
        rows = asyncio.run(
            compare(args.calls, agl, args.profile, clients, modes, max(1, args.rounds), args.answer_tokens,
                    max(1, args.replicas), max(0.0, args.pace_ms))
        )  # fmt: skip
        if args.json:
            # NaN (a column without a result) as null: strict JSON.
            clean = [
                {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows
            ]
            args.json.write_text(json.dumps(clean, indent=1) + "\n")
            print(f"rows written to {args.json}")
