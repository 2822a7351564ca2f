"""The scheduler's handovers of the machine between the engine and the trainer.

Owns :class:`SwitchEffects`, the part of ``SchedulerRunner`` that carries out a ``Train``
(``RestartEngine``, ``SaveCheckpoint``) on the gate, the engine and the training service.
Collocated, a step is a switch:

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
(``Appliance.force_stop``).

A failed step is recorded and tried again, up to ``MAX_TRAIN_FAILURES`` in a row; an engine that
failed to take the machine back is left to ``RestartEngine``. The runner's loop (``runner``)
decides when; this module only does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.engines.base import Engine
from appliance.operations.health import Health
from appliance.proxy.gate import ServingGate
from appliance.scheduler.decide import SchedulePolicy
from appliance.scheduler.live import LiveState
from appliance.training.service import TrainingService
from contracts.errors import EngineUnavailable, TrainingFailed, disk_full
from store.events import PhaseChanged, PhaseOverran, SwitchPhaseCompleted, TrainStepCompleted, TrainStepFailed
from store.projections import RunState
from trainer.rank_rpc import TrainerRankFailed

log = logging.getLogger(__name__)

#: Failed attempts at one training step, in a row, after which the run stops.
MAX_TRAIN_FAILURES = 3


@dataclass(eq=False, kw_only=True)
class SwitchEffects:
    """The switch and its kin, for ``SchedulerRunner``, which adds the loop that calls the
    methods below. Its fields are what the switch works on and how it is bounded; the
    underscored ones are the effects' own state (never passed in)."""

    policy: SchedulePolicy
    live: LiveState
    training: TrainingService
    gate: ServingGate
    engine: Engine
    #: Engine sleep level during a collocated step (1 offloads weights, 2 discards them).
    sleep_level: int = 1
    #: Sampled tokens older than the staleness bound are dropped from the loss (else reweighted).
    drop_stale: bool = True
    drain_timeout_s: float = 30.0
    phase_timeout_s: float = 1800.0
    #: The trainer and the engine time-slice the same GPUs (collocated on CUDA): whatever
    #: brings the trainer's state back to the GPU (a checkpoint between steps) happens while
    #: the engine sleeps, as a step does.
    trainer_shares_gpu: bool = False
    # -- who hears of it: ``/healthz``, each durable step (with the state it leaves), and a
    # person (one-line notices, the headless progress output) --
    health: Health = field(default_factory=Health)
    on_step: Callable[[TrainStepCompleted, RunState], None] | None = None
    on_notice: Callable[[str], None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _phase: str = field(default="generate", init=False)
    #: Split mode: the step running beside the loop (None: none), and the version served
    #: while it runs (its own is published before its push ends).
    _step_task: asyncio.Task[None] | None = field(default=None, init=False)
    _served_version: int | None = field(default=None, init=False)
    _generating_since: float = field(default_factory=time.monotonic, init=False)
    _engine_failed: bool = field(default=False, init=False)
    _train_failures: int = field(default=0, init=False)
    #: What the runner is doing and since when (monotonic), for ``activity``.
    _activity: tuple[str, float] = field(default_factory=lambda: ("starting", time.monotonic()), init=False)

    async def _record(self, *events: Any) -> None:
        await self.live.store.append(list(events))

    async def _phase_changed(self, phase: str) -> None:
        self._phase = phase
        await self._record(
            PhaseChanged(ts=time.time(), phase=phase, policy_version=self.live.state.policy_version)
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
        """One line for the person watching, once: the ``on_notice`` callback (headless ``up``
        prints it), else the log at WARNING."""
        if self.on_notice is not None:
            self.on_notice(line)
        else:
            log.warning("%s", line)

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
