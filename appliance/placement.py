"""GPU placement: which GPUs generate, which train, and whether the model fits on them.

Owns the placement plan, a pure function of the machine (its GPUs with their total and free
memory, host RAM), the model (``memory_model.ModelSpec``) and the settings (``collocated`` or
``split``, engine replicas K, tensor-parallel size t, trainer ranks N, sequence lengths, sleep
level): which GPUs each vLLM replica uses, which GPUs the trainer ranks use, vLLM's memory
fraction, the host RAM collocation needs, and ``fits`` with ``reason``: when it does not fit,
one line saying what does not fit and what would (``--trainer-ranks 4``, ``--lora-rank 16``,
``--tensor-parallel-size 2``, ...). ``describe`` and ``Plan.to_json`` show it.

Collocated (the default): every GPU is time-sliced between generation and training. vLLM holds
``gpu_memory_utilization`` of each of its GPUs while it generates and sleeps while the trainer
trains (level 1 offloads its weights to host RAM, level 2 discards them; both free the KV
cache); the trainer offloads its parameters, gradients and optimizer state to host RAM while
vLLM generates. Split: the first K x t GPUs only generate, the next N only train; nothing
sleeps and nothing is offloaded. Without GPUs the plan is trivial (one engine and the trainer
ranks on the CPU) and checks host RAM.

This module owns what the plan is asked (:class:`Machine`, :class:`PlacementSettings`, the
settings of a config) and :func:`plan`, its entry. The decision and the :class:`Plan` it makes
are ``appliance.placement_planner``'s, the reasons' words and fixes
``appliance.placement_fixes``'s, the plan's lines ``appliance.placement_text``'s (``Plan`` and
``describe`` are importable from here too, for ``up`` and ``plan``).

It owns no memory figure (``appliance.memory_model``), probes nothing (``appliance.machine``
reads this machine and model directories), refuses nothing (``appliance.preflight`` does) and
starts nothing: putting engines and trainer ranks on the planned GPUs is the engines' and the
trainer's business. Invariant: the replicas' GPUs are disjoint, and in split placement
disjoint from the trainer's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.config import PLACEMENTS
from appliance.errors import ConfigError
from appliance.memory_model import GIB, ModelSpec
from appliance.placement_planner import Plan, Planner
from appliance.placement_text import describe

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig

__all__ = ["Gpu", "Machine", "PlacementSettings", "Plan", "describe", "plan", "settings_from_config"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """A GPU as the plan sees it (probing reads more of it: ``appliance.machine.GpuInfo``)."""

    index: int
    total_bytes: int
    #: Free now (another program may hold the rest): what the appliance can have.
    free_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """What the plan places onto. No GPUs: a CPU-only machine."""

    gpus: tuple[Gpu, ...] = ()
    #: Host RAM; None: not known (a described machine): what the plan needs is not checked.
    ram_bytes: int | None
    #: Host RAM available now (MemAvailable), for a note; None: not known.
    ram_available_bytes: int | None = None

    @staticmethod
    def described(gpus: int, gpu_bytes: int, ram_bytes: int | None = None) -> Machine:
        """``gpus`` identical, empty GPUs of ``gpu_bytes`` each."""
        return Machine(
            gpus=tuple(Gpu(index=i, total_bytes=gpu_bytes, free_bytes=gpu_bytes) for i in range(gpus)),
            ram_bytes=ram_bytes,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementSettings:
    """What the plan is asked for; None: derived (see ``plan``)."""

    #: "collocated" or "split".
    placement: str = "collocated"
    #: Use only the first this many GPUs (None: all).
    gpus: int | None = None
    #: vLLM replicas K and the GPUs each is sharded over, t.
    engine_replicas: int | None = None
    tensor_parallel_size: int | None = None
    #: Trainer ranks N, one per GPU (None: every GPU collocated, the ones left split, 1 on CPU).
    trainer_ranks: int | None = None
    #: 0: full fine-tuning; else LoRA adapters of this rank.
    lora_rank: int = 0
    gradient_checkpointing: bool = False
    #: A KL penalty (kl_coef > 0) loads a reference model.
    reference_model: bool = False
    #: Tokens of one trainer micro-batch (the activation allowance is for a full one).
    tokens_per_microbatch: int = 4096
    #: Bytes of the trainer's compute dtype, param_dtype (None: 2 on GPUs, 4 on CPU).
    compute_bytes: int | None = None
    #: Longest sequence vLLM serves (None: the model's context) and sequences it batches.
    max_model_len: int | None = None
    max_num_seqs: int = 16
    #: Fraction of each of its GPUs vLLM takes while generating (None: derived).
    gpu_memory_utilization: float | None = None
    sleep_level: int = 1
    #: "vllm" or "torch"; on CPU the torch engine needs no KV pool, vLLM ``cpu_kv_cache_bytes``.
    engine: str = "vllm"
    cpu_kv_cache_bytes: int = 0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement must be one of {', '.join(PLACEMENTS)}; got {self.placement!r}")
        for name in ("gpus", "engine_replicas", "tensor_parallel_size", "trainer_ranks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1; got {value}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be 0 (full fine-tuning) or more; got {self.lora_rank}")
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be above 0 and at most 1; got {utilization}")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"sleep_level must be 1 or 2; got {self.sleep_level}")


def settings_from_config(config: ApplianceConfig) -> PlacementSettings:
    """What ``up`` with ``config`` asks of the machine. The torch trainer is one process."""
    engine, trainer = config.engine, config.trainer
    verl = trainer.backend == "verl"
    ranks = trainer.trainer_ranks if trainer.trainer_ranks is not None or verl else 1
    return PlacementSettings(
        placement=config.placement,
        gpus=config.gpus if config.device.startswith("cuda") else None,
        engine_replicas=engine.engine_replicas,
        tensor_parallel_size=engine.tensor_parallel_size,
        trainer_ranks=ranks,
        lora_rank=trainer.lora_rank,
        gradient_checkpointing=trainer.gradient_checkpointing,
        reference_model=verl and trainer.kl_coef > 0,
        tokens_per_microbatch=trainer.max_tokens_per_microbatch,
        compute_bytes=compute_bytes(config),
        max_model_len=engine.vllm_max_model_len,
        max_num_seqs=engine.max_batch_size,
        gpu_memory_utilization=engine.gpu_memory_utilization if engine.kind == "vllm" else None,
        sleep_level=config.scheduler.sleep_level,
        engine=engine.kind,
        cpu_kv_cache_bytes=engine.vllm_cpu_kv_cache_gib * GIB,
    )


def compute_bytes(config: ApplianceConfig) -> int | None:
    """Bytes of the dtype the trainer computes in and vLLM serves in (``TrainerConfig.compute_dtype``)
    once the device is known; before that, ``param_dtype``'s (None: decided by the device)."""
    trainer = config.trainer
    if config.device == "cpu" or config.device.startswith("cuda"):
        return 4 if trainer.compute_dtype(config.device) == "fp32" else 2
    return {None: None, "fp32": 4}.get(trainer.param_dtype, 2)


def plan(
    machine: Machine,
    model: ModelSpec,
    settings: PlacementSettings | None = None,
    *,
    device: str | None = None,
) -> Plan:
    """The placement of ``model`` on ``machine``, on its GPUs (``device`` "cuda": they must be
    there), on its CPU (``device`` "cpu": its GPUs are left alone), or by what it has (None).

    Derived when not given: t, the smallest power of two whose vLLM shard fits a GPU; K, the
    engine's GPUs // t (collocated: all GPUs; split: half of them); N, every GPU (collocated) or
    those left after the engine's (split), 1 on CPU; ``gpu_memory_utilization``, the share of
    each engine GPU that is free less what an offloaded trainer rank keeps there (collocated),
    at most 0.90."""
    settings = settings or PlacementSettings()
    if device == "cpu":
        machine = dataclasses.replace(machine, gpus=())
    count = len(machine.gpus)
    if device == "cuda" and not count:
        return Planner(machine, model, settings).refused(
            "device = cuda but no GPU was found (nvidia-smi, torch.cuda); use --device cpu"
        )
    if settings.gpus is not None and settings.gpus > count and device != "cpu":
        return Planner(machine, model, settings).refused(
            f"gpus = {settings.gpus} but this machine has {count} GPU(s); use --gpus {count}"
        )
    if settings.gpus is not None:
        machine = dataclasses.replace(machine, gpus=machine.gpus[: settings.gpus])
    planner = Planner(machine, model, settings)
    return planner.on_gpus() if machine.gpus else planner.on_cpu()
