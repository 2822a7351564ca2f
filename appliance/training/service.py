"""One training step of the running appliance: events in, new policy version out.

Owns the glue between the trainer package, the store and the engine. For a batch of finished
rollout groups it builds token-exact samples from the recorded call events and computes GRPO
advantages per group (``appliance.training.batch``), takes one policy-gradient step (in a worker
thread), writes the new version to disk, makes ``TrainStepCompleted`` + ``PolicyVersionPublished``
durable in one append, and only then pushes the weights into the engine. A batch with nothing
trainable (every rollout failed) is still consumed by a step, but publishes no new version. Also owns the full
checkpoints taken on request and at shutdown, restoring the trainer after a restart, and the
final Hugging Face export.

What goes to disk: every new version's weights (``checkpoints/weights/``, no optimizer moments),
because ``PolicyVersionPublished`` promises durable weights; every ``checkpoint_every`` steps a
full checkpoint instead (model + optimizer + trainer state, ``CheckpointSaved`` "periodic" in
the same append). A restart loads the last published version's weights with the optimizer state
of the last full checkpoint (``RunState.last_checkpoint``): the step count, the policy and the
rollouts consumed are exactly the log's; only the optimizer's moments may be up to
``checkpoint_every - 1`` steps old. Each published version is also kept as bf16 safetensors
(``checkpoints/published/``, single-file stores); once a version is published the files no
restart needs are pruned (:meth:`TrainingService._retain`).

Order matters for crash safety: files on disk -> events durable -> engine updated. A crash
before the append leaves the old version current (its files are still kept, and the files the
crashed step wrote are discarded on restart); a crash after it resumes from the new version.

The weights reach the engine in buckets (``push_bucket_bytes``, ``Trainer.weight_buckets`` ->
``Engine.load_weight_buckets``), each packed in a worker thread while the event loop runs on,
so neither side ever holds a second copy of the whole model. With trainer ranks
(``trainer.ranks``) a rank that dies fails what was asked of it with ``TrainerRankFailed``; the
service then restarts the ranks from the last published version (:meth:`recover`) before the
error goes on to the scheduler (a failed step is recorded and tried again; a push is retried
once here).

A step whose files or events could not be made durable (a full disk, a full event store) has
still moved the trainer's weights and optimizer. The service remembers it, and when the
scheduler tries the same groups again from the same version it writes that step's result rather
than taking the step a second time; anything else first brings the trainer back to the log's
version (:meth:`_rewind`), so the weights never hold a step the log does not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from appliance.engines.base import Engine, WeightGroupMember
from appliance.engines.process_memory import engine_memory, ranks_memory
from appliance.engines.vllm_process import free_port
from appliance.training.batch import reward_std, step_batch, step_rewards, token_figures
from contracts.errors import TrainingFailed
from store.events import (
    CheckpointSaved,
    Event,
    ModelExported,
    PolicyVersionPublished,
    TrainStepCompleted,
)
from store.eventstore import EventStore
from store.projections import RolloutView, RunState, reward_mean
from trainer.buckets import WeightBucket, stream_buckets
from trainer.checkpoints import CheckpointStore, PublishedWeights, WeightsStore
from trainer.device_memory import memory_metrics
from trainer.items import StepOutput, Trainer
from trainer.rank_rpc import TrainerRankFailed
from trainer.sharded import ShardedStore, ShardedWeightsStore
from trainer.weight_group import GroupSpec

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class _Taken(NamedTuple):
    """A step the trainer took: the groups it trained, the version it stepped from, its output."""

    groups: frozenset[str]
    version: int
    output: StepOutput


class TrainingService:
    def __init__(
        self,
        *,
        trainer: Trainer,
        checkpoints: CheckpointStore | ShardedStore,
        store: EventStore,
        engine: Engine,
        advantage: str = "grpo",
        checkpoint_every: int = 0,
        push_bucket_bytes: int = 256 << 20,
        keep_versions: int = 2,
        weights_dtype: torch.dtype | None = None,
        push_dtype: torch.dtype | None = None,
        weight_group: str | None = None,
        weight_group_timeout_s: float = 120.0,
    ) -> None:
        if push_bucket_bytes < 1:
            raise ValueError(f"push_bucket_bytes must be >= 1, got {push_bucket_bytes}")
        self.trainer = trainer
        self.push_bucket_bytes = push_bucket_bytes
        #: The dtype the weights travel in (None: the trainer's own, e.g. fp32 master weights).
        self.push_dtype = push_dtype
        #: The run state the trainer's ranks are restarted from (set by restore/train).
        self._published: RunState | None = None
        #: A step the trainer took that is not durable yet: set from ``trainer.step`` until its
        #: events are appended or the trainer is rewound.
        self._undurable: _Taken | None = None
        #: Push over a weight group on this backend ("nccl", "gloo"; None: through files), and
        #: whether the trainer's side of the current group stands (ranks restarted: it does not).
        self.weight_group = weight_group
        self.weight_group_timeout_s = weight_group_timeout_s
        self._group_formed = False
        self._groups = 0
        self.advantage = advantage
        self.checkpoints = checkpoints
        self.weights: WeightsStore | ShardedWeightsStore
        #: bf16 copies of the newest ``keep_versions`` published versions (single-file stores).
        self.published: PublishedWeights | None = None
        if isinstance(checkpoints, ShardedStore):
            # The ranks prune a sharded store as they save, before the step's events are
            # durable: two versions of each, so the one the log names outlives the save.
            checkpoints.keep = max(checkpoints.keep, 2)
            self.weights = ShardedWeightsStore(
                checkpoints.directory / "weights", checkpoints.keep, dtype=weights_dtype
            )
        else:
            self.published = PublishedWeights(checkpoints.directory / "published", keep=keep_versions)
            checkpoints.published = self.published
            # fp32 weights only for the version a restart resumes from (:meth:`_retain`).
            self.weights = WeightsStore(checkpoints.directory / "weights", keep=1, published=self.published)
        self.checkpoint_every = checkpoint_every
        self.store = store
        self.engine = engine

    @property
    def run_dir(self) -> Path:
        """The directory that the paths in events are relative to."""
        return self.checkpoints.directory.parent

    def _relative(self, path: Path) -> str:
        return str(path.relative_to(self.run_dir))

    async def restore(
        self, state: RunState, *, before_push: Callable[[], Awaitable[None]] | None = None
    ) -> int:
        """Load the trainer and the engine at the log's policy version; returns the step.

        The version's file is the one its ``PolicyVersionPublished`` names: a full checkpoint,
        or weights that take their optimizer state from the last full checkpoint at or before
        it. Files of versions the log never published are deleted first. ``before_push`` runs
        between loading the trainer and pushing to the engine (a collocated start hands the
        GPU from the trainer to the engine there).
        """
        version = state.policy_version
        stores: list[CheckpointStore | ShardedStore | PublishedWeights] = [self.checkpoints, self.weights]
        if self.published is not None:
            stores.append(self.published)
        for store in stores:
            if discarded := store.discard_after(version):
                log.info("discarded unpublished versions %s in %s", discarded, store.directory)
        await self._load_trainer(state)
        if before_push is not None:
            await before_push()
        await self.push(version)
        last = state.last_checkpoint
        self._retain(version, state.checkpoint, last.policy_version if last is not None else None)
        return state.step

    def _retain(self, version: int, checkpoint: str | None, last_full: int | None) -> None:
        """Once ``version`` is published (its file ``checkpoint``, the last full checkpoint at
        ``last_full``), keep what a restart loads and the newest published versions, delete the
        rest: the newest ``keep`` full checkpoints and always ``last_full`` (whose optimizer
        state a restart takes), the fp32 weights of ``version`` if that is what it names, and the
        newest ``keep_versions`` bf16 copies. Until the next call these stay ``needed``, so the
        next step's saves cannot prune them before its events are durable. Sharded stores (the
        ranks prune them as they save) are left alone."""
        if (
            self.published is None
            or not isinstance(self.checkpoints, CheckpointStore)
            or not isinstance(self.weights, WeightsStore)
        ):
            return
        in_weights = bool(checkpoint) and (self.run_dir / str(checkpoint)).parent == self.weights.directory
        self.checkpoints.needed = {last_full} if last_full is not None else set()
        self.weights.needed = {version} if in_weights else set()
        removed = [*self.checkpoints.prune(), *self.weights.prune(keep=0), *self.published.prune(version)]
        if removed:
            log.debug("pruned versions %s once version %d was published", removed, version)

    async def _load_trainer(self, state: RunState) -> None:
        """The trainer at ``state``'s published version (from ``model_dir`` at version 0)."""
        self._published = state
        self._undurable = None
        if not state.checkpoint:
            return
        version = state.policy_version
        # A run written before checkpoints were sharded names ``.pt`` files: read those as such.
        single_file = state.checkpoint.endswith(".pt")
        source: CheckpointStore | ShardedStore = (
            CheckpointStore(self.checkpoints.directory, self.checkpoints.keep)
            if single_file and isinstance(self.checkpoints, ShardedStore)
            else self.checkpoints
        )
        if (self.run_dir / state.checkpoint).parent == self.weights.directory:
            base = state.last_checkpoint
            optimizer_from = (
                self.run_dir / base.path if base is not None and base.policy_version <= version else None
            )
            if isinstance(self.weights, ShardedWeightsStore) and not single_file:
                if optimizer_from is not None and optimizer_from.suffix == ".pt":
                    log.warning("the optimizer state in %s is not sharded: it starts afresh", optimizer_from)
                    optimizer_from = None
                source = ShardedWeightsStore(
                    self.weights.directory,
                    self.weights.keep,
                    dtype=self.weights.dtype,
                    optimizer_from=optimizer_from,
                )
            else:
                source = WeightsStore(
                    self.weights.directory, self.weights.keep, optimizer_from=optimizer_from
                )
        await asyncio.to_thread(self.trainer.load, source, version)
        self.trainer.global_step = state.step

    async def recover(self, state: RunState) -> None:
        """Restart the trainer's ranks after a ``TrainerRankFailed`` and load ``state``'s
        published version into them (a trainer without ranks has nothing to restart)."""
        restart = getattr(self.trainer, "restart", None)
        if restart is None:
            return
        log.warning("restarting the trainer ranks at policy version %d", state.policy_version)
        self._group_formed = False  # rank 0 hosted it
        await asyncio.to_thread(restart)
        await self._load_trainer(state)

    async def _rewind(self, state: RunState) -> None:
        """Bring the trainer back to ``state``'s published version after a step of it never
        became durable: its ranks restarted, or its last version loaded again."""
        log.warning(
            "the trainer took a step that is not in the log: back to version %d", state.policy_version
        )
        if getattr(self.trainer, "restart", None) is not None:
            await self.recover(state)
        elif state.checkpoint:
            await self._load_trainer(state)
        else:
            raise TrainingFailed(
                "the trainer took a step that never became durable and cannot load the model's own"
                " weights again in this process; start the appliance again (it resumes at version 0"
                " with every rollout kept)"
            )

    async def _guarded(self, state: RunState | None, action: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``action``; if a trainer rank failed, restart the ranks (from ``state``, else the
        last version loaded or trained) before the error goes on."""
        try:
            return await action()
        except TrainerRankFailed:
            # Nothing restored or trained yet: the run is at version 0, the model's own weights.
            known = state if state is not None else (self._published or RunState())
            try:
                await self.recover(known)
            except Exception:
                log.exception("the trainer ranks could not be restarted; the next use tries again")
            raise

    async def onload(self) -> None:
        """The trainer back on its device (ranks restarted if one failed)."""
        onload = getattr(self.trainer, "onload", None)
        if onload is not None:
            await self._guarded(None, lambda: asyncio.to_thread(onload))

    async def offload(self) -> None:
        """The trainer to host memory (ranks restarted if one failed)."""
        offload = getattr(self.trainer, "offload", None)
        if offload is not None:
            await self._guarded(None, lambda: asyncio.to_thread(offload))

    async def close(self) -> None:
        """Stop the trainer's ranks, if it has any."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            await asyncio.to_thread(close)

    async def checkpoint(self, state: RunState, reason: str) -> CheckpointSaved:
        """Save a full checkpoint of the trainer as it stands (between steps) and record it.

        Nothing is written when the last full checkpoint already holds this step and version
        (e.g. a periodic one just before a shutdown): the event then names that file.
        """
        version = state.policy_version
        last = state.last_checkpoint
        if (
            last is not None
            and (last.step, last.policy_version) == (state.step, version)
            and (self.run_dir / last.path).exists()
        ):
            path = self.run_dir / last.path
        else:
            if self._undurable is not None:  # the checkpoint holds the log's version, not that step
                await self._rewind(state)
            self.trainer.global_step = state.step
            path = await self._guarded(
                state, lambda: asyncio.to_thread(self.trainer.save, self.checkpoints, version)
            )
        saved = CheckpointSaved(
            ts=time.time(), step=state.step, policy_version=version, path=self._relative(path), reason=reason
        )
        await self.store.append([saved])
        self._retain(version, state.checkpoint, version)
        return saved

    async def export(self, state: RunState, directory: Path) -> ModelExported:
        """Write the current policy as a Hugging Face model directory and record it."""
        if self._undurable is not None:
            await self._rewind(state)
        path = await self._guarded(state, lambda: asyncio.to_thread(self.trainer.export_hf, directory))
        exported = ModelExported(
            ts=time.time(), step=state.step, policy_version=state.policy_version, path=str(path.resolve())
        )
        await self.store.append([exported])
        return exported

    async def train(
        self, state: RunState, groups: Sequence[str], *, eta: int | None = None, drop_stale: bool = True
    ) -> TrainedStep:
        """One gradient step on ``groups``; durable (checkpoint, then events) when it returns.

        With ``eta``, tokens sampled more than ``eta`` versions before the policy being updated
        are counted, and dropped from the loss when ``drop_stale`` (otherwise they stay, and the
        trainer's off-policy correction weighs them: the clipped ratio to their stored sampling
        log-probs for the torch backend, truncated importance weights for verl).
        """
        started = time.perf_counter()
        wanted = set(groups)
        views: list[RolloutView] = [v for v in state.rollouts.values() if v.group in wanted]
        batch = step_batch(
            views,
            policy_version=state.policy_version,
            advantage=self.advantage,
            eta=eta,
            drop_stale=drop_stale,
        )
        items = batch.items
        step = state.step + 1
        metrics: dict[str, float] = {}
        events: list[Event] = []
        version: int | None = None
        if items:
            taken = self._undurable
            if taken is not None and (taken.groups, taken.version) == (
                frozenset(wanted),
                state.policy_version,
            ):
                output = taken.output  # taken already, not made durable: write it, do not take it again
            else:
                if taken is not None:
                    await self._rewind(state)
                output = await self._guarded(state, lambda: asyncio.to_thread(self.trainer.step, items))
                self._undurable = _Taken(frozenset(wanted), state.policy_version, output)
            metrics.update(output.metrics())
            version = state.policy_version + 1
            self.trainer.global_step = step
            periodic = self.checkpoint_every > 0 and step % self.checkpoint_every == 0
            target = self.checkpoints if periodic else self.weights
            path = await self._guarded(state, lambda: asyncio.to_thread(self.trainer.save, target, version))
            relative = self._relative(path)
            events.append(
                PolicyVersionPublished(ts=time.time(), policy_version=version, step=step, checkpoint=relative)
            )
            if periodic:
                events.append(
                    CheckpointSaved(
                        ts=time.time(), step=step, policy_version=version, path=relative, reason="periodic"
                    )
                )
        # The rule every view of a step's reward shares (rollouts without calls count too).
        step_reward = reward_mean(views)
        metrics["reward_mean"] = 0.0 if step_reward is None else step_reward
        metrics["rollouts_failed"] = float(sum(1 for v in views if v.status == "failed"))
        metrics["stale_tokens"] = float(batch.stale_tokens)
        metrics["stale_tokens_dropped"] = float(batch.dropped)
        metrics["staleness_mean"] = sum(batch.staleness) / len(batch.staleness) if batch.staleness else 0.0
        metrics["staleness_max"] = float(max(batch.staleness, default=0))
        metrics["reward_std"] = reward_std(views)
        metrics.update(token_figures(views, output.tokens if items else 0))
        metrics.update(memory_metrics())
        metrics.update(engine_memory(self.engine))
        metrics.update(ranks_memory(self.trainer))
        completed = TrainStepCompleted(
            ts=time.time(),
            step=step,
            rollouts=tuple(v.rollout for v in views),
            samples=sum(len(i.samples) for i in items),
            tokens=sum(len(s.tokens) for i in items for s in i.samples),
            zero_variance_groups=batch.zero_variance_groups,
            metrics=metrics,
            duration_s=time.perf_counter() - started,
            sampled=tuple(v.tokens_sampled for v in views),
            rewards=step_rewards(views),
        )
        # One append: the step and the version it produced become durable together.
        await self.store.append([completed, *events])
        self._undurable = None
        if version is not None:
            self._published = replace(state, step=step, policy_version=version, checkpoint=relative)
            last = state.last_checkpoint
            self._retain(version, relative, version if periodic else (last.policy_version if last else None))
        return TrainedStep(completed=completed, version=version)

    async def push(self, version: int) -> None:
        """Load the trainer's current weights into the engine as ``version``, bucket by bucket.
        A trainer rank that fails during the push: the ranks are restarted from the published
        version (which is ``version``) and the push is tried once more. A step that is not
        durable is undone first: the engine never serves weights the log does not name."""
        if self._undurable is not None:
            await self._rewind(self._published or RunState())
        try:
            await self.engine.load_weight_buckets(await self._buckets(), version)
        except TrainerRankFailed:
            if getattr(self.trainer, "restart", None) is None:
                raise
            log.warning("a trainer rank failed during the push of version %d; pushing again", version)
            await self.recover(self._published or RunState())
            await self.engine.load_weight_buckets(await self._buckets(), version)

    async def _buckets(self) -> AsyncIterator[WeightBucket]:
        """The trainer's buckets, each packed in a worker thread (the event loop runs on): over
        the weight group where there is one (formed first if need be), else through files."""
        if await self._in_group():
            hosted: Any = self.trainer
            buckets = hosted.weight_buckets(self.push_bucket_bytes, self.push_dtype, via_group=True)
            return stream_buckets(buckets)
        return stream_buckets(self.trainer.weight_buckets(self.push_bucket_bytes, self.push_dtype))

    async def _in_group(self) -> bool:
        """Whether the push can go over the weight group: asked for, both sides able, and the
        group standing (formed now if the trainer's ranks or the engine's server restarted). A
        group that cannot form leaves this push to the files (logged), the next one tries again."""
        engine, host = self.engine, getattr(self.trainer, "host_weight_group", None)
        if self.weight_group is None or host is None or not isinstance(engine, WeightGroupMember):
            return False
        if self._group_formed and engine.in_weight_group:
            return True
        self._groups += 1
        spec = GroupSpec(
            "127.0.0.1",
            free_port(),
            1 + engine.weight_group_members,
            self.weight_group,
            f"push-{self._groups}",
            timeout_s=self.weight_group_timeout_s,
        )
        self._group_formed = False
        results = await asyncio.gather(
            self._guarded(None, lambda: asyncio.to_thread(host, spec)),
            engine.join_weight_group(spec.as_dict()),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            log.warning("the weight group did not form (%r); this push goes through files", failures[0])
            return False
        self._group_formed = True
        log.info("weight group formed (%s, %d members)", self.weight_group, spec.world_size)
        return True

    async def step(
        self, state: RunState, groups: Sequence[str], *, eta: int | None = None
    ) -> TrainStepCompleted:
        """``train`` then ``push``: the whole step when nothing needs to happen in between."""
        trained = await self.train(state, groups, eta=eta)
        if trained.version is not None:
            await self.push(trained.version)
        return trained.completed


@dataclass(frozen=True, slots=True)
class TrainedStep:
    completed: TrainStepCompleted
    #: The policy version the step produced (None: nothing was trainable).
    version: int | None
