"""The composition root: one object that starts the appliance in dependency order.

Owns ``Appliance``: it opens the store, replays the log into the run's state, recovers what a
crash left behind, loads the engine and the trainer at the stored policy version, starts the
proxy, the live projection, the rollout controller and the scheduler, and on exit stops them in
reverse order (every background loop cancelled and awaited). Nothing else constructs these
parts for a real run, so tests that build an ``Appliance`` exercise the production wiring.

Recovery rules on start: rollouts that were running when the process died are recorded as
failed ("interrupted"); finished rollouts that no step consumed stay available for training;
the engine and trainer load the weights of the last ``PolicyVersionPublished`` (with the
optimizer state of the last full checkpoint, see ``appliance.training``).

A clean stop (``run`` returned: the step target, a signal, or an operator's "stop") saves a
full checkpoint (``CheckpointSaved`` "shutdown") and exports the policy as a Hugging Face model
directory (``ModelExported``, config ``export_dir``), unless nothing was ever trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType

from appliance.chat.formats import detect_format
from appliance.chat.tokenizer import Tokenizer
from appliance.config import ApplianceConfig
from appliance.controller import RolloutController
from appliance.engines.base import Engine
from appliance.engines.factory import create_engine
from appliance.proxy.calls import CallService, ServingGate
from appliance.proxy.control import RUN_STATE
from appliance.proxy.http import ProxySettings
from appliance.proxy.server import ProxyServer, build_app
from appliance.rollouts import RolloutRegistry
from appliance.scheduler.decide import SchedulePolicy
from appliance.scheduler.live import LiveState
from appliance.scheduler.runner import SchedulerRunner, Validation
from appliance.training import TrainingService
from appliance.validation import training_tasks, validation_tasks
from harness_adapters.base import HarnessAdapter
from harness_adapters.lifecycle import RetryPolicy
from harness_adapters.registry import load_adapter
from store.events import ApplianceStarted, ApplianceStopped, RolloutFinished, TrainStepCompleted
from store.eventstore import EventStore
from store.projections import RunState
from trainer.checkpoints import CheckpointStore
from trainer.factory import make_trainer

log = logging.getLogger(__name__)

StepCallback = Callable[[TrainStepCompleted, RunState], None]


def resolve_model(config: ApplianceConfig) -> tuple[str, Path]:
    """The model's display name and local directory: a registered model ("tiny",
    "smollm2-135m"), materialised once under ``config.models_dir``, or a local directory.
    Unknown names raise ``ConfigError`` listing the registered ones (no hub downloads)."""
    from appliance.engines.models import resolve

    resolved = resolve(config.model, config.models_dir, seed=config.seed)
    return resolved.name, resolved.path


class Appliance:
    def __init__(
        self,
        config: ApplianceConfig,
        *,
        adapter: HarnessAdapter | None = None,
        on_step: StepCallback | None = None,
    ) -> None:
        self.config = config
        self._adapter = adapter
        self._on_step = on_step
        self._stack = AsyncExitStack()
        self._stop_reason = "stopped"
        self._stop_requested = False
        self.runner: SchedulerRunner | None = None

    # The parts, available after ``__aenter__``.
    store: EventStore
    engine: Engine
    proxy: ProxyServer
    live: LiveState
    controller: RolloutController
    registry: RolloutRegistry
    training: TrainingService
    model_name: str
    admin_token: str

    @property
    def proxy_url(self) -> str:
        return self.proxy.url

    async def __aenter__(self) -> Appliance:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._stop_reason = f"error: {type(exc).__name__}: {exc}"
        await self._stack.aclose()

    async def _start(self) -> None:
        config = self.config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.model_name, model_dir = await asyncio.to_thread(resolve_model, config)

        self.store = await EventStore.open(config.db_path)
        self._stack.push_async_callback(self.store.close)
        self._stack.push_async_callback(self._record_stop)
        state = RunState.from_events(await self.store.read())
        await self._recover(state)

        tokenizer = Tokenizer.from_model_dir(model_dir)
        self.engine = create_engine(config, model_dir)
        await self.engine.start()
        self._stack.push_async_callback(self.engine.close)

        trainer = await asyncio.to_thread(
            make_trainer,
            "verl" if config.trainer == "verl" else "torch",
            model_dir,
            lr=config.lr,
            grad_clip=config.grad_clip,
            device=config.device,
            temperature=config.temperature or 1.0,
            loss=config.loss,
            normalization=config.normalization,
        )
        self.training = training = TrainingService(
            trainer=trainer,
            checkpoints=CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints),
            store=self.store,
            engine=self.engine,
            advantage=config.advantage,
            checkpoint_every=config.checkpoint_every,
        )
        if state.policy_version > 0:
            await training.restore(state)

        gate = ServingGate(hold_timeout_s=config.hold_timeout_s)
        self.admin_token = config.admin_token or _admin_token(config.data_dir / "admin_token")
        self.registry = RolloutRegistry(tokenizer, detect_format(model_dir), max_rollouts=config.max_rollouts)
        calls = CallService(
            engine=self.engine,
            store=self.store,
            tokenizer=tokenizer,
            gate=gate,
            max_tokens_default=config.max_tokens,
        )
        settings = ProxySettings(
            model_name=self.model_name,
            max_tokens_default=config.max_tokens,
            max_tokens_cap=config.max_tokens_cap,
            temperature_override=config.temperature,
            admin_token=self.admin_token,
            max_body_bytes=config.max_body_bytes,
            max_queued_calls=config.max_queued_calls,
        )
        proxy_app = build_app(calls, self.registry, settings)
        proxy_app[RUN_STATE] = state  # the object the live projection keeps folding
        self.proxy = ProxyServer(proxy_app, config.host, config.port)
        await self.proxy.start()
        self._stack.push_async_callback(self.proxy.close)
        if config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the proxy listens on %s: any host that can reach it can call the model", config.host)

        await self.store.append(
            [
                ApplianceStarted(
                    ts=time.time(),
                    run_id=state.run_id or uuid.uuid4().hex,
                    model=self.model_name,
                    engine=config.engine,
                    resumed_from_version=state.policy_version,
                    resumed_from_step=state.step,
                    config=config.to_json(),
                )
            ]
        )
        self.live = LiveState(self.store, state, state.position)
        follower = asyncio.create_task(self.live.follow(), name="live projection")
        self._stack.push_async_callback(_cancel_and_wait, follower)
        await self.live.wait_for(self.store.last_position)

        groups_so_far = len({view.group for view in state.rollouts.values() if view.purpose == "train"})
        held_out = validation_tasks(config)
        self.controller = RolloutController(
            store=self.store,
            registry=self.registry,
            adapter=self._adapter
            or load_adapter(
                config.adapter or {"adapter": "python", "agent": config.agent},
                workdir_root=config.data_dir / "rollouts",
            ),
            tasks=training_tasks(config, groups_so_far),
            proxy_url=lambda: self.proxy.url,
            model_name=self.model_name,
            policy_version=lambda: self.engine.policy_version,
            timeout_s=config.rollout_timeout_s,
            next_group_index=groups_so_far,
            max_concurrent=config.max_concurrent_agents,
            retry=RetryPolicy(max_attempts=1 + config.infra_retries),
        )
        self._stack.push_async_callback(self.controller.close)
        self.runner = SchedulerRunner(
            policy=SchedulePolicy(
                batch_groups=config.batch_groups,
                group_size=config.group_size,
                max_steps=config.max_steps,
                mode="async" if config.mode == "async" else "sync",
                eta=config.eta,
                max_inflight_rollouts=config.max_inflight_rollouts,
                min_generate_s=config.min_generate_s,
                validate_every=config.validate_every if held_out else 0,
                validation_tasks=max(1, len(held_out)),
            ),
            live=self.live,
            controller=self.controller,
            training=training,
            gate=gate,
            engine=self.engine,
            sleep_level=config.sleep_level,
            drop_stale=config.stale_tokens == "drop",
            on_step=self._on_step,
            validation=Validation(
                tasks=held_out,
                temperature=config.validation_temperature,
                max_tokens=config.validation_max_tokens or config.max_tokens,
            ),
        )
        if self._stop_requested:
            self.runner.request_stop()

    async def _recover(self, state: RunState) -> None:
        """Record as failed every rollout a previous process left running."""
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
            positions = await self.store.append(interrupted)
            for event, position in zip(interrupted, positions, strict=True):
                state.apply(event, position)
            log.info("recovered %d interrupted rollouts", len(interrupted))

    async def _record_stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.append([ApplianceStopped(ts=time.time(), reason=self._stop_reason)])

    def request_stop(self) -> None:
        """Ask the scheduler to stop after what it is doing now (safe from a signal handler)."""
        self._stop_requested = True
        if self.runner is not None:
            self.runner.request_stop()

    async def run(self) -> str:
        """Run the scheduler until it stops, then save and export the policy; returns the reason."""
        assert self.runner is not None, "use 'async with Appliance(...)' first"
        self._stop_reason = await self.runner.run()
        await self._save_final()
        return self._stop_reason

    async def _save_final(self) -> None:
        """The shutdown checkpoint and the Hugging Face export (nothing if nothing was trained)."""
        await self.live.wait_for(self.store.last_position)
        state = self.live.state
        if state.step == 0 and state.policy_version == 0:
            return
        await self.training.checkpoint(state, "shutdown")
        exported = await self.training.export(state, self.config.export_path)
        log.info("exported policy v%d to %s", exported.policy_version, exported.path)


def _admin_token(path: Path) -> str:
    """The run's admin token, created once (readable by its owner only) and kept across restarts."""
    if path.is_file():
        return path.read_text().strip()
    token = "la-admin-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
