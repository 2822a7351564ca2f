"""scripts/bench_proxy.py: its rounds (the targets take turns, and a row is the rounds' medians,
with each round's ratios beside it), and a smoke run of ``--replicas 2`` with real processes whose
rows carry the per-token columns (the figures themselves come from running the script)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.delitem(sys.modules, "bench_proxy", raising=False)
    import bench_proxy

    return bench_proxy


def run(rate: float, cpu_us: float, latencies_ms: list[float], **failures: int) -> dict[str, Any]:
    return {
        "rate": rate,
        "served": len(latencies_ms),
        "latencies": [x / 1e3 for x in latencies_ms],
        "ttfts": [],
        "failures": dict(failures),
        "cpu_per_call": cpu_us / 1e6,
        "loop_cpu_per_call": cpu_us / 2e6,
    }


def test_rounds_merge_into_medians_with_every_latency(bench: ModuleType) -> None:
    import bench_proxy_table

    rounds = [run(100, 300, [1, 2], Timeout=1), run(400, 900, [3]), run(200, 500, [4, 5], Timeout=2)]
    merged = bench_proxy_table.merged(rounds)
    assert merged["rate"] == 200 and merged["served"] == 5
    assert merged["cpu_per_call"] == pytest.approx(500e-6)
    assert merged["loop_cpu_per_call"] == pytest.approx(250e-6)
    assert merged["latencies"] == pytest.approx([0.001, 0.002, 0.003, 0.004, 0.005])
    assert merged["failures"] == {"Timeout": 3}
    assert bench_proxy_table.merged(rounds[:1]) is rounds[0]


def test_each_round_is_compared_with_the_others_of_its_round(bench: ModuleType) -> None:
    import bench_proxy_table

    # The machine slowed down in round 2: every target did, and the round's ratios hold.
    measured = {
        "direct": [run(1000, 50, [1.0]), run(500, 100, [2.0])],
        "appliance": [run(400, 300, [2.0]), run(200, 600, [4.0])],
        "agl": [run(40, 3000, [10.0]), run(25, 6000, [20.0])],
    }
    line = bench_proxy_table.per_round(measured)
    assert "ours/dir 0.40 0.40 (median 0.40)" in line
    assert "ours/agl 10.00 8.00 (median 9.00)" in line
    assert "+p50 ours 1.00 2.00 ms (median 1.50)" in line


async def test_warm_up_rounds_take_turns_and_are_left_out(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_proxy_measure
    import bench_proxy_table

    # Each target's calls/s by its run: AGL serves faster once warm, as its gateway does.
    rates = {"direct": [1000, 1000, 1000], "appliance": [400, 400, 400], "agl": [20, 40, 40]}
    order: list[tuple[str, bool]] = []

    async def load(
        target: Any, concurrency: int, calls: int, stream: bool, profiler: Any = None, **_: Any
    ) -> Any:
        name = target.urls[0]
        order.append((name, profiler is not None))
        return run(rates[name].pop(0), 100, [1.0])

    monkeypatch.setattr(bench_proxy_table, "run_load", load)
    targets: dict[str, Any] = {
        name: bench_proxy_measure.Target((name,), ("k",)) for name in ("direct", "appliance", "agl")
    }
    cell = bench_proxy_table.Cell(100, (64,), rounds=2, warmup_rounds=1)
    profiler = __import__("cProfile").Profile()
    (row,) = await bench_proxy_table.table(targets, cell, False, profiler=profiler)
    # One warm-up round, the targets in turn, unprofiled; then the two measured rounds.
    assert order == [(n, i > 0) for i in range(3) for n in ("direct", "appliance", "agl")]
    assert row["agl_calls_per_s"] == 40 and row["rounds"] == 2
    assert "ours/agl 10.00 10.00 (median 10.00)" in capsys.readouterr().out


def run_bench(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``scripts/bench_proxy.py argv`` in its own process, in ``tmp_path``; it must succeed."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_proxy.py"), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_fleet_of_two_upstreams_gives_every_row_its_tokens_per_core(tmp_path: Path) -> None:
    # Real processes: two fake upstreams, the appliance's proxy over them as an engine fleet,
    # the load generator; a few calls only (the figures come from running the script).
    out = tmp_path / "rows.json"
    argv = ["--replicas", "2", "--clients", "2", "--calls", "16", "--modes", "whole,streamed",
            "--answer-tokens", "64", "--json", str(out)]  # fmt: skip
    done = run_bench(tmp_path, argv)
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["max_tokens"], r["clients"], r["replicas"]) for r in rows] == [
        ("whole", 64, 2, 2), ("streamed", 64, 2, 2)
    ]  # fmt: skip
    for r in rows:
        assert not r["failures"], r
        for key in ("ours_cpu_per_call_us", "upstream_cpu_per_call_us", "ours_tokens_per_s",
                    "direct_tokens_per_s", "ours_tokens_per_core_s", "upstream_tokens_per_core_s",
                    "ours_cpu_per_token_us", "upstream_cpu_per_token_us", "ours_over_upstream_per_token",
                    "upstream_cpu_per_token_under_ours_us"):  # fmt: skip
            assert r[key] is not None and r[key] > 0, (key, r)
        # Tokens per core second and CPU per token are one figure, read two ways.
        assert r["ours_tokens_per_core_s"] == pytest.approx(1e6 / r["ours_cpu_per_token_us"])
        assert r["agl_calls_per_s"] is None  # no --agl-python: skipped
    printed = done.stdout
    for header in ("tok/s ours", "tok/s/core ours", "tok/s/core up", "cpu/tok ours", "cpu/tok up", "ours/up"):
        assert header in printed
    # The fleet spread the clients' rollouts over both upstreams.
    spread = re.search(
        r"rollouts per replica of the fleet: replica 0: (\d+) \(live\), replica 1: (\d+)", printed
    )
    assert spread is not None, printed
    assert int(spread[1]) >= 1 and int(spread[2]) >= 1


def test_answer_lengths_and_clients_are_lists(bench: ModuleType) -> None:
    import bench_proxy_measure

    assert bench.integers("256,1024") == (256, 1024)
    assert bench.integers("8") == (8,)
    for bad in ("", "0", "8,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.integers(bad)
    # An answer of N tokens: ANSWER's ids as often as they fit before the end token.
    answer = bench_proxy_measure.Answer([1, 2, 3], 9)
    assert [answer.length(n) for n in (1, 2, 8, 256)] == [1, 2, 7, 256]


def test_a_paced_upstream_streams_at_a_gpu_pace(tmp_path: Path) -> None:
    # Real processes, a few calls: every stream of 16 tokens at 5 ms per token takes about
    # 16 x 5 ms (an unpaced one a few), through the proxy and directly alike (timers fire to the
    # millisecond, some a little early).
    out = tmp_path / "rows.json"
    argv = ["--clients", "2", "--calls", "4", "--modes", "streamed", "--answer-tokens", "16",
            "--pace-ms", "5", "--json", str(out)]  # fmt: skip
    done = run_bench(tmp_path, argv)
    (r,) = json.loads(out.read_text())
    assert (r["mode"], r["max_tokens"], r["pace_ms"], r["failures"]) == ("streamed", 16, 5.0, {})
    # At least 15 of the 16 gaps, less the timers' early firing (an unpaced stream: a few ms).
    assert r["direct_p50_ms"] >= 0.7 * 16 * 5 and r["ours_p50_ms"] >= 0.7 * 16 * 5, r
    assert r["ours_cpu_per_token_us"] > 0 and r["upstream_cpu_per_token_us"] > 0
    assert "streams paced at 5 ms per token" in done.stdout


async def test_a_paced_stream_waits_per_token_of_each_event(bench: ModuleType) -> None:
    # As vLLM at that decode speed: the first token alone, then stream_interval tokens per
    # event, each event after the pace times its tokens.
    import time

    from aiohttp.test_utils import TestClient, TestServer
    from bench_proxy_upstream import upstream_app

    async with TestClient(TestServer(upstream_app([1, 2, 3], 9, 2048, pace_ms=20))) as client:
        body = {"prompt": [1], "max_tokens": 9, "stream": True, "stream_interval": 4}
        start = time.monotonic()
        arrivals = []
        async with client.post("/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    tokens = json.loads(line[6:])["choices"][0]["logprobs"]["token_logprobs"]
                    arrivals.append((len(tokens), time.monotonic() - start))
    # 7 tokens (ANSWER's 3 twice, then the end): 1, 4, then the 2 left, after 20, 100, 140 ms.
    assert [n for n, _ in arrivals] == [1, 4, 2]
    assert arrivals[0][1] >= 0.018 and arrivals[1][1] >= 0.09 and arrivals[2][1] >= 0.126


async def test_paced_streams_get_their_tokens_at_the_same_decode_steps(bench: ModuleType) -> None:
    # As a GPU engine steps every running request at once: a stream that starts 15 ms after
    # another gets each token at the same step as it (on clocks of their own, 15 ms apart).
    import asyncio
    import itertools

    from bench_proxy_upstream import DecodeSteps

    steps = DecodeSteps(0.03)
    loop = asyncio.get_running_loop()

    async def stream(delay: float) -> list[float]:
        await asyncio.sleep(delay)
        times = []
        for size in (1, 2, 1):
            await steps.after(size)
            times.append(loop.time())
        return times

    first, second = await asyncio.gather(stream(0.0), stream(0.015))
    assert all(abs(a - b) < 0.002 for a, b in zip(first, second, strict=True)), (first, second)
    # Two steps of 30 ms, then one (a timer may fire a little early, or late on a busy machine).
    gaps = [b - a for a, b in itertools.pairwise(first)]
    assert 0.055 <= gaps[0] < 0.3 and 0.025 <= gaps[1] < 0.3, gaps


async def test_the_relay_passes_a_conversation_through_as_it_came(bench: ModuleType, tmp_path: Path) -> None:
    # The floor of --history: the client's body goes to the upstream's chat route unchanged, and
    # the upstream's answer comes back unchanged.
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from bench_proxy_relay import relay_app

    seen: list[bytes] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(body=b'{"answer": 7}', content_type="application/json")

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(upstream)
    await runner.setup()
    socket_path = str(tmp_path / "up.sock")
    await web.UnixSite(runner, socket_path).start()
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "hi " * 5000}], "max_tokens": 8}).encode()
        async with TestClient(TestServer(relay_app(socket_path))) as client:
            response = await client.post("/v1/chat/completions", data=body)
            assert (response.status, await response.read()) == (200, b'{"answer": 7}')
    finally:
        await runner.cleanup()
    assert seen == [body]


def test_history_measures_the_relay_on_the_same_conversations(tmp_path: Path) -> None:
    # Real processes, two short lengths (the module's own list, shortened in the child): each
    # row gives the relay's CPU per call beside ours, and the relay's conversations have as many
    # messages as ours (grown to ours' counts; the bench checks).
    code = (
        "import asyncio, sys; sys.path[:0] = [sys.argv[1]]; import bench_proxy_history as h; "
        "h.HISTORY_LENGTHS = (300, 900); asyncio.run(h.history(3, None, 8, 2))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "scripts")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+(300|900)\s", line)]
    assert [row[0] for row in rows] == ["300", "900"] and all(row[-1] == "us" for row in rows), out
    assert all(float(row[-2]) > 0 for row in rows), out  # the relay's CPU per call
    assert "per round, relay: cpu/call at 0k" in out and "the relay's" in out, out


async def test_a_paced_stream_cancelled_leaves_the_step_to_the_others(bench: ModuleType) -> None:
    # A client that goes away cancels its stream's wait; the streams waiting on the same step
    # still get their token.
    import asyncio

    from bench_proxy_upstream import DecodeSteps

    steps = DecodeSteps(0.02)
    gone = asyncio.ensure_future(steps.after(1))
    stays = asyncio.ensure_future(steps.after(1))
    await asyncio.sleep(0.005)
    gone.cancel()
    await asyncio.wait_for(stays, 1.0)
    assert gone.cancelled() and stays.done() and stays.exception() is None
