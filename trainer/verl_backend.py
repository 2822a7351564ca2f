"""The verl backend: policy updates on verl 0.9.1's FSDP engine, with the PolicyTrainer API.

Owns :class:`VerlFSDPTrainer`: building verl's ``FSDPEngineWithLMHead`` (FSDP2) for the policy
(and for a reference model when there is a KL term), one step = one or more ``train_batch`` calls
with verl's ``ppo_loss``, offload/onload, checkpoints, the weights for the engine and the HF
export. It does not own the batch layout or the loss function (``trainer.verl_batch``), the
loss options (``trainer.losses``), the process-wide setup (``trainer.verl_runtime``), nor
anything the plain-torch backend (``trainer.policy``) owns for itself.

One code path for CPU and GPU: on CPU the engine runs on gloo with world size 1 (a CPU platform
registered with verl, fp32); on CUDA on NCCL with FSDP2 mixed precision (bf16 compute, fp32
master weights and gradient reduction). Both use ``sdpa`` attention on padded micro-batches
(``use_remove_padding=False``: no flash-attn needed).

A step: rows (sample, advantage, weight) -> mini-batches of whole rollouts (one by default) ->
for each: [proximal and reference log-probs by ``infer_batch``, only when needed] ->
``train_batch`` (forward, ``ppo_loss``, backward per micro-batch; clip; AdamW step at a constant
learning rate, as in the torch backend). A
mini-batch whose advantages are all 0 runs forward only and takes no optimizer step (it has no
gradient, and Adam would apply stale momentum). A reference model is the policy with its LoRA
adapters disabled when training LoRA, else a second engine kept in host memory between uses.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from trainer.checkpoints import CheckpointError, CheckpointStore, export_hf_model, full_state_to_hf
from trainer.items import (
    StepOutput,
    TrainItem,
    check_items,
    has_signal,
    reward_stats,
    trainable_tokens,
    truncate_items,
)
from trainer.losses import OFF_POLICY_MODES, LossMode, OffPolicy, actor_config, check_option
from trainer.normalization import Normalization, check_normalization, sample_weights
from trainer.samples import Overflow
from trainer.verl_batch import LossStats, Row, build_batch, response_values, step_loss
from trainer.verl_lora import merge_lora
from trainer.verl_runtime import ensure_runtime

log = logging.getLogger(__name__)
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """verl prints progress (memory, model size) and warns about engines it cannot import while
    an engine is built; that goes to the debug log instead of the appliance's output. (Both
    redirections are process-wide, so this wraps only engine construction, done once at start.)"""
    buffer = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer):
            warnings.simplefilter("ignore")
            yield
    finally:
        if buffer.getvalue():
            log.debug("verl: %s", buffer.getvalue().strip())


def _build_engine(model_dir: Path, *, lr: float, weight_decay: float, grad_clip: float, **kw: Any) -> Any:
    """One verl ``FSDPEngineWithLMHead``, initialized. ``kw``: lora_rank, lora_alpha,
    param_dtype, gradient_checkpointing, max_token_len, param_offload."""
    with _quiet():
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        model_config = HFModelConfig(
            path=str(model_dir),
            load_tokenizer=False,
            override_config={"attn_implementation": "sdpa"},
            use_remove_padding=False,
            enable_gradient_checkpointing=kw["gradient_checkpointing"],
            lora_rank=kw["lora_rank"],
            lora_alpha=kw["lora_alpha"],
            target_modules="all-linear",
        )
        dtype = kw["param_dtype"]
        engine_config = FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",  # master weights; compute dtype is the mixed-precision policy's
            mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=kw["max_token_len"],
            infer_max_token_len_per_gpu=kw["max_token_len"],
            param_offload=kw["param_offload"],
            optimizer_offload=kw["param_offload"],
        )
        optimizer_config = FSDPOptimizerConfig(
            lr=lr, weight_decay=weight_decay, clip_grad=grad_clip, total_training_steps=1
        )
        engine: Any = FSDPEngineWithLMHead(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=CheckpointConfig(),
        )
        engine.initialize()
    return engine


class VerlFSDPTrainer:
    """The policy on verl's FSDP engine; same API as :class:`trainer.policy.PolicyTrainer`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        clip_ratio: float = 0.2,
        clip_ratio_high: float | None = None,
        temperature: float = 1.0,
        max_tokens_per_microbatch: int = 4096,
        loss: LossMode = "ppo",
        off_policy: OffPolicy = "decoupled",
        is_cap: float = 2.0,
        normalization: Normalization = "rollout",
        kl_coef: float = 0.0,
        kl_type: str = "low_var_kl",
        lora_rank: int = 0,
        lora_alpha: int | None = None,
        mini_batches: int = 1,
        param_dtype: str | None = None,
        gradient_checkpointing: bool = False,
        max_sample_tokens: int | None = None,
        overflow: Overflow = "cut",
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        check_option(off_policy, OFF_POLICY_MODES, "off_policy")
        if is_cap < 1.0 or mini_batches < 1 or kl_coef < 0 or lora_rank < 0:
            raise ValueError("need is_cap >= 1, mini_batches >= 1, kl_coef >= 0 and lora_rank >= 0")
        self.model_dir = Path(model_dir)
        self.device = ensure_runtime(device)
        self.temperature = temperature
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.off_policy = off_policy
        self.is_cap = is_cap
        self.normalization = check_normalization(normalization)
        self.kl_coef, self.kl_type = kl_coef, kl_type
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else 2 * lora_rank
        self.mini_batches = mini_batches
        self.gradient_checkpointing = gradient_checkpointing
        self.max_sample_tokens, self.overflow = max_sample_tokens, overflow
        self.global_step = 0
        self._offloaded = False
        high = clip_ratio if clip_ratio_high is None else clip_ratio_high
        self._actor_cfg = actor_config(loss, clip_ratio_low=clip_ratio, clip_ratio_high=high)
        engine_kw: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            # verl always clips; an infinite norm makes the clip a no-op that still reports it.
            "grad_clip": math.inf if grad_clip is None else grad_clip,
            "lora_rank": lora_rank,
            "lora_alpha": self.lora_alpha,
            "param_dtype": param_dtype or ("bf16" if self.device.type == "cuda" else "fp32"),
            "gradient_checkpointing": gradient_checkpointing,
            "max_token_len": max_tokens_per_microbatch,
        }
        self.engine: Any = _build_engine(self.model_dir, param_offload=False, **engine_kw)
        self._tied = bool(getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False))
        # The reference: LoRA's base model (adapters off) or a frozen copy that lives in host
        # memory between uses (verl's param_offload loads it around each forward).
        self._ref_engine: Any = None
        if kl_coef > 0 and lora_rank == 0:
            self._ref_engine = _build_engine(self.model_dir, param_offload=True, **engine_kw)

    # --- the step ------------------------------------------------------------------------------

    def step(self, items: Sequence[TrainItem]) -> StepOutput:
        """One policy update over ``items`` (``mini_batches`` optimizer steps; one by default)."""
        start = time.perf_counter()
        check_items(items)
        self.onload()
        items = truncate_items(items, self.max_sample_tokens, self.overflow)
        stats = LossStats()
        grad_norms: list[float] = []
        updated = False
        chunks = [list(items[i :: self.mini_batches]) for i in range(self.mini_batches)]
        batches = [(chunk, self._batch(chunk)) for chunk in chunks if chunk]
        # Everything that must see the weights before the first update is computed first.
        for _, batch in batches:
            if batch is not None:
                self._prepare(batch, precompute_old=self.off_policy == "decoupled" and len(batches) > 1)
        for chunk, batch in batches:
            if batch is None:
                continue
            loss_fn = self._loss_function(stats)
            if has_signal(chunk):
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
        n = max(stats.tokens, 1)
        reward_mean, reward_std = reward_stats(items)
        return StepOutput(
            step=self.global_step,
            updated=updated,
            loss=stats.loss / max(len(grad_norms), 1),
            grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            pg_clipfrac=stats.clipfrac_sum / n,
            ppo_kl=stats.ppo_kl_sum / n,
            entropy=stats.entropy_sum / n,
            tokens=stats.tokens,
            samples=sum(len(it.samples) for it in items),
            rollouts=len(items),
            duration_s=time.perf_counter() - start,
            kl_ref=stats.kl_ref_sum / n,
            is_weight_mean=stats.is_weight_sum / n if stats.tokens else 1.0,
            is_capped_frac=stats.is_capped_sum / n,
            truncated_samples=sum(1 for it in items for s in it.samples if s.truncation is not None),
            reward_mean=reward_mean,
            reward_std=reward_std,
        )

    def _batch(self, items: Sequence[TrainItem]) -> TensorDict | None:
        """The mini-batch's rows as verl's batch (None when no sample has a trainable token)."""
        weights = sample_weights([it.samples for it in items], self.normalization)
        rows: list[Row] = [
            (sample, it.advantage, w)
            for it, row in zip(items, weights, strict=True)
            for sample, w in zip(it.samples, row, strict=True)
            if trainable_tokens(sample) > 0
        ]
        if not rows:
            return None
        return build_batch(rows, temperature=self.temperature, max_token_len=self.max_tokens_per_microbatch)

    def _prepare(self, batch: TensorDict, *, precompute_old: bool) -> None:
        """Add the proximal (``old_log_probs``) and reference (``ref_log_prob``) log-probs."""
        from verl.utils import tensordict_utils as tu

        if precompute_old:
            batch["old_log_probs"] = self._log_probs(self.engine, batch)
        if self.kl_coef > 0:
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

    def _loss_function(self, stats: LossStats) -> Any:
        return functools.partial(
            step_loss,
            self._actor_cfg,
            stats,
            off_policy=self.off_policy,
            is_cap=self.is_cap,
            kl_coef=self.kl_coef,
            kl_type=self.kl_type,
        )

    def _no_dropout(self) -> None:
        # verl's train mode calls module.train(); on-policy data must give a ratio of exactly 1,
        # so dropout stays off (eval mode changes nothing else for these models). Except with
        # gradient checkpointing, which transformers only applies in train mode: the models
        # this appliance trains (Qwen2, SmolLM2) have no dropout anyway.
        if not self.gradient_checkpointing:
            self.engine.module.eval()

    # --- collocation -----------------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory (verl's ``engine.to``).
        On CPU they are already there: the calls run and change nothing."""
        self.engine.to("cpu", model=True, optimizer=True, grad=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # verl copies non-blocking; host reads must wait for it
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

    def _local_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict as detached CPU copies, the module's own names, read where the
        parameters are (no onload: an offloaded trainer is read from host memory).

        World size 1: every FSDP2 parameter is a DTensor sharded over one rank, so its local
        shard is the whole tensor and no collective is needed. Tensors that share storage (tied
        embeddings) share one copy.
        """
        if torch.distributed.get_world_size() != 1:
            raise RuntimeError("state_dict_for_engine reads local shards: it needs world size 1")
        copies: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, value in self.engine.module.state_dict().items():
            local = value.to_local() if isinstance(value, DTensor) else value
            key = id(value)
            if key not in copies:
                copies[key] = local.detach().to("cpu", copy=True)
            out[name] = copies[key]
        return out

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """Full CPU weights with the base model's HF names (LoRA merged in), detached copies;
        tied embeddings keep both keys and share one tensor, as ``PolicyTrainer`` gives them.
        Works offloaded, without moving the trainer back to the device."""
        state = self._local_state()
        if self.lora_rank > 0:
            state = merge_lora(state, alpha=self.lora_alpha, rank=self.lora_rank)
        if self._tied and "lm_head.weight" in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def save(self, store: CheckpointStore, version: int) -> Path:
        """Write model, optimizer, step and LR-scheduler state as ``version``; returns the path.
        The model part has the module's names (the HF ones without LoRA, as ``PolicyTrainer``
        writes them); the optimizer part is DCP's full, name-keyed layout."""
        with self._resident():
            model_state = get_model_state_dict(self.engine.module, options=_FULL)
            optim_state = get_optimizer_state_dict(self.engine.module, self.engine.optimizer, options=_FULL)
        trainer_state = {
            "backend": "verl",
            "lora_rank": self.lora_rank,
            "lr_scheduler": self.engine.lr_scheduler.state_dict(),
        }
        return store.save(
            version,
            self.global_step,
            cast(dict[str, Any], model_state),
            optim_state,
            trainer_state=trainer_state,
        )

    def load(self, store: CheckpointStore, version: int | None = None) -> int:
        """Restore model, optimizer and step from ``version`` (default: the latest); returns it."""
        if version is None:
            version = store.latest()
            if version is None:
                raise CheckpointError(f"no checkpoint in {store.directory}")
        payload = store.load(version)
        trainer_state = payload.get("trainer", {})
        if trainer_state.get("backend") != "verl" or trainer_state.get("lora_rank") != self.lora_rank:
            backend, rank = trainer_state.get("backend", "torch"), trainer_state.get("lora_rank", 0)
            raise CheckpointError(
                f"checkpoint {store.path(version)} was written by backend {backend!r} with lora_rank "
                f"{rank}; this trainer is 'verl' with lora_rank {self.lora_rank} (the state layouts differ)"
            )
        options = StateDictOptions(full_state_dict=True)
        with self._resident():
            set_model_state_dict(self.engine.module, payload["model"], options=options)
            set_optimizer_state_dict(
                self.engine.module, self.engine.optimizer, payload["optimizer"], options=options
            )
        self.engine.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
        self.global_step = int(payload["step"])
        return version

    def export_hf(self, directory: Path) -> Path:
        """Write the current (merged) weights and ``model_dir``'s tokenizer files as an HF dir."""
        return export_hf_model(
            full_state_to_hf(self.model_dir, self.state_dict_for_engine()), self.model_dir, directory
        )
