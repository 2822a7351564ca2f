"""The scheduler's effects: observe the live state, ask ``decide``, carry out the actions.

Owns the loop that turns decisions into calls on the rollout controller, the serving gate and
the training service, and the phase events that make the timeline visible. It holds no state of
its own beyond a stop flag: every observation is read from the live projection of the log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from appliance.controller import RolloutController
from appliance.proxy.calls import ServingGate
from appliance.scheduler.decide import Observation, SchedulePolicy, StartGroups, Stop, Train, decide
from appliance.scheduler.live import LiveState
from appliance.training import TrainingService
from store.events import PhaseChanged, TrainStepCompleted
from store.projections import RunState


def observe(state: RunState, *, stopping: bool) -> Observation:
    """What ``decide`` sees. A group none of whose rollouts can be trained on (all failed, e.g.
    interrupted by a restart) never counts towards a batch: its failures stay recorded."""
    running_groups = {view.group for view in state.running()}
    ready = [
        group for group, views in state.ready_groups().items() if any(RunState.trainable(v) for v in views)
    ]
    return Observation(
        running_groups=len(running_groups),
        ready_groups=tuple(ready),
        step=state.step,
        stopping=stopping,
    )


class SchedulerRunner:
    def __init__(
        self,
        *,
        policy: SchedulePolicy,
        live: LiveState,
        controller: RolloutController,
        training: TrainingService,
        gate: ServingGate,
        on_step: Callable[[TrainStepCompleted, RunState], None] | None = None,
    ) -> None:
        self.policy = policy
        self.live = live
        self.controller = controller
        self.training = training
        self.gate = gate
        self.on_step = on_step
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def _phase(self, phase: str) -> None:
        event = PhaseChanged(ts=time.time(), phase=phase, policy_version=self.live.state.policy_version)
        await self.live.store.append([event])

    async def _wait(self) -> None:
        """Until the state changes or a stop is requested."""
        change = asyncio.ensure_future(self.live.wait_change(self.live.position))
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([change, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            stop.cancel()

    async def run(self) -> str:
        """Run until ``decide`` says stop; returns the reason."""
        await self._phase("generate")
        while True:
            await self.live.wait_for(self.live.store.last_position)
            actions = decide(self.policy, observe(self.live.state, stopping=self._stop.is_set()))
            if not actions:
                await self._wait()
                continue
            for action in actions:
                match action:
                    case Stop(reason=reason):
                        await self._phase("idle")
                        return reason
                    case StartGroups(count=count):
                        for _ in range(count):
                            await self.controller.start_group(self.policy.group_size)
                    case Train(groups=groups):
                        await self._train(groups)

    async def _train(self, groups: tuple[str, ...]) -> None:
        self.gate.close()
        try:
            await self.gate.drained()
            await self._phase("train")
            step = await self.training.step(self.live.state, groups)
            await self.live.wait_for(self.live.store.last_position)
            if self.on_step is not None:
                self.on_step(step, self.live.state)
        finally:
            self.gate.open()
        await self._phase("generate")
