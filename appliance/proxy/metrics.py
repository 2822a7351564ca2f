"""``GET /metrics``: the appliance's figures in Prometheus' text format.

Owns one ``prometheus_client.CollectorRegistry`` per proxy app (never the process-wide default,
so several appliances in one process keep their figures apart), the route that serves it, and
who may read it: the admin token, or anyone on the same host when ``metrics_public`` is set (a
request from any other address still needs the token; forwarded-for headers are not believed).

Two kinds of figures:

* Per call, updated where a call ends, and nowhere else on the hot path: answers by surface and
  HTTP status (``middleware``: a stream that failed after its headers counts under its error's
  status, a client that went away under 499), and, for each recorded call (``recorded``, which
  ``CallService`` calls once the call is durable), its latency, its time to first token and its
  prompt and sampled tokens (``store.token_figures``), by surface. Kept as plain counts (about a
  microsecond a call) and turned into Prometheus' families when a scrape asks.
* Read at scrape time from what the appliance keeps anyway (``_LiveCollector``): rollouts by
  state (the words of ``store.outcomes``), the policy version and step, the scheduler's phase,
  the operator's pause, the circuit breaker (back-off running, seconds left, trips in a row), the
  serving gate, the engine's queue as the proxy sees it, the event store (events in the log,
  commits and their latency, as the writer counts them), the process (``process_*``: resident
  memory, CPU), and the run's training figures (``appliance.proxy.run_metrics``: rewards and
  rollout durations as histograms, tokens trained, the last step's loss, entropy, KL, gradient
  norm, policy version lag and memory; GPU memory where torch runs on CUDA here).

It does not record anything in the event log, and reads the run's state only through the app's
``RUN_STATE`` (absent in a bare proxy: those figures are then left out).
"""

from __future__ import annotations

import asyncio
import bisect
import ipaddress
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.proxy import anthropic_messages, openai_chat, openai_completions, openai_responses
from appliance.proxy.control import RUN_STATE
from appliance.proxy.http import ADMISSION, CALLS, PREFIXES, REGISTRY, SETTINGS, Handler, check_admin
from appliance.proxy.refusals import noted
from appliance.proxy.run_metrics import buckets as _buckets
from appliance.proxy.run_metrics import gauge as _gauge
from appliance.proxy.run_metrics import gpu_families, run_families
from store.events import LLMCallCompleted
from store.eventstore import EventStore
from store.outcomes import state_counts
from store.writer import COMMIT_BUCKETS_S

__all__ = ["METRICS", "ProxyMetrics", "attach", "loopback", "middleware"]

#: The scheduler's phases (``PhaseChanged``), each listed with 1 for the current one.
PHASES = ("idle", "generate", "train")
#: Bucket bounds in seconds: a call's whole latency (prepare to durable record), and its time to
#: first token.
CALL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: The surface of each model-call route, by its path after either prefix.
_ROUTES = {
    "/chat/completions": openai_chat.SURFACE,
    "/completions": openai_completions.SURFACE,
    "/responses": openai_responses.SURFACE,
    "/messages": anthropic_messages.SURFACE,
}
_SURFACES = {prefix + path: surface for prefix in PREFIXES for path, surface in _ROUTES.items()}


class _Tally:
    """One histogram kept as plain numbers: a count per bound (at most that value, above the
    previous bound), the last for larger values, and their sum. Updated on the event loop only."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


@dataclass(slots=True)
class _SurfaceTally:
    """What the recorded calls of one surface add up to."""

    latency: _Tally = field(default_factory=lambda: _Tally(CALL_BUCKETS_S))
    ttft: _Tally = field(default_factory=lambda: _Tally(TTFT_BUCKETS_S))
    prompt_tokens: int = 0
    sampled_tokens: int = 0


class ProxyMetrics:
    """The figures of one proxy app, in the app's own registry.

    Per call only plain counts change (a dict entry, a bucket found by bisection: about a
    microsecond); Prometheus' families are built from them, and from the live state, when a
    scrape asks."""

    def __init__(self, app: web.Application) -> None:
        #: Model calls answered, by (surface, HTTP status).
        self.answers: dict[tuple[str, int], int] = {}
        #: Recorded calls, by surface.
        self.surfaces: dict[str, _SurfaceTally] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_LiveCollector(app, self))
        # The process's own figures under their standard names (process_resident_memory_bytes,
        # process_cpu_seconds_total, ...): read from /proc at each scrape.
        ProcessCollector(registry=self.registry)

    def answered(self, surface: str, status: int) -> None:
        """One model call on ``surface`` answered with ``status``."""
        key = (surface, status)
        self.answers[key] = self.answers.get(key, 0) + 1

    def recorded(self, event: LLMCallCompleted) -> None:
        """One model call made durable (``CallService``'s hook)."""
        tally = self.surfaces.get(event.surface)
        if tally is None:
            tally = self.surfaces[event.surface] = _SurfaceTally()
        tally.latency.observe(event.total_s)
        if event.response_ids:
            tally.ttft.observe(event.ttft_s)
        tally.prompt_tokens += len(event.prompt_ids)
        tally.sampled_tokens += len(event.response_ids)

    def families(self) -> Iterator[Metric]:
        """The per-call figures as Prometheus families."""
        calls = CounterMetricFamily(
            "appliance_calls",
            "Model calls answered, by API surface and HTTP status",
            labels=("surface", "status"),
        )
        for (surface, status), count in sorted(self.answers.items()):
            calls.add_metric((surface, str(status)), count)
        yield calls
        surfaces = sorted(self.surfaces.items())
        latency = HistogramMetricFamily(
            "appliance_call_seconds",
            "Recorded model calls: seconds from the request read to the call recorded",
            labels=("surface",),
        )
        ttft = HistogramMetricFamily(
            "appliance_time_to_first_token_seconds",
            "Recorded model calls that sampled a token: seconds from the request read to the first token",
            labels=("surface",),
        )
        prompt = CounterMetricFamily(
            "appliance_prompt_tokens",
            "Tokens of recorded model calls' prompts, each call's whole prompt",
            labels=("surface",),
        )
        sampled = CounterMetricFamily(
            "appliance_sampled_tokens",
            "Tokens the policy sampled for recorded model calls (their rate: the engine's tokens/s)",
            labels=("surface",),
        )
        for surface, tally in surfaces:
            latency.add_metric(
                (surface,), _buckets(tally.latency.bounds, tally.latency.counts), tally.latency.sum
            )
            ttft.add_metric((surface,), _buckets(tally.ttft.bounds, tally.ttft.counts), tally.ttft.sum)
            prompt.add_metric((surface,), tally.prompt_tokens)
            sampled.add_metric((surface,), tally.sampled_tokens)
        yield from (latency, ttft, prompt, sampled)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """The per-call figures, and those read from the appliance's live state, at each scrape."""

    def __init__(self, app: web.Application, metrics: ProxyMetrics) -> None:
        self._app = app
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics.families()
        app = self._app
        calls = app[CALLS]
        admission = app[ADMISSION]
        yield _gauge(
            "appliance_policy_version", "Policy version the engine serves", calls.engine.policy_version
        )
        yield _gauge(
            "appliance_serving", "1 while the serving gate lets calls reach the engine", calls.gate.is_open
        )
        queue = GaugeMetricFamily(
            "appliance_engine_requests",
            "Model calls as the proxy sees the engine: running (handed to the engine, generating or "
            "in its queue) and waiting (held by the proxy, not at the engine: mostly at the gate "
            "while the trainer runs)",
            labels=("state",),
        )
        queue.add_metric(("running",), calls.gate.inflight)
        queue.add_metric(("waiting",), max(0, admission.held - calls.gate.inflight))
        yield queue
        yield _gauge("appliance_proxy_calls_held", "Model calls the proxy holds now", admission.held)
        yield CounterMetricFamily(
            "appliance_proxy_calls_refused",
            "Model calls refused because max_queued_calls were held",
            value=admission.refused,
        )
        yield _gauge("appliance_rollouts_live", "Rollouts registered with the proxy now", len(app[REGISTRY]))
        yield from _store(calls.store)
        yield from gpu_families()
        state = app.get(RUN_STATE)
        if state is None:
            return
        yield from run_families(state)
        rollouts = GaugeMetricFamily("appliance_rollouts", "Rollouts of the run by state", labels=("state",))
        for name, count in state_counts(state.rollouts.values()).items():
            rollouts.add_metric((name,), count)
        yield rollouts
        yield _gauge("appliance_training_step", "Training steps completed", state.step)
        phase = GaugeMetricFamily(
            "appliance_scheduler_phase", "1 for the scheduler's current phase", labels=("phase",)
        )
        for name in (*PHASES, *(() if state.phase in PHASES else (state.phase,))):
            phase.add_metric((name,), name == state.phase)
        yield phase
        yield _gauge("appliance_paused", "1 while an operator has paused the run", state.paused)
        now = time.time()
        trip = state.admissions_paused_at(now)
        yield _gauge(
            "appliance_breaker_paused",
            "1 while the circuit breaker's back-off holds admissions",
            trip is not None,
        )
        yield _gauge(
            "appliance_breaker_backoff_remaining_seconds",
            "Seconds left of the circuit breaker's back-off (0: none running)",
            max(0.0, trip.ts + trip.backoff_s - now) if trip is not None else 0.0,
        )
        yield _gauge(
            "appliance_breaker_trips",
            "Circuit breaker trips in a row (no training rollout finished)",
            state.breaker_trips,
        )


def _store(store: EventStore) -> Iterator[Metric]:
    """The event store's figures, as its writer counts them."""
    yield CounterMetricFamily(
        "appliance_store_events", "Events in the event log (its last position)", value=store.last_position
    )
    yield CounterMetricFamily(
        "appliance_store_commits", "Transactions the event store committed since start", value=store.commits
    )
    counts, total_s = store.commit_latency
    yield HistogramMetricFamily(
        "appliance_store_commit_seconds",
        "Event store transactions since start by SQL time (BEGIN IMMEDIATE to COMMIT, fsync included)",
        buckets=_buckets(COMMIT_BUCKETS_S, counts),
        sum_value=total_s,
    )


#: The app's figures (``attach``).
METRICS = web.AppKey("metrics", ProxyMetrics)


def attach(app: web.Application) -> ProxyMetrics:
    """Give ``app`` its figures: the registry, the call service's hook and ``GET /metrics``."""
    metrics = app[METRICS] = ProxyMetrics(app)
    app[CALLS].on_recorded = metrics.recorded
    app.router.add_get("/metrics", serve)
    return metrics


def loopback(request: web.Request) -> bool:
    """Whether ``request`` came from this host (the socket's peer, not a forwarded-for header)."""
    try:
        address = ipaddress.ip_address(request.remote or "")
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


async def serve(request: web.Request) -> web.Response:
    """The figures, to the admin token, or to a loopback client when ``metrics_public``."""
    if not (request.app[SETTINGS].metrics_public and loopback(request)):
        check_admin(request)
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts each model call's answer by surface and status (outside every other middleware,
    so the status is the one sent)."""
    resource = request.match_info.route.resource
    surface = _SURFACES.get(resource.canonical) if resource is not None else None
    if surface is None:
        return await handler(request)
    metrics = request.app[METRICS]
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        metrics.answered(surface, 499)  # the client went away (or the proxy is closing)
        raise
    except Exception:
        metrics.answered(surface, 500)
        raise
    status = response.status
    if status < 400 and (error := noted(request)) is not None:
        status = error.status  # a stream that failed after its headers went out
    metrics.answered(surface, status)
    return response
