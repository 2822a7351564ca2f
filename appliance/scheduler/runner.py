"""The scheduler's effects: observe the live state, ask ``decide``, carry out the actions.

Owns the loop that turns decisions into calls on the rollout controller, the serving gate, the
engine and the training service. What a step does to the machine (collocated, the switch: drain
-> engine sleep -> trainer onload -> train -> offload -> wake -> push -> open the gate; split, a
step beside the loop with generation paused for its push alone), each phase timed, bounded and
recorded, is ``switch.SwitchEffects``, which ``SchedulerRunner`` extends; what ``decide`` sees
is ``observe``. ``activity`` says what the runner waits for. The runner keeps no state of the
run: every observation is read from the live projection of the log, plus the few facts only
the effects know (the phase, since when it generates, a failed engine). Operator
control arrives the same way (``ControlRequested`` events folded into ``RunState``: paused, a
checkpoint or a stop requested), so a restart while paused stays paused. It also carries out
requested checkpoints (between steps) and validation rounds: it starts a round's rollouts with
the evaluation sampling and records ``ValidationCompleted`` when they have all ended. When
``decide`` trips the circuit breaker it records ``AdmissionsPaused`` with the back-off (doubled
per trip in a row, capped), and while the back-off runs ``/healthz`` names the cause and a
notice says so; both clear when it ends. The trip that would reach ``breaker_max_trips`` is no
pause: ``decide`` stops the run instead (``ApplianceStopped`` with the breaker's reason), and
``failed`` says so. A notice is one line for the person watching: the ``on_notice`` callback
when there is one (headless ``up`` prints it), else the log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.rollouts.controller import RolloutController
from appliance.rollouts.validation import round_result
from appliance.scheduler.decide import (
    FinishValidation,
    Observation,
    PauseAdmissions,
    RestartEngine,
    SaveCheckpoint,
    StartGroups,
    StartValidation,
    Stop,
    Train,
    decide,
)
from appliance.scheduler.observe import observe, open_validation
from appliance.scheduler.switch import SwitchEffects
from harness_adapters.base import Task
from store.events import AdmissionsPaused
from store.projections import one_line


@dataclass(frozen=True, slots=True)
class Validation:
    """What a validation round runs: the held-out tasks and the evaluation sampling."""

    tasks: Sequence[Task]
    temperature: float = 0.0
    #: Completion length of every call (None: what the agent asks, else what the context leaves).
    max_tokens: int | None = None

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "max_tokens": self.max_tokens}


@dataclass(eq=False, kw_only=True)
class SchedulerRunner(SwitchEffects):
    """The loop; besides what the switch works on (``SwitchEffects``' fields), the controller
    it starts rollouts on, the validation rounds and the circuit breaker's back-off."""

    controller: RolloutController
    validation: Validation = field(default_factory=lambda: Validation(tasks=()))
    #: The circuit breaker's back-off: the first, doubled per trip in a row up to the max.
    breaker_backoff_s: float = 10.0
    breaker_backoff_max_s: float = 300.0
    #: The run stopped because it cannot go on (``Stop.failure``: the breaker gave up).
    failed: bool = field(default=False, init=False)
    #: ``ts`` of the trip whose back-off ``/healthz`` reports now (None: none).
    _breaker_shown: float | None = field(default=None, init=False)

    def request_stop(self) -> None:
        self._stop.set()

    def observation(self) -> Observation:
        return observe(
            self.live.state,
            stopping=self._stop.is_set(),
            phase=self._phase,
            generating_for_s=time.monotonic() - self._generating_since,
            # An engine that lost weights only a bucketed push had gets them pushed again.
            engine_failed=self._engine_failed or bool(getattr(self.engine, "needs_weights", False)),
            admissions_paused=self._admissions_paused(),
            served_version=self._served_version,
        )

    async def _wait(self) -> None:
        """Until the state changes, a stop is requested, the minimum generation slice ends, the
        circuit breaker's back-off ends, or a split step ends."""
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.live.wait_change(self.live.position)),
            asyncio.ensure_future(self._stop.wait()),
        ]
        remaining = self.policy.min_generate_s - (time.monotonic() - self._generating_since)
        if self.policy.mode == "async" and remaining > 0:
            waits.append(asyncio.ensure_future(asyncio.sleep(remaining)))
        if self._step_task is not None:
            waits.append(asyncio.ensure_future(asyncio.wait({self._step_task})))
        if (trip := self.live.state.admissions_paused_at(time.time())) is not None:
            waits.append(asyncio.ensure_future(asyncio.sleep(trip.ts + trip.backoff_s - time.time())))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()

    async def run(self) -> str:
        """Run until ``decide`` says stop; returns the reason."""
        await self._phase_changed("generate")
        try:
            return await self._loop()
        finally:
            await self._abandon_step()

    async def _loop(self) -> str:
        while True:
            await self.live.wait_for(self.live.store.last_position)
            self._reap_step()
            actions = decide(self.policy, self.observation())
            if not actions:
                await self._wait()
                continue
            for action in actions:
                match action:
                    case Stop(reason=reason, failure=failure):
                        # The reason is the stop's (``ApplianceStopped``, ``up``'s last line).
                        self.failed = failure
                        await self._phase_changed("idle")
                        return reason
                    case StartGroups(count=count):
                        for _ in range(count):
                            await self.controller.start_group(self.policy.group_size)
                    case Train(groups=groups) if self.policy.mode == "split":
                        self._begin_split_step(groups)
                    case Train(groups=groups):
                        await self._switch(groups)
                    case RestartEngine():
                        await self._restart_engine()
                    case SaveCheckpoint(reason=reason):
                        await self._checkpoint(reason)
                    case StartValidation(tasks=count):
                        await self._start_validation(count)
                    case FinishValidation():
                        await self._finish_validation()
                    case PauseAdmissions(failures=failures):
                        await self._pause_admissions(failures)

    async def _pause_admissions(self, failures: int) -> None:
        """Trip the circuit breaker: record ``AdmissionsPaused`` with a back-off that doubles per
        trip in a row (no finished rollout between them), capped at ``breaker_backoff_max_s``."""
        state = self.live.state
        trips = state.breaker_trips + 1
        backoff = min(self.breaker_backoff_max_s, self.breaker_backoff_s * 2 ** min(trips - 1, 32))
        trip = AdmissionsPaused(
            ts=time.time(), failures=failures, backoff_s=backoff, cause=state.last_failure, trips=trips
        )
        await self._record(trip)
        await self.live.wait_for(self.live.store.last_position)  # the state knows the trip
        self._show_breaker(trip)

    def _show_breaker(self, trip: AdmissionsPaused) -> None:
        """Report a running back-off on ``/healthz`` and as a notice."""
        self._breaker_shown = trip.ts
        line = (
            f"admissions paused for {trip.backoff_s:g} s: {trip.failures} training rollouts failed "
            f"in a row; last: {one_line(trip.cause) or 'no reason recorded'}"
        )
        if trip.trips > 1:
            line += f" (trip {trip.trips} in a row)"
        self.health.set("breaker", line)
        self._notice(line)

    def _admissions_paused(self) -> bool:
        """Whether the breaker's back-off runs now; keeps ``/healthz`` and the notices in step
        (also for a back-off recorded before a restart, and once it is over)."""
        trip = self.live.state.admissions_paused_at(time.time())
        if trip is not None and self._breaker_shown != trip.ts:
            self._show_breaker(trip)
        elif trip is None and self._breaker_shown is not None:
            self._breaker_shown = None
            self.health.clear("breaker")
            self._notice("admissions resumed")
        return trip is not None

    async def _start_validation(self, count: int) -> None:
        """Start a round: one rollout per held-out task, with the evaluation sampling."""
        state = self.live.state
        rounds = len({view.group for view in state.rollouts.values() if view.purpose == "validation"})
        await self.controller.start_validation(
            f"v{rounds:04d}",
            self.validation.tasks[:count],
            temperature=self.validation.temperature,
            max_tokens=self.validation.max_tokens,
        )

    async def _finish_validation(self) -> None:
        """Record the open round, all of whose rollouts have ended (no step ran meanwhile)."""
        state = self.live.state
        views = open_validation(state)
        if not views:
            return
        # The sampling the proxy actually used (recorded on each call), else the configured one.
        sampling = next((c.sampling for v in views for c in v.calls), None) or self.validation.sampling()
        # A constraint (a grammar) belongs to one call's output format, not to the round's sampling.
        sampling = {key: value for key, value in sampling.items() if key != "constraint"}
        await self._record(
            round_result(views, step=state.step, policy_version=views[0].created_version, sampling=sampling)
        )

    def activity(self) -> str:
        """What the scheduler is doing now, for a person waiting on a stop."""
        what, since = self._activity
        if self._phase == "train":
            return f"{what} ({time.monotonic() - since:.0f} s so far)"
        validating = self.observation().validation_running
        if validating:
            return f"{validating} validation rollouts to end"
        return "the scheduler's current decision"
