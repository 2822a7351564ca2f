"""The scheduler's effects: observe the live state, ask ``decide``, carry out the actions.

Owns the loop that turns decisions into calls on the rollout controller, the serving gate, the
engine and the training service, and the switch between generating and training:

    drain (close the gate; in async mode preempt the generations under way) -> engine sleep ->
    trainer onload -> train (durable) -> trainer offload -> wake weights -> push -> wake KV cache
    -> open the gate

In split mode (placement ``split``: the engine's GPUs and the trainer's are apart) a step is no
switch: it runs in a task of its own beside the loop, which goes on admitting and serving,

    train (durable) -> drain (close the gate, preempt the generations under way) -> push -> open

so generation pauses for the push alone (the preempted calls continue under the new weights);
the engine never sleeps and the trainer never offloads.

Each phase is recorded as a ``SwitchPhaseCompleted`` event with its duration. Every wait is
bounded: the drain waits at most ``drain_timeout_s`` for the generations in flight, then
preempts them (they continue after the step) and records ``PhaseOverran``; any other phase
still running after ``phase_timeout_s`` is recorded as ``PhaseOverran`` and reported by
``/healthz`` (``Health``) until it ends, and a stop cancels it within the stop's own bound
(``Appliance.force_stop``). ``activity`` says what the runner waits for. The runner keeps
no state of the run: every observation is read from the live projection of the log, plus the
few facts only the effects know (the phase, since when it generates, a failed engine). Operator
control arrives the same way (``ControlRequested`` events folded into ``RunState``: paused, a
checkpoint or a stop requested), so a restart while paused stays paused. It also carries out
requested checkpoints (between steps) and validation rounds: it starts a round's rollouts with
the evaluation sampling and records ``ValidationCompleted`` when they have all ended. When
``decide`` trips the circuit breaker it records ``AdmissionsPaused`` with the back-off (doubled
per trip in a row, capped), and while the back-off runs ``/healthz`` names the cause and a
notice says so; both clear when it ends. The trip that reaches ``breaker_max_trips`` is recorded
too, but no back-off is shown: ``decide`` stops the run next, and ``failed`` says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.controller import RolloutController
from appliance.engines.base import Engine
from appliance.errors import EngineUnavailable, TrainingFailed, disk_full
from appliance.health import Health
from appliance.proxy.gate import ServingGate
from appliance.scheduler.decide import (
    FinishValidation,
    Observation,
    PauseAdmissions,
    RestartEngine,
    SaveCheckpoint,
    SchedulePolicy,
    StartGroups,
    StartValidation,
    Stop,
    Train,
    decide,
)
from appliance.scheduler.live import LiveState
from appliance.training import TrainingService
from appliance.validation import round_result
from harness_adapters.base import Task
from store.events import (
    AdmissionsPaused,
    PhaseChanged,
    PhaseOverran,
    SwitchPhaseCompleted,
    TrainStepCompleted,
    TrainStepFailed,
)
from store.projections import RolloutView, RunState, one_line
from trainer.rank_rpc import TrainerRankFailed

log = logging.getLogger(__name__)

#: Failed attempts at one training step, in a row, after which the run stops.
MAX_TRAIN_FAILURES = 3


def _groups(state: RunState) -> dict[str, list[RolloutView]]:
    """Training groups (validation rollouts left out), in admission order."""
    groups: dict[str, list[RolloutView]] = {}
    for view in state.rollouts.values():
        if view.purpose == "train":
            groups.setdefault(view.group, []).append(view)
    return groups


def open_validation(state: RunState) -> list[RolloutView]:
    """The rollouts of the validation round that no ``ValidationCompleted`` records yet."""
    recorded = {rollout for round_ in state.validations for rollout in round_.rollouts}
    return [
        view
        for view in state.rollouts.values()
        if view.purpose == "validation" and view.rollout not in recorded
    ]


def _dead(views: list[RolloutView]) -> bool:
    """A group that can never be trained: every rollout ended and none is trainable."""
    return all(v.status != "running" for v in views) and not any(
        RunState.trainable(v) or v.trained_step is not None for v in views
    )


def observe(
    state: RunState,
    *,
    stopping: bool,
    phase: str = "generate",
    generating_for_s: float = 0.0,
    engine_failed: bool = False,
    admissions_paused: bool = False,
    served_version: int | None = None,
) -> Observation:
    """What ``decide`` sees. A group none of whose rollouts can be trained on (all failed, e.g.
    interrupted by a restart) counts neither as ready nor as admitted: its failures stay
    recorded, and another group takes its place. ``served_version``: the version the engine
    serves when it is not yet the published one (a split step between its events and the end
    of its push), so that no group is admitted against weights that do not sample yet."""
    groups = _groups(state)
    running = [view for view in state.running() if view.purpose == "train"]
    validating = open_validation(state)
    ready = [
        group for group, views in state.ready_groups().items() if any(RunState.trainable(v) for v in views)
    ]
    # Ready groups ahead of the oldest running one, in admission order (dead groups skipped).
    ready_set = set(ready)
    in_order = 0
    for group, views in groups.items():
        if _dead(views) or any(v.trained_step is not None for v in views):
            continue
        if group not in ready_set:
            break
        in_order += 1
    return Observation(
        running_groups=len({view.group for view in running}),
        ready_groups=tuple(ready),
        step=state.step,
        stopping=stopping or state.stop_requested,
        policy_version=state.policy_version if served_version is None else served_version,
        admitted_groups=sum(1 for views in groups.values() if not _dead(views)),
        running_rollouts=len(running),
        phase=phase,
        generating_for_s=generating_for_s,
        engine_failed=engine_failed,
        ready_in_order=in_order,
        paused=state.paused,
        checkpoint_requested=state.checkpoint_requested,
        validation_open=len(validating),
        validation_running=sum(1 for view in validating if view.status == "running"),
        last_validation_step=state.validations[-1].step if state.validations else None,
        consecutive_failures=state.consecutive_failures,
        admissions_paused=admissions_paused,
        breaker_trips=state.breaker_trips,
        last_failure=one_line(state.last_failure),
    )


@dataclass(frozen=True, slots=True)
class Validation:
    """What a validation round runs: the held-out tasks and the evaluation sampling."""

    tasks: Sequence[Task]
    temperature: float = 0.0
    #: Completion length of every call (None: what the agent asks, else what the context leaves).
    max_tokens: int | None = None

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "max_tokens": self.max_tokens}


class SchedulerRunner:
    def __init__(
        self,
        *,
        policy: SchedulePolicy,
        live: LiveState,
        controller: RolloutController,
        training: TrainingService,
        gate: ServingGate,
        engine: Engine,
        sleep_level: int = 1,
        drop_stale: bool = True,
        on_step: Callable[[TrainStepCompleted, RunState], None] | None = None,
        validation: Validation | None = None,
        health: Health | None = None,
        drain_timeout_s: float = 30.0,
        phase_timeout_s: float = 1800.0,
        on_notice: Callable[[str], None] | None = None,
        breaker_backoff_s: float = 10.0,
        breaker_backoff_max_s: float = 300.0,
        trainer_shares_gpu: bool = False,
    ) -> None:
        self.policy = policy
        self.live = live
        self.controller = controller
        self.training = training
        self.gate = gate
        self.engine = engine
        self.sleep_level = sleep_level
        self.drop_stale = drop_stale
        self.on_step = on_step
        self.validation = validation or Validation(tasks=())
        self.health = health or Health()
        self.drain_timeout_s = drain_timeout_s
        self.phase_timeout_s = phase_timeout_s
        #: Called with a one-line message a person should see (headless progress output).
        self.on_notice = on_notice
        #: The trainer and the engine time-slice the same GPUs (collocated on CUDA): whatever
        #: brings the trainer's state back to the GPU (a checkpoint between steps) happens while
        #: the engine sleeps, as a step does.
        self.trainer_shares_gpu = trainer_shares_gpu
        self._stop = asyncio.Event()
        #: The run stopped because it cannot go on (``Stop.failure``: the breaker gave up).
        self.failed = False
        self._phase = "generate"
        #: Split mode: the step running beside the loop (None: none), and the version served
        #: while it runs (its own is published before its push ends).
        self._step_task: asyncio.Task[None] | None = None
        self._served_version: int | None = None
        self._generating_since = time.monotonic()
        self._engine_failed = False
        self._train_failures = 0
        #: The circuit breaker's back-off: the first, doubled per trip in a row up to the max.
        self.breaker_backoff_s = breaker_backoff_s
        self.breaker_backoff_max_s = breaker_backoff_max_s
        #: ``ts`` of the trip whose back-off ``/healthz`` reports now (None: none).
        self._breaker_shown: float | None = None
        #: What the runner is doing and since when (monotonic), for ``activity``.
        self._activity = ("starting", time.monotonic())

    def request_stop(self) -> None:
        self._stop.set()

    def observation(self) -> Observation:
        return observe(
            self.live.state,
            stopping=self._stop.is_set(),
            phase=self._phase,
            generating_for_s=time.monotonic() - self._generating_since,
            # An engine that lost weights only a bucketed push had gets them pushed again.
            # An engine that lost weights only a bucketed push had gets them pushed again.
            engine_failed=self._engine_failed or bool(getattr(self.engine, "needs_weights", False)),
            admissions_paused=self._admissions_paused(),
            served_version=self._served_version,
        )

    async def _record(self, *events: Any) -> None:
        await self.live.store.append(list(events))

    async def _phase_changed(self, phase: str) -> None:
        self._phase = phase
        await self._record(
            PhaseChanged(ts=time.time(), phase=phase, policy_version=self.live.state.policy_version)
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
                        self.failed = failure
                        if failure:
                            log.error("%s", reason)
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
        if not self._final_trip(trip):
            self._show_breaker(trip)

    def _final_trip(self, trip: AdmissionsPaused) -> bool:
        """The trip that reaches ``breaker_max_trips``: the run stops instead of backing off."""
        return 0 < self.policy.breaker_max_trips <= trip.trips

    def _show_breaker(self, trip: AdmissionsPaused) -> None:
        """Report a running back-off on ``/healthz`` and as a notice."""
        self._breaker_shown = trip.ts
        line = (
            f"admissions paused for {trip.backoff_s:g} s: {trip.failures} training rollouts failed "
            f"in a row; last: {one_line(trip.cause) or 'no reason recorded'}"
        )
        if trip.trips > 1:
            line += f" (trip {trip.trips} in a row)"
        log.warning("%s", line)
        self.health.set("breaker", line)
        self._notice(line)

    def _admissions_paused(self) -> bool:
        """Whether the breaker's back-off runs now; keeps ``/healthz`` and the notices in step
        (also for a back-off recorded before a restart, and once it is over)."""
        trip = self.live.state.admissions_paused_at(time.time())
        if trip is not None and self._breaker_shown != trip.ts and not self._final_trip(trip):
            self._show_breaker(trip)
        elif trip is None and self._breaker_shown is not None:
            self._breaker_shown = None
            self.health.clear("breaker")
            log.warning("admissions resumed")
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

    async def _timed(self, step: int, phase: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """Run one phase of a switch and record its duration. A phase still running at
        ``phase_timeout_s`` is recorded as ``PhaseOverran`` and makes ``/healthz`` report it
        until it ends; it is not interrupted (a stop still is, within its own bound)."""
        started = time.perf_counter()
        self._activity = (f"training step {step}: {phase}", time.monotonic())
        task = asyncio.ensure_future(work())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.phase_timeout_s)
            if not done:
                reason = (
                    f"the {phase} phase of step {step} has run for more than {self.phase_timeout_s:g} s "
                    f"(phase_timeout_s)"
                )
                log.warning("%s", reason)
                self.health.set("phase", reason)
                await self._record(
                    PhaseOverran(
                        ts=time.time(), phase=phase, step=step, deadline_s=self.phase_timeout_s, reason=reason
                    )
                )
                self._notice(reason)
            result = await task
        finally:
            if not task.done():
                task.cancel()
            self.health.clear("phase")
        await self._record(
            SwitchPhaseCompleted(
                ts=time.time(), step=step, phase=phase, duration_s=time.perf_counter() - started
            )
        )
        return result

    async def _drain(self, step: int) -> None:
        """Wait for the generations in flight, at most ``drain_timeout_s``; past it they are
        preempted (they continue after the step) and the step goes on."""
        started = time.perf_counter()
        self._activity = (
            f"training step {step}: drain ({self.gate.inflight} calls generating)",
            time.monotonic(),
        )
        result = await self.gate.drain(self.drain_timeout_s)
        if result.timed_out:
            reason = (
                f"the drain before step {step} passed its deadline ({self.drain_timeout_s:g} s, "
                f"drain_timeout_s): {result.preempted} generations preempted"
                + (f", {result.remaining} calls still in flight" if result.remaining else "")
                + "; the step goes on"
            )
            log.warning("%s", reason)
            await self._record(
                PhaseOverran(
                    ts=time.time(),
                    phase="drain",
                    step=step,
                    deadline_s=self.drain_timeout_s,
                    reason=reason,
                    preempted=result.preempted,
                )
            )
            self._notice(reason)
        await self._record(
            SwitchPhaseCompleted(
                ts=time.time(), step=step, phase="drain", duration_s=time.perf_counter() - started
            )
        )

    def _notice(self, line: str) -> None:
        if self.on_notice is not None:
            self.on_notice(line)

    def activity(self) -> str:
        """What the scheduler is doing now, for a person waiting on a stop."""
        what, since = self._activity
        if self._phase == "train":
            return f"{what} ({time.monotonic() - since:.0f} s so far)"
        validating = self.observation().validation_running
        if validating:
            return f"{validating} validation rollouts to end"
        return "the scheduler's current decision"

    def _begin_split_step(self, groups: tuple[str, ...]) -> None:
        """Split mode: start one step beside the loop; until its push has ended the phase is
        "train" (``decide`` then only admits). The engine keeps serving."""
        assert self._step_task is None, "decide never trains beside a step"
        self._phase = "train"
        self._served_version = self.live.state.policy_version
        self._step_task = asyncio.create_task(self._split_step(groups), name="training step")

    def _reap_step(self) -> None:
        """Forget a split step that has ended; its error (the run stops) goes on to ``run``."""
        task = self._step_task
        if task is not None and task.done():
            self._step_task = None
            task.result()

    async def _abandon_step(self) -> None:
        """The run ends (a stop waits for the step, so only an error or a forced stop gets
        here with one running): cancel a split step still under way, before its events."""
        task, self._step_task = self._step_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _split_step(self, groups: tuple[str, ...]) -> None:
        """One step on the training GPUs while the engine serves, then the push: the gate closes
        and preempts the generations under way (they continue under the new weights), the new
        version is pushed, the gate opens."""
        state = self.live.state
        step = state.step + 1
        try:
            try:
                trained = await self._timed(
                    step,
                    "train",
                    lambda: self.training.train(
                        state, groups, eta=self.policy.eta, drop_stale=self.drop_stale
                    ),
                )
                self._train_failures = 0
            except Exception as exc:  # nothing of the step is durable: its groups stay ready
                trained = None
                await self._train_failed(step, groups, exc)
            if trained is not None and trained.version is not None:
                await self._push_beside(step, trained.version)
            await self.live.wait_for(self.live.store.last_position)
            if self.on_step is not None and trained is not None:
                self.on_step(trained.completed, self.live.state)
        finally:
            # The last thing the task does: the loop reaps it before it decides again.
            self._phase, self._served_version = "generate", None

    async def _push_beside(self, step: int, version: int) -> None:
        """Split mode: pause generation for the push alone. A failed push leaves the engine
        to ``RestartEngine`` (which pushes the published version), as after a switch."""
        self.gate.close(preempt=True)
        try:
            await self._drain(step)
            await self._timed(step, "push", lambda: self.training.push(version))
            self._engine_failed = False
        except Exception:
            log.exception("the engine failed while taking the weights of step %d", step)
            self._engine_failed = True
        finally:
            self.gate.open()
            # Generation goes on (it never stopped but for the push): recorded so that the
            # timeline closes the push. ``_phase`` stays "train" until the step task ends.
            await self._record(
                PhaseChanged(ts=time.time(), phase="generate", policy_version=self.live.state.policy_version)
            )

    async def _switch(self, groups: tuple[str, ...]) -> None:
        """Hand the machine to the trainer for one step and back to the engine."""
        state = self.live.state
        step = state.step + 1
        eta = self.policy.eta if self.policy.mode == "async" else None
        self.gate.close(preempt=self.policy.mode == "async")
        await self._phase_changed("train")
        try:
            await self._drain(step)
            await self._timed(step, "sleep", lambda: self.engine.sleep(self.sleep_level))
            try:
                await self._timed(step, "onload", self.training.onload)
                trained = await self._timed(
                    step,
                    "train",
                    lambda: self.training.train(state, groups, eta=eta, drop_stale=self.drop_stale),
                )
                self._train_failures = 0
            except Exception as exc:  # nothing of the step is durable: its groups stay ready
                trained = None
                await self._train_failed(step, groups, exc)
            try:
                await self._timed(step, "offload", self.training.offload)
            except TrainerRankFailed:
                # The ranks were restarted from the published version; the step goes on.
                log.exception("a trainer rank failed while offloading after step %d", step)
            # Level 2 discarded the engine's weights: push the current ones even without a new step.
            version = trained.version if trained is not None else None
            if version is None and self.sleep_level == 2:
                version = self.live.state.policy_version
            await self._wake_and_push(step, version)
            await self.live.wait_for(self.live.store.last_position)
            if self.on_step is not None and trained is not None:
                self.on_step(trained.completed, self.live.state)
        finally:
            self._generating_since = time.monotonic()
            self.gate.open()
            await self._phase_changed("generate")

    async def _train_failed(self, step: int, groups: tuple[str, ...], exc: Exception) -> None:
        """Record a failed step; the next ``decide`` tries it again, up to MAX_TRAIN_FAILURES.
        A full disk is said in one line (and how much room is left), other failures with their
        traceback."""
        self._train_failures += 1
        error = f"{type(exc).__name__}: {exc}"
        full = disk_full(exc, self.training.run_dir)
        if full is not None:
            error = f"{error} ({full})"
            log.error("training step %d failed (attempt %d): %s", step, self._train_failures, error)
        else:
            log.error("training step %d failed (attempt %d)", step, self._train_failures, exc_info=exc)
        await self._record(
            TrainStepFailed(
                ts=time.time(), step=step, groups=groups, error=error, attempt=self._train_failures
            )
        )
        if self._train_failures >= MAX_TRAIN_FAILURES:
            what = "free space on that disk" if full is not None else "fix the trainer"
            raise TrainingFailed(
                f"training step {step} failed {self._train_failures} times in a row ({error});"
                f" the run stopped, its rollouts are kept: {what} and start it again"
            ) from exc

    async def _checkpoint(self, reason: str) -> None:
        """A full checkpoint between steps. An offloaded trainer writes it from its training
        device (its state comes back for the write), so where it shares the engine's GPUs the
        engine first sleeps (generations drained, as before a step) and wakes after it: the two
        never hold their full memory at once."""
        state = self.live.state
        if not self.trainer_shares_gpu:
            await self.training.checkpoint(state, reason)
            return
        self.gate.close(preempt=False)
        try:
            await self.gate.drain(self.drain_timeout_s)
            await self.engine.sleep(self.sleep_level)
            try:
                await self.training.checkpoint(state, reason)
            finally:
                await self._wake_after_checkpoint(state.policy_version)
        finally:
            self._generating_since = time.monotonic()
            self.gate.open()

    async def _wake_after_checkpoint(self, version: int) -> None:
        """The engine back after a checkpoint (the weights again after sleep level 2); a failure
        leaves it to ``RestartEngine``, as after a step."""
        try:
            await self.engine.wake(["weights"])
            if self.sleep_level == 2:
                await self.training.push(version)
            await self.engine.wake(["kv_cache"])
        except TrainingFailed:
            raise
        except Exception:
            log.exception("the engine failed while taking back the machine after a checkpoint")
            self._engine_failed = True

    async def _wake_and_push(self, step: int, version: int | None) -> None:
        try:
            await self._timed(step, "wake_weights", lambda: self.engine.wake(["weights"]))
            if version is not None:
                await self._timed(step, "push", lambda: self.training.push(version))
            await self._timed(step, "wake_kv_cache", lambda: self.engine.wake(["kv_cache"]))
            self._engine_failed = False
        except TrainingFailed:
            raise  # the trainer cannot go back to the log's weights: nothing to serve from
        except Exception:
            # The step is durable; the weights reach the engine when it is restarted.
            log.exception("the engine failed while taking back the machine after step %d", step)
            self._engine_failed = True

    async def _restart_engine(self) -> None:
        """Bring a failed engine back with the current weights; a second failure stops the run."""
        try:
            await self.engine.wake(["weights", "kv_cache"])
            await self.training.push(self.live.state.policy_version)
        except Exception as exc:
            log.exception("the engine could not be restarted")
            self._stop.set()
            raise EngineUnavailable(f"the engine failed and could not be restarted: {exc}") from exc
        self._engine_failed = False
