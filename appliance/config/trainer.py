"""The ``[trainer]`` section: the training backend, its optimisation, the weight push and the
checkpoints, with the backend-dependent defaults (ranks, compute dtype) and
``trainer.factory.make_trainer``'s keyword arguments (``TrainerConfig.options``). It does not
own training; only ``resolved_ranks`` on cuda imports torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config.checks import at_least, one_of
from contracts.errors import ConfigError

#: The training backends ``trainer`` may name.
TRAINERS = ("torch", "verl")
#: Settings only the verl backend has (``trainer.factory.VERL_ONLY_OPTIONS``), in flag order.
VERL_ONLY = (
    "lora_rank",
    "lora_alpha",
    "gradient_checkpointing",
    "remove_padding",
    "param_dtype",
    "kl_coef",
    "kl_type",
    "mini_batches",
)
#: What ``param_dtype`` may name.
PARAM_DTYPES = ("bf16", "fp16", "fp32")
#: The torch name of each of them (what vLLM's ``--dtype`` takes).
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: What ``push_transport`` may name.
PUSH_TRANSPORTS = ("auto", "files", "group")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    """The training backend, its optimisation and its checkpoints (``options`` are
    ``trainer.factory.make_trainer``'s keyword arguments)."""

    #: Training backend ("trainer" in TOML, flags and environment): "torch" (plain torch +
    #: transformers) or "verl" (verl's FSDP engine).
    backend: str = "torch"
    #: Training worker processes, one per GPU (on CPU, processes over gloo); more than one needs
    #: trainer = "verl". None: every GPU torch sees when device = "cuda" and trainer = "verl",
    #: otherwise 1 (see ``resolved_ranks``).
    trainer_ranks: int | None = None
    #: Learning rate of the policy optimizer (1e-5 suits full fine-tuning of small instruct models).
    lr: float = 1e-5
    #: Gradient-norm clip.
    grad_clip: float = 1.0
    #: Credit assignment across the rollouts of a group: "grpo", "rloo" or "reinforce".
    advantage: str = "grpo"
    #: Loss normalization: "rollout" (each rollout weighs the same), "sample" or "token".
    normalization: str = "rollout"
    #: Policy loss: "ppo" (clipped), "gspo" or "cispo".
    loss: str = "ppo"
    #: Off-policy correction of sampled tokens (``trainer.losses``): "decoupled" (the loss's
    #: ratio against the weights being trained, each token weighted by the truncated importance
    #: weight to its sampler, ``min(pi / pi_sampler, is_cap)``; stale tokens of async steps keep
    #: their gradient) or "bypass" (the ratio against the sampler: tokens far off-policy are
    #: clipped and lose their gradient).
    off_policy: str = "decoupled"
    is_cap: float = 2.0
    #: Tokens per forward/backward micro-batch of the trainer (both backends).
    max_tokens_per_microbatch: int = 4096
    #: Bucket size of the weight push from the trainer into the engine, in MiB.
    push_bucket_mb: int = 256
    #: How the pushed weights reach the engine: "files" (buckets in shared memory, any engine),
    #: "group" (verl's rank 0 broadcasts each bucket to vLLM's workers over a process group: NCCL
    #: GPU to GPU, gloo on CPU) or "auto" (group with split placement on GPUs, where the trainer's
    #: GPUs are not vLLM's; files otherwise: NCCL cannot join two ranks on one GPU, so "group"
    #: with placement = "collocated" on cuda is refused).
    push_transport: str = "auto"
    #: verl only: LoRA adapters of this rank instead of full fine-tuning (0: full fine-tuning),
    #: and their alpha (None: 2 * lora_rank).
    lora_rank: int = 0
    lora_alpha: int | None = None
    #: verl only: recompute activations in the backward pass (less memory, more compute).
    gradient_checkpointing: bool = False
    #: verl only: pack each micro-batch's sequences into one row without padding (the model
    #: separates them by their position ids); False pads them to the longest.
    remove_padding: bool = True
    #: verl only: dtype of the FSDP parameters, "bf16", "fp16" or "fp32" (None: bf16 on cuda,
    #: fp32 on cpu); gradients are reduced and kept in fp32. vLLM serves in the same dtype and the
    #: weights are pushed in it (see ``compute_dtype``).
    param_dtype: str | None = None
    #: verl only: weight of the KL penalty to the initial policy (0: no reference model is
    #: loaded) and verl's KL estimator ("low_var_kl", "kl", "mse", ...).
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    #: verl only: optimizer steps per training step (the batch split into this many mini-batches).
    mini_batches: int = 1
    #: Steps between full checkpoints (0: only on request and at shutdown). Every step still
    #: writes the new version's weights (cheap), so a restart loses no step; the optimizer
    #: state resumes from the last full checkpoint.
    checkpoint_every: int = 5
    #: Full checkpoints (fp32 model + optimizer + trainer state, what training resumes from) to
    #: keep on disk; the newest one the log names is always kept, also while a newer one is being
    #: written. Of the per-version fp32 weights only the latest published version's is kept.
    #: (With verl's sharded checkpoints, at least 2 of each.)
    keep_checkpoints: int = 1
    #: Published versions whose weights are kept as bf16 safetensors
    #: (``checkpoints/published/v*.safetensors``: for serving or loading elsewhere, not for
    #: resuming), the newest first. Torch backend; verl's ranks write their own per-version files.
    keep_versions: int = 2
    #: Where a clean shutdown exports the final policy as a Hugging Face model directory
    #: (None: <data_dir>/export).
    export_dir: Path | None = None

    def __post_init__(self) -> None:
        one_of("trainer", self.backend, TRAINERS)
        one_of("push_transport", self.push_transport, PUSH_TRANSPORTS)
        one_of("advantage", self.advantage, ("grpo", "rloo", "reinforce"))
        one_of("normalization", self.normalization, ("rollout", "sample", "token"))
        one_of("loss", self.loss, ("ppo", "gspo", "cispo"))
        one_of("off_policy", self.off_policy, ("decoupled", "bypass"))
        for name in ("trainer_ranks", "mini_batches", "max_tokens_per_microbatch", "push_bucket_mb"):
            at_least(name, getattr(self, name), 1)
        at_least("is_cap", self.is_cap, 1)
        at_least("lora_rank", self.lora_rank, 0, "full fine-tuning")
        at_least("lora_alpha", self.lora_alpha, 1)
        if not 0.0 <= self.kl_coef < float("inf"):
            raise ConfigError(f"kl_coef must be 0 or more; got {self.kl_coef}")
        if self.param_dtype is not None:
            one_of("param_dtype", self.param_dtype, PARAM_DTYPES)
        at_least("checkpoint_every", self.checkpoint_every, 0, "off")
        at_least("keep_checkpoints", self.keep_checkpoints, 1)
        at_least("keep_versions", self.keep_versions, 1)
        if self.backend == "verl":
            return
        if self.trainer_ranks is not None and self.trainer_ranks > 1:
            raise ConfigError(
                'trainer_ranks > 1 needs trainer = "verl" (the torch backend trains in one process)'
            )
        defaults = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}
        changed = [name for name in VERL_ONLY if getattr(self, name) != defaults[name]]
        if changed:
            raise ConfigError(
                f'{", ".join(changed)} need trainer = "verl" (the torch backend has none of them)'
            )

    def resolved_ranks(self, device: str) -> int:
        """``trainer_ranks``, or its default: the GPUs torch sees (``torch.cuda.device_count()``)
        when ``device`` = "cuda" and trainer = "verl", else 1 (the torch backend trains in one
        process)."""
        if self.trainer_ranks is not None:
            return self.trainer_ranks
        if device != "cuda" or self.backend != "verl":
            return 1
        import torch  # only here (and for device = "auto", see resolve_device)

        return max(1, torch.cuda.device_count())

    def compute_dtype(self, device: str) -> str:
        """The dtype the trainer computes in on ``device`` ("bf16", "fp16" or "fp32"), which is
        also the one vLLM serves in (``ApplianceConfig.engine_dtype``) and the weights are pushed
        in: ``param_dtype``, else bf16 for verl on cuda and fp32 otherwise (the torch backend
        computes in fp32 everywhere). One dtype on both sides keeps the sampler's log-probs the
        trainer's (a float32 checkpoint served as stored would differ from bf16 training)."""
        if self.param_dtype is not None:
            return self.param_dtype
        return "bf16" if self.backend == "verl" and device.startswith("cuda") else "fp32"

    def options(self, *, device: str, temperature: float | None) -> dict[str, Any]:
        """Keyword arguments of ``trainer.factory.make_trainer(self.backend, model_dir, **options)``
        on ``device``, for samples drawn at ``temperature`` (the proxy's; None: the client's,
        trained at 1): the common options, plus the verl-only ones (``VERL_ONLY_OPTIONS``) when
        trainer = "verl". ``trainer_ranks`` and ``push_bucket_mb`` are not among them (they are
        no trainer arguments)."""
        options: dict[str, Any] = {
            "device": device,
            "lr": self.lr,
            "grad_clip": self.grad_clip,
            # None (the client's temperature) samples at 1 unless the client asks otherwise.
            "temperature": temperature or 1.0,
            "loss": self.loss,
            "off_policy": self.off_policy,
            "is_cap": self.is_cap,
            "normalization": self.normalization,
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
        }
        if self.backend == "verl":
            options.update({name: getattr(self, name) for name in VERL_ONLY})
            # Decided here, once, for the trainer and the engine alike.
            options["param_dtype"] = self.compute_dtype(device)
        return options
