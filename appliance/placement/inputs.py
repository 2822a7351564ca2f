"""What a placement is asked about: the machine's GPUs and host RAM, and the run's settings.

Owns :class:`Gpu`, :class:`Machine` and :class:`PlacementSettings` (with the settings' own
checks). Plain data: the decision is ``appliance.placement.planner``'s, reading a real machine
``appliance.placement.machine``'s, and a config's settings ``appliance.placement.plan``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config import PLACEMENTS
from contracts.errors import ConfigError

__all__ = ["Gpu", "Machine", "PlacementSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """A GPU as the plan sees it (probing reads more of it: ``appliance.placement.machine.GpuInfo``)."""

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
