"""The rollout controller: admits rollouts, runs their harnesses, and records how they end.

Owns the lifecycle of every rollout from ``RolloutCreated`` to ``RolloutFinished``: it draws the
next task, registers the rollout's credentials with the proxy, runs the adapter under a timeout,
records a reward the adapter returned, and records failures with their reason. Every rollout it
starts ends with exactly one ``RolloutFinished`` event, whether the agent succeeds, crashes,
times out, or the appliance stops.

An agent that ends without error has not necessarily produced something to train on: a rollout
whose model calls the proxy all refused (``LLMCallRefused``: a prompt past the context, a
malformed request), more than ``max_refused_fraction`` of them, or that made no model call at
all is failed, with the refusal as its reason (:func:`calls_verdict`); so is one a call of
which an engine replica broke off mid-way (lost after it had sampled tokens: ``ReplicaLost``).
Being failed, it is never trained and counts toward the circuit breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from appliance.config import HarnessConfig
from appliance.rollouts.registry import ActiveRollout, RolloutRegistry
from harness_adapters.base import ClientConfig, HarnessAdapter, Task
from harness_adapters.lifecycle import RetryPolicy, run_with_retries
from store.events import RewardReported, RolloutCreated, RolloutFinished
from store.eventstore import EventStore
from store.projections import RunState, one_line

log = logging.getLogger(__name__)


class EndpointSockets(Protocol):
    """The proxy's per-rollout sockets (``appliance.proxy.endpoints.RolloutSockets``)."""

    async def open(self, rollout: str) -> Path: ...

    async def close(self, rollout: str) -> None: ...


class RolloutController:
    def __init__(
        self,
        *,
        store: EventStore,
        registry: RolloutRegistry,
        adapter: HarnessAdapter,
        tasks: Iterator[Task],
        proxy_url: Callable[[], str],
        model_name: str,
        policy_version: Callable[[], int],
        harness: HarnessConfig,
        next_group_index: int = 0,
        endpoints: EndpointSockets | None = None,
    ) -> None:
        """``harness``: the config's section; its ``rollout_timeout_s`` bounds each rollout,
        ``max_concurrent_agents`` the agents running at once (waiting for a slot is not timed),
        ``infra_retries`` the retries of a failure before the agent started. ``endpoints``:
        the proxy's per-rollout sockets, for sandboxed agents without a network (each rollout
        gets one for its life, named in its ``ClientConfig.endpoint_socket``)."""
        self._endpoints = endpoints
        self._store = store
        self._registry = registry
        self._adapter = adapter
        self._tasks = tasks
        self._proxy_url = proxy_url
        self._model_name = model_name
        self._policy_version = policy_version
        self._timeout_s = harness.rollout_timeout_s
        self._next_group = next_group_index
        self._running: set[asyncio.Task[None]] = set()
        max_concurrent = harness.max_concurrent_agents
        self._slots = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self._retry = RetryPolicy(max_attempts=1 + harness.infra_retries)
        self._max_refused_fraction = harness.max_refused_fraction

    @property
    def running(self) -> int:
        return len(self._running)

    async def start_group(self, size: int) -> str:
        """Start ``size`` rollouts of the next task; returns the group id once they are durable."""
        group = f"g{self._next_group:06d}"
        task = next(self._tasks)
        self._next_group += 1
        await self._launch(group, [(f"{group}-r{j}", task) for j in range(size)], purpose="train")
        return group

    async def start_validation(
        self,
        group: str,
        tasks: Sequence[Task],
        *,
        temperature: float,
        max_tokens: int | None,
        purpose: str = "validation",
    ) -> list[str]:
        """Start one rollout per task, served with the evaluation sampling (``temperature``,
        ``max_tokens``, None: the agent's); returns their ids once they are durable. ``purpose``:
        "validation" (a round between steps) or "evaluation" (``lightning-appliance eval``);
        neither is ever trained on."""
        rollouts = [(f"{group}-t{j:03d}", task) for j, task in enumerate(tasks)]
        actives = await self._launch(
            group, rollouts, purpose=purpose, temperature=temperature, max_tokens=max_tokens
        )
        return [active.rollout for active in actives]

    async def _launch(
        self,
        group: str,
        rollouts: Sequence[tuple[str, Task]],
        *,
        purpose: str,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> list[ActiveRollout]:
        """Record ``RolloutCreated`` for each (rollout id, task), then register and run them.

        The registry's room is checked before anything is recorded, so a refused group leaves
        no rollout behind that would look like it is running."""
        self._registry.ensure_room(len(rollouts))
        version = self._policy_version()
        now = time.time()
        created = [
            RolloutCreated(
                ts=now,
                rollout=rollout,
                task_id=task.id,
                group=group,
                task=task.data,
                policy_version=version,
                adapter=self._adapter.name,
                purpose=purpose,
            )
            for rollout, task in rollouts
        ]
        await self._store.append(created)
        actives = []
        for event, (_, task) in zip(created, rollouts, strict=True):
            active = self._registry.register(event.rollout, task_id=task.id, group=group, task=task.data)
            active.temperature_override = temperature
            active.max_tokens_override = max_tokens
            actives.append(active)
            runner = asyncio.create_task(self._run(active, task), name=f"rollout {active.rollout}")
            self._running.add(runner)
            runner.add_done_callback(self._running.discard)
        return actives

    async def _run(self, active: ActiveRollout, task: Task) -> None:
        socket = None
        if self._endpoints is not None:
            try:
                socket = await self._endpoints.open(active.rollout)
            except OSError as exc:  # recorded like any failure before the agent started
                log.warning("rollout %s: no endpoint socket: %s", active.rollout, exc)
        try:
            await self._run_with(active, task, str(socket) if socket is not None else None)
        finally:
            if self._endpoints is not None:
                await self._endpoints.close(active.rollout)

    async def _run_with(self, active: ActiveRollout, task: Task, socket: str | None) -> None:
        rollout = active.rollout
        base = f"{self._proxy_url()}/rollouts/{rollout}"
        client = ClientConfig(
            rollout_id=rollout,
            base_url=base + "/v1",
            api_key=active.token,
            reward_url=base + "/reward",
            model=self._model_name,
            endpoint_socket=socket,
        )
        started = time.perf_counter()
        status, error = "finished", ""
        cancelled = False
        try:
            # A slot is taken before the timeout starts: waiting for one is not the agent's time.
            async with self._slots or contextlib.nullcontext():
                started = time.perf_counter()
                reward = await asyncio.wait_for(
                    run_with_retries(self._adapter, task, client, self._retry), self._timeout_s
                )
            if reward is not None:
                await self._store.append(
                    [RewardReported(ts=time.time(), rollout=rollout, reward=float(reward), source="adapter")]
                )
        except TimeoutError:
            status, error = "failed", f"timed out after {self._timeout_s:g} s (rollout_timeout_s)"
        except asyncio.CancelledError:
            status, error, cancelled = "failed", "cancelled: the appliance stopped", True
        except Exception as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"[-2000:]
            # An agent that gave up after its calls were refused: the refusal comes first.
            if active.refused and (verdict := calls_verdict(active, self._max_refused_fraction)):
                error = f"{verdict}\n{error}"
            _log_failure(rollout, error)
        finally:
            self._registry.unregister(rollout)
        if status == "finished" and (verdict := calls_verdict(active, self._max_refused_fraction)):
            status, error = "failed", verdict
            _log_failure(rollout, error)
        finished = RolloutFinished(
            ts=time.time(),
            rollout=rollout,
            status=status,
            error=error,
            duration_s=time.perf_counter() - started,
        )
        await self._store.append([finished])
        if cancelled:
            raise asyncio.CancelledError

    async def close(self) -> None:
        """Cancel every running rollout and wait until each has recorded its end."""
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def calls_verdict(active: ActiveRollout, max_refused_fraction: float) -> str:
    """Why a rollout whose agent ended must be failed for its model calls, as its reason's first
    line; "" when its calls are fine. Failed: a call broken off by an engine replica that was
    lost after it had sampled tokens of it (``ActiveRollout.lost``, its reason), every call
    refused (``refused`` of them and none recorded), more than ``max_refused_fraction`` of its
    calls refused, or no call at all. The fraction leaves out the answers a client retries (429,
    503: ``ActiveRollout.unavailable``), so a harness that waited out a busy appliance and went
    on is not failed for it."""
    recorded, refused = active.calls, active.refused
    if active.lost:
        return active.lost
    if refused and not recorded:
        return f"every model call was refused: {refused} of {refused} ({active.last_refusal})"
    wrong = refused - active.unavailable
    if wrong > max_refused_fraction * (recorded + wrong):
        return (
            f"{wrong} of {recorded + wrong} model calls were refused, more than max_refused_fraction "
            f"({max_refused_fraction:g}); last: {active.last_refusal}"
        )
    if not recorded + refused:
        return "made no model call: the agent ended without calling the model (nothing to train on)"
    return ""


def _log_failure(rollout: str, error: str) -> None:
    """One line per failed rollout (a traceback's first line and its end); the whole reason,
    traceback and all, is the log's ``RolloutFinished`` (the dashboard, ``status --failures``)
    and, with ``--verbose``, a debug record."""
    log.warning("rollout %s failed: %s", rollout, one_line(error))
    if "\n" in error.strip():
        log.debug("rollout %s failed:\n%s", rollout, error)


async def record_interrupted(store: EventStore, state: RunState) -> None:
    """On a start: record as failed every rollout a previous process left running (``state``
    is the log folded so far, and takes the new events too)."""
    interrupted = [
        RolloutFinished(
            ts=time.time(),
            rollout=view.rollout,
            status="failed",
            error="interrupted: the appliance stopped while the rollout was running",
        )
        for view in state.running()
    ]
    if interrupted:
        positions = await store.append(interrupted)
        for event, position in zip(interrupted, positions, strict=True):
            state.apply(event, position)
        log.info("recovered %d interrupted rollouts", len(interrupted))
