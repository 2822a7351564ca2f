"""A client for external runners: claim a rollout, run an agent on it, report, finish.

Owns the runner's side of the appliance's external-runner routes (``appliance.proxy.runners``),
for harnesses the appliance did not start: another machine, a cluster's job system, a notebook.
The appliance must run the ``external`` adapter. Each function is one HTTP request:

* ``claim(url, admin_token, task=None) -> Claim``: a rollout to run (``task``: queue this task
  ahead of the task set and get a rollout of its group);
* ``heartbeat(claim)``: a sign of life, so the claim's lease (``Claim.lease_s``) does not run
  out while the agent thinks without calling the model;
* ``report_reward(claim, reward)``, ``finish(claim, status, reason)``.

``run(url, admin_token, agent, rollouts=N)`` loops claim -> ``agent(task, claim)`` (heartbeats
in the background while it runs) -> its reward reported -> finish ("failed" with the
exception's text if it raised). The agent calls the model at ``claim.base_url`` with
``claim.api_key`` (any OpenAI or Anthropic client); it may be async or not (a plain function
runs in a thread, so the heartbeats go on). It returns the reward, or None when it reported one
itself. A claim answered 503 (nothing offered yet: the appliance is training, or its staleness
bound holds new groups back) is retried after its ``Retry-After`` for up to ``patience_s``.

From a shell::

    python -m harness_adapters.runner --url http://host:8640 --token "$(cat run/admin_token)" \\
        --agent my_pkg.agent:solve --rollouts 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

#: Characters of an agent's failure sent as the reason.
MAX_REASON = 1500
#: Seconds one request may take (a claim waits up to the appliance's runner_claim_wait_s).
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed rollout: what an agent needs to run it."""

    #: The appliance's URL the claim was made at.
    url: str
    rollout_id: str
    #: The rollout's OpenAI/Anthropic base URL (``<url>/rollouts/<id>/v1``).
    base_url: str
    #: The rollout's own API key (only valid for this rollout).
    api_key: str
    task: dict[str, Any]
    task_id: str
    #: The model name to send.
    model: str
    #: Seconds the rollout may go without a sign of life before the appliance fails it.
    lease_s: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one rollout ``run`` ran ended."""

    rollout_id: str
    status: str
    reward: float | None = None
    reason: str = ""


class RunnerError(Exception):
    """The appliance refused a request; ``status`` and ``code`` are its answer's."""

    def __init__(
        self, status: int, message: str, code: str | None = None, retry_after_s: float = 0.0
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s


Agent = Callable[[dict[str, Any], Claim], float | Awaitable[float | None] | None]


@contextlib.asynccontextmanager
async def _session(session: aiohttp.ClientSession | None) -> AsyncIterator[aiohttp.ClientSession]:
    if session is not None:
        yield session
        return
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as own:
        yield own


async def _post(
    session: aiohttp.ClientSession | None, url: str, token: str, body: dict[str, Any]
) -> dict[str, Any]:
    async with (
        _session(session) as client,
        client.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as response,
    ):
        text = await response.text()
        try:
            answer = json.loads(text) if text else {}
        except json.JSONDecodeError:
            answer = {}
        if response.status >= 400:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            message = error.get("message") if isinstance(error, dict) else None
            retry = response.headers.get("Retry-After", "")
            raise RunnerError(
                response.status,
                message or text[:500] or response.reason or "error",
                error.get("code") if isinstance(error, dict) else None,
                float(retry) if retry.replace(".", "", 1).isdigit() else 0.0,
            )
        result: dict[str, Any] = answer if isinstance(answer, dict) else {}
        return result


async def claim(
    url: str,
    admin_token: str,
    task: dict[str, Any] | None = None,
    *,
    session: aiohttp.ClientSession | None = None,
) -> Claim:
    """Claim a rollout (``task``: one of a new group on this task); ``RunnerError`` 503 when
    none was offered within the appliance's wait (retry after ``retry_after_s``)."""
    url = url.rstrip("/")
    answer = await _post(
        session, f"{url}/admin/rollouts", admin_token, {} if task is None else {"task": task}
    )
    return Claim(
        url=url,
        rollout_id=answer["rollout_id"],
        base_url=answer["base_url"],
        api_key=answer["api_key"],
        task=answer["task"],
        task_id=answer.get("task_id", ""),
        model=answer.get("model", ""),
        lease_s=float(answer.get("lease_s", 300.0)),
    )


def _rollout_url(claim: Claim, what: str) -> str:
    return f"{claim.url}/rollouts/{claim.rollout_id}/{what}"


async def heartbeat(claim: Claim, *, session: aiohttp.ClientSession | None = None) -> None:
    """A sign of life for the claim's lease."""
    await _post(session, _rollout_url(claim, "heartbeat"), claim.api_key, {})


async def report_reward(claim: Claim, reward: float, *, session: aiohttp.ClientSession | None = None) -> None:
    """The rollout's reward (the last one reported counts)."""
    await _post(session, _rollout_url(claim, "reward"), claim.api_key, {"reward": float(reward)})


async def finish(
    claim: Claim,
    status: str = "finished",
    reason: str | None = None,
    *,
    session: aiohttp.ClientSession | None = None,
) -> None:
    """End the rollout: "finished", or "failed" with ``reason``; returns once it is recorded."""
    body: dict[str, Any] = {"status": status}
    if reason is not None:
        body["reason"] = reason[-MAX_REASON:]
    await _post(session, _rollout_url(claim, "finish"), claim.api_key, body)


async def _heartbeats(claim: Claim, session: aiohttp.ClientSession) -> None:
    """A heartbeat every third of the lease until cancelled; a refused one ends them (the
    rollout ended: its lease ran out or the appliance stopped), a failed one is retried."""
    interval = max(claim.lease_s / 3, 0.05)
    while True:
        await asyncio.sleep(interval)
        try:
            await heartbeat(claim, session=session)
        except RunnerError as exc:
            log.warning("rollout %s: heartbeat refused, stopping them: %s", claim.rollout_id, exc)
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("rollout %s: heartbeat failed: %s", claim.rollout_id, exc)


async def _call_agent(agent: Agent, claim: Claim) -> float | None:
    if inspect.iscoroutinefunction(agent):
        result: Any = await agent(claim.task, claim)
    else:
        result = await asyncio.to_thread(agent, claim.task, claim)
        if inspect.isawaitable(result):
            result = await result
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, int | float):
        raise TypeError(f"the agent returned {result!r}; expected a number (the reward) or None")
    return float(result)


async def run_claimed(claim: Claim, agent: Agent, *, session: aiohttp.ClientSession) -> Outcome:
    """Run ``agent`` on a claimed rollout with heartbeats, report its reward, and finish it."""
    beats = asyncio.create_task(_heartbeats(claim, session), name=f"heartbeats {claim.rollout_id}")
    try:
        reward = await _call_agent(agent, claim)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("rollout %s: the agent failed: %s", claim.rollout_id, reason)
        await finish(claim, "failed", reason, session=session)
        return Outcome(claim.rollout_id, "failed", reason=reason)
    finally:
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beats
    if reward is not None:
        await report_reward(claim, reward, session=session)
    await finish(claim, "finished", session=session)
    return Outcome(claim.rollout_id, "finished", reward=reward)


async def claim_patiently(
    url: str,
    admin_token: str,
    *,
    task: dict[str, Any] | None = None,
    patience_s: float = 600.0,
    session: aiohttp.ClientSession | None = None,
) -> Claim:
    """``claim``, retrying 503 and 429 answers after their ``Retry-After`` for up to
    ``patience_s``."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return await claim(url, admin_token, task, session=session)
        except RunnerError as exc:
            left = deadline - time.monotonic()
            if exc.status not in (429, 503) or left <= 0:
                raise
            await asyncio.sleep(min(max(exc.retry_after_s, 0.5), left))


async def run(
    url: str, admin_token: str, agent: Agent, *, rollouts: int = 1, patience_s: float = 600.0
) -> list[Outcome]:
    """Claim and run ``rollouts`` rollouts one after another; their outcomes in order. A
    rollout the appliance ended first (its lease ran out) is reported as failed, and the
    loop goes on; a claim refused for another reason than waiting raises ``RunnerError``."""
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        for _ in range(rollouts):
            claimed = await claim_patiently(url, admin_token, patience_s=patience_s, session=session)
            try:
                outcome = await run_claimed(claimed, agent, session=session)
            except RunnerError as exc:
                if exc.status not in (404, 409):
                    raise
                outcome = Outcome(
                    claimed.rollout_id, "failed", reason=f"the appliance ended it: {exc.message}"
                )
            outcomes.append(outcome)
            log.info("rollout %s: %s", outcome.rollout_id, outcome.status)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    from contracts.errors import ConfigError
    from harness_adapters.loading import load_object

    parser = argparse.ArgumentParser(
        prog="python -m harness_adapters.runner",
        description="Claim rollouts from an appliance running the external adapter and run an agent on them.",
    )
    parser.add_argument("--url", required=True, help="the appliance's URL, e.g. http://host:8640")
    parser.add_argument(
        "--token",
        default=os.environ.get("APPLIANCE_ADMIN_TOKEN"),
        help="the admin token (default: $APPLIANCE_ADMIN_TOKEN; the run's data_dir/admin_token)",
    )
    parser.add_argument(
        "--agent", required=True, help="package.module:function called as agent(task, claim) -> reward"
    )
    parser.add_argument("--rollouts", type=int, default=1, help="rollouts to run, one after another")
    parser.add_argument(
        "--patience", type=float, default=600.0, help="seconds to keep retrying a claim nothing answers"
    )
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("--token (or APPLIANCE_ADMIN_TOKEN) is required")
    if args.rollouts < 1:
        parser.error("--rollouts must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        agent: Agent = load_object(args.agent, what="agent")
    except ConfigError as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return 2
    try:
        outcomes = asyncio.run(
            run(args.url, args.token, agent, rollouts=args.rollouts, patience_s=args.patience)
        )
    except (RunnerError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"runner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for outcome in outcomes:
        reward = "" if outcome.reward is None else f" reward={outcome.reward:g}"
        reason = f" ({outcome.reason})" if outcome.reason else ""
        print(f"{outcome.rollout_id} {outcome.status}{reward}{reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
