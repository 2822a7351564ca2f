"""The measuring of scripts/bench_proxy.py: what each of its modes measures with.

Owns the clocks (CPU time of this process, of its event loop's thread and of other processes, read
from ``/proc``), the load generator's runs (``bench_proxy_load.py`` in its own process, the clocks
read at each of its marks), the processes under test (the fake upstreams of
``bench_proxy_upstream.py``, the appliance's engine fleet over them, AGL's gateway) and the profiler
of the proxy's measured calls. The comparison's tables are ``bench_proxy_table``'s; the modes and
the command line, ``bench_proxy``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import aiohttp
from bench_proxy_upstream import ANSWER, answer_ids

HERE = Path(__file__).resolve().parent

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
    with tempfile.TemporaryDirectory(prefix="bench-load-") as directory:
        path = Path(directory) / "result.json"
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            str(LOAD),
            "--result",
            str(path),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        marks = await _follow_marks(child, server_pids, upstream_pids, profiler)
        if child.returncode != 0 or not path.exists():
            raise RuntimeError(f"the load generator ({args[0]}) failed: exit code {child.returncode}")
        result: dict[str, Any] = json.loads(path.read_text())
    return result, marks


async def _follow_marks(
    child: asyncio.subprocess.Process,
    server_pids: Sequence[int],
    upstream_pids: Sequence[int],
    profiler: cProfile.Profile | None,
) -> Marks:
    """Read the clocks at each of ``child``'s marks, answering each, until it exits."""
    assert child.stdout is not None and child.stdin is not None
    marks = Marks()
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
    await child.wait()
    return marks


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


class Upstream(NamedTuple):
    """A running fake upstream: the URL its clients call (the direct column's, AGL's), its
    process id, and the URL the appliance's engine attaches with: its Unix socket, as the engine
    reaches a vLLM server it launches."""

    url: str
    pid: int
    engine_url: str


@contextlib.asynccontextmanager
async def upstreams(
    answer: Answer, workdir: Path, count: int = 1, max_model_len: int = 2048, pace_ms: float = 0.0
) -> AsyncIterator[list[Upstream]]:
    """``count`` fake upstreams (``bench_proxy_upstream.py``), started together, streaming one
    token per ``pace_ms`` (0: at once), once each answers."""
    spec = json.dumps({"ids": answer.ids, "end": answer.end})
    sockets = [workdir / f"upstream-{i}.sock" for i in range(count)]
    cmd = [sys.executable, str(UPSTREAM), spec, "--max-model-len", str(max_model_len),
           "--pace-ms", str(pace_ms)]  # fmt: skip
    processes = [start_process([*cmd, "--uds", str(sock)], cwd=workdir, pipe=True) for sock in sockets]
    try:
        started = []
        for process, sock in zip(processes, sockets, strict=True):
            assert process.stdout is not None
            line = await asyncio.to_thread(process.stdout.readline)
            url = f"http://127.0.0.1:{json.loads(line)['port']}"
            started.append(Upstream(url, process.pid, f"unix:{sock}"))
        for upstream in started:
            await wait_http(upstream.url + "/v1/models")
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
    from appliance.engines.factory import create_engine
    from appliance.engines.fleet import EngineFleet

    def create(config: ApplianceConfig, model_dir: Path, *_: Any) -> EngineFleet:
        engines = [dataclasses.replace(config.engine, vllm_url=url) for url in urls]
        return EngineFleet([create_engine(dataclasses.replace(config, engine=e), model_dir) for e in engines])

    with mock.patch("appliance.app.create_fleet", create):
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
