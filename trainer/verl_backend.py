"""The verl backend: policy updates on verl 0.9.1's FSDP engine, with the PolicyTrainer API.

Owns :class:`VerlFSDPTrainer`: verl's ``FSDPEngineWithLMHead`` (FSDP2) for the policy (and for a
reference model when there is a KL term), one step = one or more ``train_batch`` calls with
verl's ``ppo_loss``, offload/onload, checkpoints, the weights for the engine and the HF export.
It does not own building the engine and reading its tensors whole (``trainer.verl_engine``), the
batch layout or the loss function (``trainer.verl_batch``), its options (``trainer.options``)
and the losses they name (``trainer.losses``), the process-wide setup
(``trainer.verl_runtime``), nor anything the plain-torch backend (``trainer.policy``) owns for
itself.

One code path for CPU and GPU: on CPU the engine runs on gloo (a CPU platform registered with
verl, fp32); on CUDA on NCCL with FSDP2 mixed precision (bf16 compute, fp32 master weights and
gradient reduction). Both use ``sdpa`` attention on micro-batches cut by a token budget
(``max_tokens_per_microbatch``) whose sequences are packed into one row without padding
(``remove_padding``, the default: transformers builds the block-diagonal causal mask from the
position ids, so no flash-attn is needed; ``remove_padding=False`` pads them instead). One
instance is one rank: world size 1 in the appliance's process, or rank ``r`` of ``n`` in a
trainer worker process (``trainer.ranks``), where FSDP shards parameters, gradients and
optimizer state over the ranks.

A step: rows (sample, advantage, weight) -> mini-batches of whole rollouts (one by default),
planned once and dealt over the ranks (``trainer.step_plan``) -> on each rank, for each
mini-batch: [proximal and reference log-probs by ``infer_batch``, only when needed] ->
``train_batch`` (forward, ``ppo_loss``, backward per micro-batch; clip; AdamW step at a constant
learning rate, as in the torch backend). A
mini-batch whose advantages are all 0 runs forward only and takes no optimizer step (it has no
gradient, and Adam would apply stale momentum). A reference model is the policy with its LoRA
adapters disabled when training LoRA, else a second engine kept in host memory between uses.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.checkpoints import CheckpointError, CheckpointStore
from trainer.device_memory import release_cached
from trainer.items import StepOutput, TrainItem
from trainer.losses import actor_config
from trainer.options import OffPolicy, VerlOptions, keyword_options
from trainer.push_api import PushApi
from trainer.rank_rpc import PushWeights
from trainer.sharded import ShardedStore
from trainer.step_plan import LossTotals, RankResult, RankStep, Row, StepPlan, finish, plan_step, shard
from trainer.verl_batch import build_batch, response_values, step_loss
from trainer.verl_engine import adapter_tensors, build_engine, full_tensors, unique_state
from trainer.verl_lora import merge_lora_stream
from trainer.verl_runtime import ensure_runtime
from trainer.weight_group import GroupSpec, WeightGroup, group_buckets

if TYPE_CHECKING:
    from trainer.buckets import WeightBucket

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class VerlFSDPTrainer(PushApi):
    """The policy on verl's FSDP engine; same API as :class:`trainer.policy.PolicyTrainer`."""

    @keyword_options(VerlOptions)
    def __init__(self, model_dir: str | Path, options: VerlOptions) -> None:
        """``VerlFSDPTrainer(model_dir, **options)``: the keywords of :class:`VerlOptions`."""
        self.options = options
        self.model_dir = Path(model_dir)
        rank, world_size = options.rank, options.world_size
        self.device = ensure_runtime(
            options.device, rank=rank, world_size=world_size, init_method=options.init_method
        )
        self.rank, self.world_size = rank, world_size
        #: Tokens per micro-batch: ``options``' until changed (it may be, between steps).
        self.max_tokens_per_microbatch = options.max_tokens_per_microbatch
        lora_rank = self.lora_rank = options.lora_rank
        #: Rank 0's membership of the weight group (``host_weight_group``), if any.
        self._weight_group: WeightGroup | None = None
        self.lora_alpha = options.lora_alpha if options.lora_alpha is not None else 2 * lora_rank
        self.global_step = 0
        self._offloaded = False
        low, high = options.clip_ratios
        self._actor_cfg = actor_config(options.loss, clip_ratio_low=low, clip_ratio_high=high)
        engine_kw: dict[str, Any] = {
            "lr": options.lr,
            "weight_decay": options.weight_decay,
            # verl always clips; an infinite norm makes the clip a no-op that still reports it.
            "grad_clip": math.inf if options.grad_clip is None else options.grad_clip,
            "lora_rank": lora_rank,
            "lora_alpha": self.lora_alpha,
            "param_dtype": options.param_dtype or ("bf16" if self.device.type == "cuda" else "fp32"),
            "gradient_checkpointing": self.options.gradient_checkpointing,
            "remove_padding": self.options.remove_padding,
            "max_token_len": self.max_tokens_per_microbatch,
        }
        self.engine: Any = build_engine(self.model_dir, param_offload=False, **engine_kw)
        self._tied = bool(getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False))
        # The reference: LoRA's base model (adapters off) or a frozen copy that lives in host
        # memory between uses (verl's param_offload loads it around each forward).
        self._ref_engine: Any = None
        if self.options.kl_coef > 0 and lora_rank == 0:
            self._ref_engine = build_engine(self.model_dir, param_offload=True, **engine_kw)

    @property
    def off_policy(self) -> OffPolicy:
        """The off-policy correction the loss applies (``options.off_policy``)."""
        return self.options.off_policy

    # --- the step ------------------------------------------------------------------------------

    def step(self, items: Sequence[TrainItem]) -> StepOutput:
        """One policy update over ``items`` (``mini_batches`` optimizer steps; one by default).
        World size 1 only: the ranks of a larger world each run their share (``run_step``)."""
        if self.world_size != 1:
            raise RuntimeError("step() runs a whole step at world size 1; ranks run run_step()")
        start = time.perf_counter()
        plan = self.plan(items)
        result = self.run_step(shard(plan, 0, 1))
        return finish(plan, [result], time.perf_counter() - start)

    def plan(self, items: Sequence[TrainItem]) -> StepPlan:
        """The step over ``items`` as every rank must run it (``trainer.step_plan``)."""
        return plan_step(items, self.options, self.options.mini_batches)

    def run_step(self, work: RankStep) -> RankResult:
        """This rank's share of a step; every rank of the world runs its own at the same time."""
        self.onload()
        stats = LossTotals()
        grad_norms: list[float] = []
        updated = False
        batches = [
            (trains, self._batch(rows, inert) if rows else None)
            for rows, inert, trains in zip(work.rows, work.inert, work.trains, strict=True)
        ]
        # Everything that must see the weights before the first update is computed first.
        for _, batch in batches:
            if batch is not None:
                self._prepare(batch, precompute_old=work.precompute_old)
        for trains, batch in batches:
            if batch is None:
                continue
            loss_fn = self._loss_function(stats)
            if trains:
                with self.engine.train_mode():
                    self._no_dropout()
                    out = self.engine.train_batch(batch, loss_function=loss_fn)
                grad_norm = float(out["metrics"]["grad_norm"])
                grad_norms.append(grad_norm)
                updated = updated or math.isfinite(grad_norm)
            else:
                with self.engine.eval_mode():
                    self.engine.infer_batch(batch, loss_function=loss_fn)
                grad_norms.append(0.0)
        self.global_step += 1
        return RankResult(stats=stats, grad_norms=tuple(grad_norms), updated=updated, step=self.global_step)

    def _batch(self, rows: Sequence[Row], inert: int) -> TensorDict:
        """A mini-batch's rows as verl's batch (the last ``inert`` rows are padding)."""
        return build_batch(
            rows,
            temperature=self.options.temperature,
            max_token_len=self.max_tokens_per_microbatch,
            inert=inert,
            remove_padding=self.options.remove_padding,
        )

    def _prepare(self, batch: TensorDict, *, precompute_old: bool) -> None:
        """Add the proximal (``old_log_probs``) and reference (``ref_log_prob``) log-probs."""
        from verl.utils import tensordict_utils as tu

        if precompute_old:
            batch["old_log_probs"] = self._log_probs(self.engine, batch)
        if self.options.kl_coef > 0:
            if self._ref_engine is not None:
                batch["ref_log_prob"] = self._log_probs(self._ref_engine, batch)
            else:
                with self.engine.disable_adapter():
                    batch["ref_log_prob"] = self._log_probs(self.engine, batch)
        tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=True)

    def _log_probs(self, engine: Any, batch: TensorDict) -> torch.Tensor:
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(batch, calculate_entropy=False, compute_loss=False)
        with engine.eval_mode():
            out = engine.infer_batch(batch, loss_function=None)
        return response_values(out["model_output"]["log_probs"], batch)

    def _loss_function(self, stats: LossTotals) -> Any:
        return functools.partial(
            step_loss,
            self._actor_cfg,
            stats,
            dp_size=self.world_size,
            off_policy=self.options.off_policy,
            is_cap=self.options.is_cap,
            kl_coef=self.options.kl_coef,
            kl_type=self.options.kl_type,
        )

    def _no_dropout(self) -> None:
        # verl's train mode calls module.train(); on-policy data must give a ratio of exactly 1,
        # so dropout stays off (eval mode changes nothing else for these models). Except with
        # gradient checkpointing, which transformers only applies in train mode: the models
        # this appliance trains (Qwen2, SmolLM2) have no dropout anyway.
        if not self.options.gradient_checkpointing:
            self.engine.module.eval()

    # --- collocation -----------------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory (verl's ``engine.to``), then
        the GPU's cached blocks back to the driver (``release_cached``: verl empties the cache
        before it moves the optimizer state, and copies non-blocking). On CPU they are already
        there: the calls run and change nothing."""
        self.engine.to("cpu", model=True, optimizer=True, grad=True)
        release_cached(self.device)  # last: after the optimizer state has moved
        self._offloaded = True

    def onload(self) -> None:
        """Bring them back to the training device (``step`` calls it when needed)."""
        if self._offloaded:
            self.engine.to(self.device.type, model=True, optimizer=True, grad=True)
            self._offloaded = False

    # --- weights and checkpoints ---------------------------------------------------------------

    @contextlib.contextmanager
    def _resident(self) -> Iterator[None]:
        """On the training device for the duration (DCP's checkpoint gathers run there); an
        offloaded trainer is offloaded again afterwards."""
        was_offloaded = self._offloaded
        self.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()

    def _engine_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``full_tensors`` as the engine's model names them: LoRA merged into the base
        weights (one layer at a time), a tied LM head left out."""
        tensors = full_tensors(self.engine.module, self.world_size)
        if self.lora_rank > 0:
            tensors = merge_lora_stream(tensors, alpha=self.lora_alpha, rank=self.lora_rank)
        for name, tensor in tensors:
            if self._tied and name == "lm_head.weight":
                continue
            yield name, tensor

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Full CPU weights with the base model's HF names (LoRA merged in), detached copies;
        tied embeddings keep both keys and share one tensor, as ``PolicyTrainer`` gives them.
        Works offloaded, without moving the trainer back to the device. A collective at world
        size > 1 (every rank gets the whole state)."""
        state = {name: tensor.to("cpu", copy=True) for name, tensor in self._engine_tensors()}
        if self._tied and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def _adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return adapter_tensors(self.engine.module, self.world_size)

    def push(self, request: PushWeights) -> Iterator[WeightBucket]:
        """``weight_buckets`` on this rank (:class:`~trainer.push_api.PushApi`). A collective at
        world size > 1: every rank iterates it; only rank 0 yields buckets. Whole weights are
        written by each rank from its own shards (``trainer.shard_buckets``); adapters, and
        merged weights, are gathered for rank 0; over the weight group (``via_group``) from a
        buffer on the training device, gathered for rank 0."""
        from trainer.buckets import LoraAdapter, pack_buckets

        bucket_bytes, directory = request.bucket_bytes, Path(request.directory) if request.directory else None
        dtype = getattr(torch, request.dtype) if request.dtype else None
        adapters = self.lora_rank > 0 and not request.merged
        if request.via_group and not adapters:
            yield from self._group_buckets(bucket_bytes, dtype)
            return
        if self.world_size > 1 and self.lora_rank == 0:
            # Each rank writes its own rows of every parameter into the file: nothing gathered.
            from trainer.shard_buckets import sharded_buckets

            tensors = [
                (name, value)
                for name, value in unique_state(self.engine.module)
                if not (self._tied and name == "lm_head.weight")
            ]
            yield from sharded_buckets(tensors, bucket_bytes=bucket_bytes, directory=directory, dtype=dtype)
            return
        source = self._adapter_tensors() if adapters else self._engine_tensors()
        if self.rank != 0:  # gathered for rank 0 to pack
            for _ in source:
                pass
            return
        adapter = LoraAdapter(self.lora_rank, float(self.lora_alpha)) if adapters else None
        yield from pack_buckets(
            source, bucket_bytes=bucket_bytes, directory=directory, dtype=dtype, adapter=adapter
        )

    def host_weight_group(self, spec: GroupSpec) -> bool:
        """Rank 0: host the weight group ``spec`` describes and join it on the training device
        (blocks until every member has joined and the group is connected: ``WeightGroup``),
        replacing an earlier one; other ranks: nothing. Returns whether this rank joined."""
        if self.rank != 0:
            return False
        self.close()
        self._weight_group = WeightGroup(spec, self.device)
        return True

    def close(self) -> None:
        """Leave the weight group this rank hosts, if any (ended now, not left to the process
        group's destructor at exit). The trainer stays usable: a later ``host_weight_group``
        forms a new one."""
        group, self._weight_group = self._weight_group, None
        if group is not None:
            group.close()

    def _group_buckets(self, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[WeightBucket]:
        tensors = self._engine_tensors()
        if self.rank != 0:  # gathered for rank 0 to broadcast
            for _ in tensors:
                pass
            return
        if self._weight_group is None:
            raise RuntimeError("no weight group to push through: host_weight_group first")
        yield from group_buckets(
            tensors, group=self._weight_group, bucket_bytes=bucket_bytes, device=self.device, dtype=dtype
        )

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "backend": "verl",
            "lora_rank": self.lora_rank,
            "lr_scheduler": self.engine.lr_scheduler.state_dict(),
        }

    def _check_trainer_state(self, trainer_state: dict[str, Any], where: Path) -> None:
        if trainer_state.get("backend") != "verl" or trainer_state.get("lora_rank") != self.lora_rank:
            backend, rank = trainer_state.get("backend", "torch"), trainer_state.get("lora_rank", 0)
            raise CheckpointError(
                f"checkpoint {where} was written by backend {backend!r} with lora_rank "
                f"{rank}; this trainer is 'verl' with lora_rank {self.lora_rank} (the state layouts differ)"
            )

    def save(self, store: CheckpointStore | ShardedStore, version: int) -> Path:
        """Write model, optimizer (unless ``store`` keeps weights only), step and LR-scheduler
        state as ``version``; returns the path.

        A :class:`~trainer.sharded.ShardedStore` (what the appliance uses): every rank writes its
        own shards in parallel (torch.distributed.checkpoint), nothing is gathered; a weights
        store leaves the optimizer out and may cast to bf16. A ``CheckpointStore``: one file with
        the full state gathered on rank 0 (the module's names; DCP's full, name-keyed optimizer
        layout)."""
        if isinstance(store, ShardedStore):
            with self._resident():
                return store.save(
                    version,
                    self.engine.module,
                    self.engine.optimizer,
                    step=self.global_step,
                    trainer_state=self._trainer_state(),
                )
        with self._resident():
            model_state = get_model_state_dict(self.engine.module, options=_FULL)
            optim_state = get_optimizer_state_dict(self.engine.module, self.engine.optimizer, options=_FULL)
        if self.rank != 0:  # the gathers above leave the full state on rank 0 only
            return store.path(version)
        return store.save(
            version,
            self.global_step,
            cast(dict[str, Any], model_state),
            optim_state,
            trainer_state=self._trainer_state(),
        )

    def load(self, store: CheckpointStore | ShardedStore, version: int | None = None) -> int:
        """Restore model, optimizer and step from ``version`` (default: the latest); returns it.
        A sharded checkpoint loads whatever number of ranks wrote it (DCP reshards)."""
        if version is None:
            version = store.latest()
            if version is None:
                raise CheckpointError(f"no checkpoint in {store.directory}")
        if isinstance(store, ShardedStore):
            self._check_trainer_state(store.manifest(version).trainer_state, store.path(version))
            with self._resident():
                manifest = store.load(version, self.engine.module, self.engine.optimizer)
            self.engine.lr_scheduler.load_state_dict(manifest.trainer_state["lr_scheduler"])
            self.global_step = manifest.step
            return version
        payload = store.load(version)
        trainer_state = payload.get("trainer", {})
        self._check_trainer_state(trainer_state, store.path(version))
        options = StateDictOptions(full_state_dict=True)
        with self._resident():
            set_model_state_dict(self.engine.module, payload["model"], options=options)
            set_optimizer_state_dict(
                self.engine.module, self.engine.optimizer, payload["optimizer"], options=options
            )
        self.engine.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
        self.global_step = int(payload["step"])
        return version
