"""The composition root: one object that starts the appliance in dependency order.

Owns ``Appliance``: it locks the data directory (one appliance per directory, held until it
exits) and runs the preflight checks (``appliance.operations.preflight``) before anything loads,
so a start that cannot work fails in one line with nothing written; then it opens the store,
replays the log into the run's state, recovers what a crash left behind, loads the engine and
the trainer at the stored policy version (collocated on GPUs: the engine started, then asleep
while the trainer is built and restored, then the trainer offloaded and the engine woken, so
the two never hold their full memory at once), starts the proxy, the live projection, the
experiment trackers (``appliance.reporting.trackers``, when ``loggers`` names one), the rollout
controller and the scheduler, and on exit stops them in reverse order (every background loop
cancelled and awaited). Each part is built from its section of the config (``config.engine``,
``config.trainer``, ``config.scheduler``, ``config.proxy``, ``config.harness``) plus what only
the run knows (the model's name, the admin token, the placement plan, the held-out tasks); the
trainer and its service by ``appliance.training.setup``. Once every part has started, the
process's collector is set for serving (``appliance.operations.collector``: what exists then is
frozen, the youngest generation collected less often). Nothing else constructs these parts for
a real run, so tests that build an ``Appliance`` exercise the production wiring.

Recovery rules on start: rollouts that were running when the process died are recorded as
failed ("interrupted", ``appliance.rollouts.controller.record_interrupted``); finished rollouts
that no step consumed stay available for training;
the engine and trainer load the weights of the last ``PolicyVersionPublished`` (with the
optimizer state of the last full checkpoint, see ``appliance.training.service``).

A clean stop (``run`` returned: the step target, a signal, or an operator's "stop") saves a
full checkpoint (``CheckpointSaved`` "shutdown") and exports the policy as a Hugging Face model
directory (``ModelExported``, config ``export_dir``), unless nothing was ever trained. Its start
and stop are recorded with the command that made it ("up"; "eval" for an evaluation, which is
not the run's start nor its stop), the stop with its reason and whether the run failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType

from appliance.chat.formats import detect_format
from appliance.chat.tokenizer import Tokenizer
from appliance.config import ApplianceConfig, umask_bits
from appliance.engines.base import Engine
from appliance.engines.factory import create_fleet
from appliance.engines.remote import RemoteReplicas, pull_source, remote_replicas
from appliance.operations import preflight
from appliance.operations.collector import freeze_startup_objects
from appliance.operations.health import Health
from appliance.placement.plan import describe
from appliance.proxy import engines_admin, weights
from appliance.proxy.calls import CallService
from appliance.proxy.control import RUN_STATE
from appliance.proxy.gate import ServingGate
from appliance.proxy.http import ProxySettings
from appliance.proxy.runners import RUNNERS
from appliance.proxy.server import ProxyServer, build_app
from appliance.reporting.trackers import BACKENDS, Tracker, check_backends
from appliance.rollouts import sandboxing
from appliance.rollouts.controller import RolloutController, record_interrupted
from appliance.rollouts.evaluation import evaluate
from appliance.rollouts.external import RunnerBoard
from appliance.rollouts.external import attach as attach_runners
from appliance.rollouts.registry import RolloutRegistry
from appliance.rollouts.validation import training_tasks, validation_tasks
from appliance.scheduler.decide import SchedulePolicy
from appliance.scheduler.live import LiveState
from appliance.scheduler.runner import SchedulerRunner, Validation
from appliance.training.service import TrainingService
from appliance.training.setup import restore_training, start_training
from contracts.errors import StopForced
from harness_adapters.base import HarnessAdapter, Task
from store.events import (
    ApplianceStarted,
    ApplianceStopped,
    EvaluationCompleted,
    TrainStepCompleted,
)
from store.eventstore import EventStore
from store.projections import RunState

log = logging.getLogger(__name__)

StepCallback = Callable[[TrainStepCompleted, RunState], None]
#: Events read per page when a start folds the log into the run's state.
REPLAY_PAGE = 2000


def resolve_model(config: ApplianceConfig) -> tuple[str, Path]:
    """The model's display name and local directory: a registered model ("tiny",
    "smollm2-135m"), materialised once under ``config.models_dir``, or a local directory.
    Unknown names raise ``ConfigError`` listing the registered ones (no hub downloads)."""
    from appliance.engines.models import resolve

    resolved = resolve(config.model, config.models_dir, seed=config.seed, model_cache=config.model_cache_dir)
    return resolved.name, resolved.path


class Appliance:
    def __init__(
        self,
        config: ApplianceConfig,
        *,
        adapter: HarnessAdapter | None = None,
        on_step: StepCallback | None = None,
        on_notice: Callable[[str], None] | None = None,
        command: str = "up",
    ) -> None:
        """``command``: what its start and stop are recorded as, "up" (the run) or "eval"."""
        self.config = config.with_resolved_device()  # device "auto": cuda or cpu, from here on
        self._adapter = adapter
        self._on_step = on_step
        self._on_notice = on_notice
        self._stack = AsyncExitStack()
        self._command = command
        self._stop_reason = "stopped"
        self._stop_requested = False
        #: This process recorded its ``ApplianceStarted``: only then does it record a stop.
        self._recorded_start = False
        #: Why the stop was forced (None: it was not), and the task a forced stop cancels.
        self._forced: str | None = None
        self._task: asyncio.Task[object] | None = None
        self._force_timer: asyncio.TimerHandle | None = None
        self._stage = "start-up (loading the model and the store)"
        self._closing = False
        #: Collocated on GPUs: the trainer and the engine time-slice the same GPUs.
        self._trainer_shares_gpu = False
        self.runner: SchedulerRunner | None = None
        #: The experiment trackers (None: "console" alone, the progress lines of ``up``).
        self.tracker: Tracker | None = None

    # The parts, available after ``__aenter__``.
    store: EventStore
    engine: Engine
    proxy: ProxyServer
    live: LiveState
    controller: RolloutController
    registry: RolloutRegistry
    training: TrainingService
    #: The board external runners claim rollouts from (None: the appliance runs its own agents).
    runners: RunnerBoard | None
    #: The engine fleet's remote replicas (vLLM servers on other machines).
    replicas: RemoteReplicas
    model_name: str
    admin_token: str
    health: Health

    @property
    def proxy_url(self) -> str:
        return self.proxy.url

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names the policy answers to; harnesses are given the first."""
        return self.config.proxy.served_names(self.model_name)

    async def __aenter__(self) -> Appliance:
        self._task = asyncio.current_task()
        try:
            await self._start()
        except asyncio.CancelledError:
            await self._stack.aclose()
            if self._forced is None:
                raise
            self._uncancel()
            raise StopForced(f"stopped during start-up: {self._forced}") from None
        except BaseException:
            await self._stack.aclose()
            raise
        self._stage = "the scheduler"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._stop_reason = f"error: {type(exc).__name__}: {exc}"
        self._stage = "closing the proxy, the engine and the store"
        self._closing = True
        try:
            await self._stack.aclose()
        except asyncio.CancelledError:
            if self._forced is None:
                raise
            # Forced while closing (a second signal): the part being closed was cut short; the
            # ones after it (engine, ApplianceStopped, store) still closed.
            self._uncancel()

    async def _start(self) -> None:
        config = self.config
        # One appliance per data directory, then the checks that need nothing loaded: a start
        # that cannot work fails here in one line, before the model loads or the store is written.
        self._stack.enter_context(preflight.data_dir_lock(config.data_dir, umask_bits(config.data_umask)))
        plan = await asyncio.to_thread(preflight.check, config)
        self.isolation, self.config = await asyncio.to_thread(sandboxing.start, config)
        config = self.config
        check_backends(config.tracking.loggers)  # a tracker not installed: one line, nothing loaded
        if plan is not None:
            log.info("%s", "\n".join(describe(plan)))
        self.model_name, model_dir = await asyncio.to_thread(resolve_model, config)

        self.store = await EventStore.open(config.db_path)
        self._stack.push_async_callback(self.store.close)
        self._stack.push_async_callback(self._record_stop)
        state = RunState()  # the log folded a page at a time: a long log is never in memory whole
        while page := await self.store.read(state.position, limit=REPLAY_PAGE):
            for stored in page:
                state.apply(stored.event, stored.position)
        await record_interrupted(self.store, state)
        if any(name in BACKENDS for name in config.tracking.loggers):
            # Opened before the model loads (a backend that cannot start fails the start), closed
            # after the parts that record steps, before the store: its last rows are written then.
            self.tracker = Tracker(config, self.store)
            self._stack.push_async_callback(self.tracker.close)
            await self.tracker.start()
            log.info("%s", self.tracker.describe())

        tokenizer = Tokenizer.from_model_dir(model_dir)
        on_gpus = plan is not None and plan.device == "cuda"
        # On GPUs the plan says where each vLLM replica and each trainer rank goes, and how much
        # of each GPU vLLM takes.
        gpus = (plan.replicas, plan.gpu_memory_utilization) if on_gpus and plan else (None, None)
        self.engine = fleet = create_fleet(config, model_dir, *gpus)  # remote replicas may join it
        await self.engine.start()
        self._stack.push_async_callback(self.engine.close)
        # Collocated on GPUs, the trainer is built and restored while the engine sleeps, and
        # offloaded before it wakes: awake, vLLM holds its fraction of each GPU, and the trainer's
        # fp32 weights beside it would overcommit the GPU (the plan's start-up phases,
        # ``appliance.placement.planner``).
        collocated = on_gpus and plan is not None and plan.placement == "collocated"
        self._trainer_shares_gpu = collocated
        if collocated:
            await self.engine.sleep(config.scheduler.sleep_level)

        self.training, trainer_ranks = await start_training(
            config, model_dir, plan, store=self.store, engine=self.engine
        )
        training = self.training
        self._stack.push_async_callback(training.close)
        await restore_training(training, self.engine, state, collocated=collocated)

        proxy = config.proxy
        gate = ServingGate(hold_timeout_s=proxy.hold_timeout_s)
        self.admin_token = proxy.admin_token or _admin_token(config.data_dir / "admin_token")
        # The fleet forgets which replica served a rollout once it ends.
        self.registry = RolloutRegistry(
            tokenizer, detect_format(model_dir), max_rollouts=proxy.max_rollouts, on_unregister=fleet.release
        )
        calls = CallService(
            engine=self.engine,
            store=self.store,
            tokenizer=tokenizer,
            gate=gate,
            max_tokens_default=proxy.max_tokens,
        )
        settings = ProxySettings.from_config(proxy, model_name=self.model_name, admin_token=self.admin_token)
        self.health = Health()
        proxy_app = build_app(calls, self.registry, settings, self.health)
        proxy_app[RUN_STATE] = state  # the object the live projection keeps folding
        adapter = self._adapter or sandboxing.load_run_adapter(config, self.isolation)
        # The external adapter's rollouts wait on a board that runners claim them from over HTTP.
        self.runners = attach_runners(adapter, self.registry, config.harness, live=lambda: self.live)
        if self.runners is not None:
            proxy_app[RUNNERS] = self.runners
        publication, pull = pull_source(config, lambda: self.proxy.url, self.admin_token)
        weights.serve(proxy_app, publication)  # GET /admin/weights/...: what remote replicas pull
        self.replicas = remote_replicas(config, fleet, self.store, self.model_name, model_dir, pull)
        engines_admin.attach(proxy_app, self.replicas)  # GET, POST, DELETE /admin/engines
        self.proxy = ProxyServer(
            proxy_app, proxy.host, proxy.port, shutdown_timeout_s=min(2.0, config.stop_timeout_s / 4)
        )
        self._stack.push_async_callback(self.proxy.close)
        try:
            await self.proxy.start()
        except OSError as exc:  # the port was taken after preflight checked it
            raise preflight.bind_error(proxy.host, proxy.port, exc) from None
        if proxy.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the proxy listens on %s: any host that can reach it can call the model", proxy.host)
        self._stack.push_async_callback(self.replicas.close)
        await self.replicas.start(
            list(state.replicas.values()), config.engine.remote
        )  # their versions caught up

        await self.store.append(
            [
                ApplianceStarted(
                    ts=time.time(),
                    run_id=state.run_id or uuid.uuid4().hex,
                    model=self.model_name,
                    engine=config.engine.kind,
                    resumed_from_version=state.policy_version,
                    resumed_from_step=state.step,
                    config=config.to_json(),
                    trainer_ranks=trainer_ranks,
                    placement=plan.to_json() if plan is not None else {},
                    agents=self.isolation.line,
                    command=self._command,
                )
            ]
        )
        self._recorded_start = True
        self.live = LiveState(self.store, state, state.position)
        follower = asyncio.create_task(self.live.follow(), name="live projection")
        self._stack.push_async_callback(_cancel_and_wait, follower)
        await self.live.wait_for(self.store.last_position)
        if self.tracker is not None:  # the trackers follow the log (the steps replayed first)
            tracking = asyncio.create_task(self.tracker.follow(self.live), name="trackers")
            self._stack.push_async_callback(_cancel_and_wait, tracking)

        groups_so_far = len({view.group for view in state.rollouts.values() if view.purpose == "train"})
        held_out = validation_tasks(config)
        self.controller = RolloutController(
            store=self.store,
            registry=self.registry,
            adapter=adapter,
            tasks=(
                self.runners.tasks(training_tasks(config, groups_so_far))
                if self.runners is not None
                else training_tasks(config, groups_so_far)
            ),
            proxy_url=lambda: self.proxy.url,
            model_name=self.served_names[0],
            policy_version=lambda: self.engine.policy_version,
            harness=config.harness,
            next_group_index=groups_so_far,
            endpoints=self.proxy.sockets if self.isolation.endpoint_sockets else None,
        )
        self._stack.push_async_callback(self.controller.close)
        scheduler = config.scheduler
        self.runner = SchedulerRunner(
            policy=SchedulePolicy.from_config(scheduler, placement=config.placement, held_out=len(held_out)),
            live=self.live,
            controller=self.controller,
            training=training,
            gate=gate,
            engine=self.engine,
            sleep_level=scheduler.sleep_level,
            drop_stale=scheduler.stale_tokens == "drop",
            on_step=self._on_step,
            validation=Validation(
                tasks=held_out,
                temperature=scheduler.validation_temperature,
                max_tokens=scheduler.validation_max_tokens or proxy.max_tokens,
            ),
            health=self.health,
            drain_timeout_s=scheduler.drain_timeout_s,
            phase_timeout_s=scheduler.phase_timeout_s,
            on_notice=self._on_notice,
            breaker_backoff_s=scheduler.breaker_backoff_s,
            breaker_backoff_max_s=scheduler.breaker_backoff_max_s,
            trainer_shares_gpu=self._trainer_shares_gpu,
        )
        if self._stop_requested:
            self.runner.request_stop()
        freeze_startup_objects()

    async def evaluate(self, tasks: Sequence[Task], *, split: str, repeat: int = 1) -> EvaluationCompleted:
        """Run every task ``repeat`` times on the policy served now, with no training, and record
        the result (``appliance.rollouts.evaluation``); the scheduler is not started."""
        self._stop_reason = "evaluation ended"
        return await evaluate(
            controller=self.controller,
            live=self.live,
            store=self.store,
            config=self.config,
            tasks=tasks,
            split=split,
            repeat=repeat,
        )

    async def _record_stop(self) -> None:
        if not self._recorded_start:  # it failed to start: a stop of nothing is not an event
            return
        with contextlib.suppress(Exception):
            stopped = ApplianceStopped(
                ts=time.time(), reason=self._stop_reason, failed=self.failed, command=self._command
            )
            await self.store.append([stopped])

    def request_stop(self) -> None:
        """Ask the run to stop after what it is doing now (safe from a signal handler). The stop
        is bounded: if the run has not stopped ``stop_timeout_s`` later, it is forced."""
        first = not self._stop_requested
        self._stop_requested = True
        if self.runner is not None:
            self.runner.request_stop()
        if first:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to bound
                loop = asyncio.get_running_loop()
                timeout = self.config.stop_timeout_s
                self._force_timer = loop.call_later(
                    timeout, self.force_stop, f"it did not end within {timeout:g} s (stop_timeout_s)"
                )

    @property
    def stop_reason(self) -> str:
        """Why the run stopped (as ``ApplianceStopped`` records it)."""
        return self._stop_reason

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def failed(self) -> bool:
        """The run stopped on its own because it cannot go on (the circuit breaker gave up after
        ``breaker_max_trips`` trips in a row): ``up`` exits non-zero; a later start resumes."""
        return self.runner is not None and self.runner.failed

    @property
    def forced(self) -> str | None:
        """Why the stop was forced, or None."""
        return self._forced

    def force_stop(self, reason: str) -> None:
        """Stop now, whatever the run is doing (a second signal, or the stop's deadline): the
        task running the appliance is cancelled. A step under way is abandoned before its events
        (its groups stay ready and a restart trains them), rollouts are recorded as failed, and
        the store is closed, so the log is as consistent as after a clean stop."""
        if self._forced is not None:
            return
        self._forced = f"{reason}; was waiting for {self.activity()}"
        if self._closing:  # run() has returned: what is recorded is why the close was cut short
            self._stop_reason = f"stop forced: {self._forced}"
        self._stop_requested = True
        if self.runner is not None:
            self.runner.request_stop()
        if self._force_timer is not None:
            self._force_timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def activity(self) -> str:
        """What the appliance is busy with, for a person waiting on a stop."""
        if self._stage == "the scheduler" and self.runner is not None:
            return self.runner.activity()
        return self._stage

    def _uncancel(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            while task.cancelling():
                task.uncancel()

    async def run(self) -> str:
        """Run the scheduler until it stops, then save and export the policy; returns the reason.
        A forced stop (``force_stop``) returns at once, without the shutdown checkpoint."""
        assert self.runner is not None, "use 'async with Appliance(...)' first"
        self._task = asyncio.current_task()
        try:
            self._stop_reason = await self.runner.run()
            self._stage = "the shutdown checkpoint and the export"
            await self._save_final()
        except asyncio.CancelledError:
            if self._forced is None:
                raise
            self._uncancel()
            self._stop_reason = f"stop forced: {self._forced}"
        finally:
            if self._force_timer is not None:
                self._force_timer.cancel()
        return self._stop_reason

    async def _save_final(self) -> None:
        """The shutdown checkpoint and the Hugging Face export (nothing if nothing was trained)."""
        await self.live.wait_for(self.store.last_position)
        state = self.live.state
        if state.step == 0 and state.policy_version == 0:
            return
        if self._trainer_shares_gpu:  # the checkpoint brings the trainer's state back to the GPUs
            await self.engine.sleep(self.config.scheduler.sleep_level)
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
