"""The comparison's tables of scripts/bench_proxy.py: one per mode and answer length, a row per
client count.

Owns how a row is measured (the targets taking turns round after round, each a load run of
``bench_proxy_measure``), how a target's rounds merge into one result (``merged``) and compare
round by round (``per_round``), a row's figures by name (``figures``: what ``--json`` writes) and
the printed columns (``COLUMNS``). Starting the processes under test is ``bench_proxy``'s
``compare``.
"""

from __future__ import annotations

import cProfile
import dataclasses
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp
from bench_proxy_load import MESSAGES
from bench_proxy_measure import CONCURRENCY, MAX_TOKENS, Target, pct, run_load


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
    #: Rounds every target runs first, taking turns as the measured ones do, whose figures are
    #: left out: AGL's gateway serves faster over its first few thousand calls (327 calls/s in a
    #: first round, 370-388 from the fourth), which the load generator's own warm-up (128 calls)
    #: does not give it.
    warmup_rounds: int = 0


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
        # The warm-up rounds come first and are left out.
        for number in range(1 - cell.warmup_rounds, cell.rounds + 1):
            for name, runs in measured.items():
                if number < 1:
                    label = f", warm-up round {number + cell.warmup_rounds} of {cell.warmup_rounds}"
                else:
                    label = f", round {number} of {cell.rounds}" if cell.rounds > 1 else ""
                print(f"  ... {name}, {concurrency} clients{label}", file=sys.stderr, flush=True)
                outcome = await run_load(
                    live[name], concurrency, n, stream, profiler if number >= 1 else None,
                    max_tokens=max_tokens, answer_length=answer_length, upstream_pids=cell.upstream_pids,
                )  # fmt: skip
                if number >= 1:
                    runs.append(outcome)
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
