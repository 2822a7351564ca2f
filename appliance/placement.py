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

It owns no memory figure (``appliance.memory_model``), probes nothing (``appliance.machine``
reads this machine and model directories), refuses nothing (``appliance.preflight`` does) and
starts nothing: putting engines and trainer ranks on the planned GPUs is the engines' and the
trainer's business. Invariant: the replicas' GPUs are disjoint, and in split placement
disjoint from the trainer's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.config import PLACEMENTS
from appliance.errors import ConfigError
from appliance.memory_model import (
    DEFAULT_MAX_MODEL_LEN,
    GIB,
    HOST_BASE,
    MAX_UTILIZATION,
    REFERENCE_BYTES,
    TRAINER_OFFLOADED,
    VLLM_ASLEEP,
    EngineMemory,
    ModelSpec,
    Shape,
    TrainerMemory,
    engine_memory,
    gib,
    trainer_memory,
)

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig

#: The LoRA rank a full fine-tune that does not fit is offered.
SUGGESTED_LORA_RANK = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
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
    ranks = config.trainer_ranks if config.trainer_ranks is not None or config.trainer == "verl" else 1
    return PlacementSettings(
        placement=config.placement,
        gpus=config.gpus if config.device.startswith("cuda") else None,
        engine_replicas=config.engine_replicas,
        tensor_parallel_size=config.tensor_parallel_size,
        trainer_ranks=ranks,
        lora_rank=config.lora_rank,
        gradient_checkpointing=config.gradient_checkpointing,
        reference_model=config.trainer == "verl" and config.kl_coef > 0,
        tokens_per_microbatch=config.max_tokens_per_microbatch,
        compute_bytes={None: None, "fp32": 4}.get(config.param_dtype, 2),
        max_model_len=config.vllm_max_model_len,
        max_num_seqs=config.max_batch_size,
        gpu_memory_utilization=config.gpu_memory_utilization if config.engine == "vllm" else None,
        sleep_level=config.sleep_level,
        engine=config.engine,
        cpu_kv_cache_bytes=config.vllm_cpu_kv_cache_gib * GIB,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Where everything goes and whether it fits. GPU indices are the machine's."""

    placement: str
    #: "cuda" or "cpu".
    device: str
    machine: Machine
    model: ModelSpec
    settings: PlacementSettings
    #: The GPUs of each vLLM replica (K tuples of t GPUs, disjoint); ``((),)`` on CPU.
    replicas: tuple[tuple[int, ...], ...]
    tensor_parallel_size: int
    trainer_gpus: tuple[int, ...]
    trainer_ranks: int
    #: vLLM's memory fraction while generating (None on CPU).
    gpu_memory_utilization: float | None
    sleep_level: int
    #: Per GPU (on CPU: in host RAM).
    engine_memory: EngineMemory
    trainer_memory: TrainerMemory
    #: Full-length sequences vLLM's KV cache holds at once (None on CPU).
    kv_sequences: int | None
    #: Host RAM: vLLM's level-1 sleep (every replica's weights), the offloaded trainer ranks'
    #: state, and all the plan needs (on CPU: what stays resident).
    sleep_host_bytes: int
    offload_host_bytes: int
    host_ram_bytes: int
    fits: bool
    reason: str
    notes: tuple[str, ...] = ()
    #: The model's figures estimated from its parameter count (``Shape.of``).
    estimated: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON types (``ApplianceStarted.placement`` records it)."""
        out = dataclasses.asdict(self)
        out["engine_memory"]["need_bytes"] = self.engine_memory.need_bytes
        out["engine_memory"]["kv_one_sequence_bytes"] = self.engine_memory.kv_one_sequence_bytes
        out["trainer_memory"]["peak_bytes"] = self.trainer_memory.peak_bytes
        converted: dict[str, Any] = json.loads(json.dumps(out))
        return converted


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
        return _Planner(machine, model, settings).refused(
            "device = cuda but no GPU was found (nvidia-smi, torch.cuda); use --device cpu"
        )
    if settings.gpus is not None and settings.gpus > count and device != "cpu":
        return _Planner(machine, model, settings).refused(
            f"gpus = {settings.gpus} but this machine has {count} GPU(s); use --gpus {count}"
        )
    if settings.gpus is not None:
        machine = dataclasses.replace(machine, gpus=machine.gpus[: settings.gpus])
    planner = _Planner(machine, model, settings)
    return planner.on_gpus() if machine.gpus else planner.on_cpu()


class _Planner:
    """One plan: the GPU pools, then the checks in order (engine, trainer, host RAM); the first
    that fails is the reason."""

    def __init__(self, machine: Machine, model: ModelSpec, settings: PlacementSettings) -> None:
        self.machine, self.model, self.settings = machine, model, settings
        self.shape = Shape.of(model)
        self.gpus = machine.gpus
        self.count = len(machine.gpus)
        self.split = settings.placement == "split"
        self.max_len = settings.max_model_len or model.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        self.notes: list[str] = []

    def trainer(self, ranks: int, **changes: Any) -> TrainerMemory:
        s = self.settings
        options: dict[str, Any] = {
            "lora_rank": s.lora_rank,
            "gradient_checkpointing": s.gradient_checkpointing,
            "tokens": s.tokens_per_microbatch,
            "compute_bytes": s.compute_bytes or (2 if self.gpus else 4),
            "reference_model": s.reference_model,
            "cpu": not self.gpus,
        }
        return trainer_memory(self.model, self.shape, ranks, **{**options, **changes})

    def engine(self, t: int, max_len: int | None = None) -> EngineMemory:
        return engine_memory(
            self.model, self.shape, t, max_len or self.max_len, self.settings.max_num_seqs, cpu=not self.gpus
        )

    def result(self, **fields: Any) -> Plan:
        s = self.settings
        if self.shape.estimated:
            self.notes.append(
                f"model shape estimated from its parameter count ({', '.join(self.shape.estimated)}); "
                "--model DIR gives exact figures"
            )
        defaults: dict[str, Any] = {
            "placement": s.placement,
            "device": "cuda" if self.gpus else "cpu",
            "machine": self.machine,
            "model": self.model,
            "settings": s,
            "sleep_level": s.sleep_level,
            "notes": tuple(self.notes),
            "estimated": self.shape.estimated,
        }
        return Plan(**{**defaults, **fields})

    def refused(self, reason: str) -> Plan:
        """A plan refused before anything could be placed."""
        ranks = self.settings.trainer_ranks or 1
        t = self.settings.tensor_parallel_size or 1
        return self.result(
            replicas=(),
            tensor_parallel_size=t,
            trainer_gpus=(),
            trainer_ranks=ranks,
            gpu_memory_utilization=None,
            engine_memory=self.engine(t),
            trainer_memory=self.trainer(ranks),
            kv_sequences=None,
            sleep_host_bytes=0,
            offload_host_bytes=0,
            host_ram_bytes=0,
            fits=False,
            reason=reason,
        )

    # --- CPU -----------------------------------------------------------------------------------

    def on_cpu(self) -> Plan:
        """One engine and the trainer's ranks in host RAM. What stays resident is checked; a full
        micro-batch's activations only make a note: CPU runs train small models whose
        micro-batches seldom fill the token budget."""
        s = self.settings
        if s.placement == "split":
            return self.refused(
                "split placement needs GPUs and this machine has none; use --placement collocated"
            )
        if (s.engine_replicas or 1) > 1:
            return self.refused(
                f"on CPU the engine runs as one replica, not {s.engine_replicas}; use --engine-replicas 1"
            )
        ranks = s.trainer_ranks or 1
        engine, trainer = self.engine(1), self.trainer(ranks)
        kv = s.cpu_kv_cache_bytes if s.engine == "vllm" else engine.kv_one_sequence_bytes
        engine_bytes = HOST_BASE + engine.weights_bytes + kv + engine.overhead_bytes

        def resident(memory: TrainerMemory) -> int:
            return engine_bytes + ranks * (memory.peak_bytes - memory.activation_bytes)

        ram = self.machine.ram_bytes if self.machine.ram_bytes is not None else resident(trainer)
        reason = ""
        if resident(trainer) > ram:
            lora = self.trainer(ranks, lora_rank=SUGGESTED_LORA_RANK)
            fits_with_lora = not s.lora_rank and resident(lora) <= ram
            fix = f"--lora-rank {SUGGESTED_LORA_RANK}" if fits_with_lora else "a smaller model or more RAM"
            reason = (
                f"the engine and {ranks} trainer rank(s) ({trainer.method}) need {gib(resident(trainer))} of "
                f"host RAM but this machine has {gib(ram)}; use {fix}"
            )
        elif resident(trainer) + ranks * trainer.activation_bytes > ram:
            self.notes.append(
                f"a full micro-batch ({s.tokens_per_microbatch} tokens) may take the run to "
                f"{gib(resident(trainer) + ranks * trainer.activation_bytes)} of {gib(ram)} RAM; "
                "--max-tokens-per-microbatch lowers it"
            )
        if (s.tensor_parallel_size or 1) > 1:
            self.notes.append("tensor_parallel_size applies to GPUs only: the CPU engine is not sharded")
        return self.result(
            replicas=((),),
            tensor_parallel_size=1,
            trainer_gpus=(),
            trainer_ranks=ranks,
            gpu_memory_utilization=None,
            engine_memory=engine,
            trainer_memory=trainer,
            kv_sequences=None,
            sleep_host_bytes=0,
            offload_host_bytes=0,
            host_ram_bytes=resident(trainer),
            fits=not reason,
            reason=reason or f"fits: {gib(resident(trainer))} resident of {gib(ram)} host RAM",
        )

    # --- GPUs: the pools -----------------------------------------------------------------------

    def on_gpus(self) -> Plan:
        s, g = self.settings, self.count
        if self.split:
            return self.split_pools()
        ranks = s.trainer_ranks or g
        trains = {gpu.index for gpu in self.gpus[:ranks]}
        k = s.engine_replicas
        t = s.tensor_parallel_size or self.smallest_t(g // (k or 1), list(self.gpus), trains)
        k = k or max(1, g // t)
        if k * t > g:
            fix = (
                f"--engine-replicas {g // t}" if g // t else f"--tensor-parallel-size {self.t_choices(g)[-1]}"
            )
            why = f"{k} engine replicas x tensor parallel {t} need {k * t} GPUs but this machine has {g}"
            return self.checked(t, k, ranks, 0, f"{why}; use {fix}")
        if ranks > g:
            why = f"{ranks} trainer ranks need {ranks} GPUs but this machine has {g}"
            return self.checked(t, k, ranks, k * t, f"{why}; use --trainer-ranks {g}")
        return self.checked(t, k, ranks, k * t)

    def split_pools(self) -> Plan:
        """The first K x t GPUs generate, the next N train; unless told otherwise, half the GPUs
        (rounded down) generate and the others train."""
        s, g = self.settings, self.count
        if g < 2:
            return self.refused(
                "split placement needs at least 2 GPUs (some generate, the others train) and this "
                "machine has 1; use --placement collocated"
            )
        k, t, n = s.engine_replicas, s.tensor_parallel_size, s.trainer_ranks
        if k is not None and t is not None:
            pool = k * t
        elif n is not None:
            pool = g - n
        elif k is not None:
            pool = g - 1  # at most: one GPU must train
        else:
            pool = g // 2
            self.notes.append(
                f"split: half the GPUs generate ({pool}), the other {g - pool} train; --engine-replicas, "
                "--tensor-parallel-size and --trainer-ranks move the line"
            )
        t = t or self.smallest_t(max(1, pool) // (k or 1), list(self.gpus[: max(1, pool)]), set())
        k = k or max(1, pool // t)
        n = n or g - k * t
        if n < 1 or k * t + n > g:
            left, n = g - k * t, max(n, 1)
            if left >= 1:
                fix = f"--trainer-ranks {left}"
            else:
                fix = f"--engine-replicas {(g - 1) // t}" if g - 1 >= t else "--placement collocated"
            why = (
                f"split placement of {k} engine replica(s) x tensor parallel {t} and {n} trainer rank(s) "
                f"needs {k * t + n} GPUs but this machine has {g}"
            )
            return self.checked(t, k, n, min(k * t, g), f"{why}; use {fix}")
        return self.checked(t, k, n, k * t)

    def t_choices(self, limit: int) -> list[int]:
        """Powers of two up to ``limit`` that divide the attention heads (when known)."""
        heads, out, t = self.model.num_heads, [], 1
        while t <= max(1, limit):
            if heads is None or heads % t == 0:
                out.append(t)
            t *= 2
        return out or [1]

    def smallest_t(self, limit: int, gpus: Sequence[Gpu], trains: set[int]) -> int:
        """The smallest t whose shard fits; when none does, the largest (the closest)."""
        choices = self.t_choices(limit)
        return next((t for t in choices if self.engine_fits(t, gpus, trains)), choices[-1])

    # --- GPUs: the budgets ---------------------------------------------------------------------

    def offloaded_trainer(self, gpu: Gpu, trains: set[int]) -> int:
        """What an offloaded trainer rank keeps on ``gpu`` while vLLM generates there."""
        return TRAINER_OFFLOADED if gpu.index in trains and not self.split else 0

    def utilization(self, gpu: Gpu, trains: set[int]) -> float:
        """The fraction vLLM takes of ``gpu``: as set, or derived (two decimals, rounded down)."""
        if self.settings.gpu_memory_utilization is not None:
            return self.settings.gpu_memory_utilization
        share = (gpu.free_bytes - self.offloaded_trainer(gpu, trains)) / gpu.total_bytes
        return max(0.0, math.floor(min(MAX_UTILIZATION, share) * 100) / 100)

    def engine_budget(self, gpu: Gpu, trains: set[int]) -> float:
        return min(
            self.utilization(gpu, trains) * gpu.total_bytes,
            gpu.free_bytes - self.offloaded_trainer(gpu, trains),
        )

    def engine_fits(self, t: int, gpus: Sequence[Gpu], trains: set[int], max_len: int | None = None) -> bool:
        need = self.engine(t, max_len).need_bytes
        return all(need <= self.engine_budget(gpu, trains) for gpu in gpus)

    def trainer_budget(self, gpu: Gpu, engines: set[int]) -> int:
        """What a trainer rank may take of ``gpu`` while vLLM sleeps there (collocated)."""
        return gpu.free_bytes - (VLLM_ASLEEP if gpu.index in engines and not self.split else 0)

    # --- GPUs: the checks ----------------------------------------------------------------------

    def checked(self, t: int, k: int, n: int, engine_gpus: int, reason: str = "") -> Plan:
        """Assign the GPUs, then check the engine, the trainer and host RAM (unless ``reason``
        already refuses)."""
        s = self.settings
        engine_list = list(self.gpus[:engine_gpus])
        replicas = tuple(
            tuple(g.index for g in engine_list[r * t : (r + 1) * t]) for r in range(engine_gpus // t)
        )
        start = engine_gpus if self.split else 0
        trainer_list = list(self.gpus[start : start + n])
        trains, engines = {g.index for g in trainer_list}, {g.index for g in engine_list}
        engine, trainer = self.engine(t), self.trainer(n)
        util = min((self.utilization(g, trains) for g in engine_list), default=None)
        kv_sequences = None
        if engine_list:
            room = min(self.engine_budget(g, trains) for g in engine_list)
            kv_room = room - engine.weights_bytes - engine.overhead_bytes
            kv_sequences = max(0, int(kv_room // max(1, engine.kv_one_sequence_bytes)))
        collocated_sleep = not self.split and s.sleep_level == 1
        sleep_host = k * t * engine.weights_bytes if collocated_sleep else 0
        offload_host = 0 if self.split else n * trainer.state_bytes
        reference_host = self.model.params * REFERENCE_BYTES if s.reference_model else 0
        host = HOST_BASE + sleep_host + offload_host + reference_host
        if not reason and engine_list:
            reason = self.engine_reason(t, k, engine_list, trains)
        if not reason and trainer_list:
            reason = self.trainer_reason(n, trainer, trainer_list, engines, engine_gpus)
        ram = self.machine.ram_bytes
        if not reason and ram is not None and host > ram:
            reason = self.host_reason(host, ram, sleep_host, offload_host)
        fits = not reason
        if fits and kv_sequences is not None and kv_sequences < s.max_num_seqs:
            self.notes.append(
                f"vLLM's KV cache holds {kv_sequences} full-length ({self.max_len}-token) sequences of the "
                f"{s.max_num_seqs} it batches: it runs fewer at once when sequences are that long"
            )
        available = self.machine.ram_available_bytes
        if fits and available is not None and host > available:
            self.notes.append(f"host RAM: the plan needs {gib(host)}, {gib(available)} is available now")
        if ram is None:
            self.notes.append(f"host RAM not known: the plan needs {gib(host)} (--ram-gib checks it)")
        if fits:
            engine_room = min((self.engine_budget(g, trains) for g in engine_list), default=0)
            trainer_room = min((self.trainer_budget(g, engines) for g in trainer_list), default=0)
            reason = (
                f"fits: vLLM {gib(engine.need_bytes)} of {gib(engine_room)} per GPU, the trainer "
                f"{gib(trainer.peak_bytes)} of {gib(trainer_room)} per GPU, host RAM {gib(host)} of "
                f"{_ram(ram)}"
            )
        return self.result(
            replicas=replicas,
            tensor_parallel_size=t,
            trainer_gpus=tuple(g.index for g in trainer_list),
            trainer_ranks=n,
            gpu_memory_utilization=util,
            engine_memory=engine,
            trainer_memory=trainer,
            kv_sequences=kv_sequences,
            sleep_host_bytes=sleep_host,
            offload_host_bytes=offload_host,
            host_ram_bytes=host,
            fits=fits,
            reason=reason,
        )

    def engine_reason(self, t: int, k: int, gpus: list[Gpu], trains: set[int]) -> str:
        s = self.settings
        for gpu in gpus:
            asked = self.utilization(gpu, trains) * gpu.total_bytes
            if s.gpu_memory_utilization is not None and asked > gpu.free_bytes - self.offloaded_trainer(
                gpu, trains
            ):
                kept = self.offloaded_trainer(gpu, trains)
                room = (gpu.free_bytes - kept) / gpu.total_bytes
                held = f", less {gib(kept)} an offloaded trainer rank keeps" if kept else ""
                return (
                    f"gpu_memory_utilization {s.gpu_memory_utilization:.2f} asks {gib(asked)} of GPU "
                    f"{gpu.index} but {gib(gpu.free_bytes)} is free{held}; use gpu_memory_utilization "
                    f"{math.floor(room * 100) / 100:.2f} or less"
                )
        if self.model.num_heads is not None and self.model.num_heads % t:
            return (
                f"tensor parallel {t} does not divide the model's {self.model.num_heads} attention heads; "
                f"use --tensor-parallel-size {self.t_choices(t)[-1]}"
            )
        engine = self.engine(t)
        worst = min(gpus, key=lambda g: self.engine_budget(g, trains))
        budget = self.engine_budget(worst, trains)
        if engine.need_bytes <= budget:
            return ""
        fixes: list[str] = []
        pool = self.count - 1 if self.split else self.count
        bigger = [u for u in self.t_choices(pool) if u > t and self.engine_fits(u, self.gpus[:pool], trains)]
        if bigger:
            fix = f"--tensor-parallel-size {bigger[0]}"
            if s.engine_replicas is not None and k * bigger[0] > pool:
                fix += f" --engine-replicas {max(1, pool // bigger[0])}"
            fixes.append(fix)
        shorter = (self.max_len - 1) // 1024 * 1024
        while shorter >= 1024 and not self.engine_fits(t, gpus, trains, shorter):
            shorter -= 1024
        if shorter >= 1024:
            fixes.append(f"--max-model-len {shorter}")
        return (
            f"vLLM needs {gib(engine.need_bytes)} per GPU at tensor parallel {t} ({engine.breakdown()}) "
            f"but gets {gib(budget)} of GPU {worst.index} (gpu_memory_utilization "
            f"{self.utilization(worst, trains):.2f} of {gib(worst.total_bytes)}); use "
            + (" or ".join(fixes) or "GPUs with more memory")
        )

    def trainer_reason(
        self, n: int, trainer: TrainerMemory, gpus: list[Gpu], engines: set[int], engine_gpus: int
    ) -> str:
        worst = min(gpus, key=lambda g: self.trainer_budget(g, engines))
        room = self.trainer_budget(worst, engines)
        if trainer.peak_bytes <= room:
            return ""
        s = self.settings
        most = self.count - engine_gpus if self.split else self.count
        lora = {} if s.lora_rank else {"lora_rank": SUGGESTED_LORA_RANK}
        recompute = {} if s.gradient_checkpointing else {"gradient_checkpointing": True}
        # The least change first: more ranks, LoRA, recomputed activations, LoRA and recomputing.
        options: list[tuple[str, dict[str, Any]]] = [("", {})]
        if lora:
            options.append((f"--lora-rank {SUGGESTED_LORA_RANK}", lora))
        if recompute:
            options.append(("--gradient-checkpointing", recompute))
        if lora and recompute:
            options.append((f"--lora-rank {SUGGESTED_LORA_RANK} --gradient-checkpointing", lora | recompute))

        def ranks_needed(changes: dict[str, Any], up_to: int) -> int | None:
            return next(
                (r for r in range(1, up_to + 1) if self.trainer(r, **changes).peak_bytes <= room), None
            )

        fixes: list[str] = []
        for flags, changes in options:
            ranks = ranks_needed(changes, most)
            if ranks is None:
                continue
            more = f"--trainer-ranks {ranks}" if ranks > n else ""
            fixes.append(" ".join(part for part in (more, flags) if part))
            if len(fixes) == 2 or not more:  # two alternatives, or one that keeps the ranks
                break
        if not fixes:  # not on this machine: how many GPUs of this size would do
            needed = [(ranks_needed(changes, 1024), flags) for flags, changes in options]
            found = sorted((r, flags) for r, flags in needed if r is not None)
            if found:
                r, flags = found[0]
                fixes.append(f"{r} GPUs of this size{' with ' + flags if flags else ''}, or a smaller model")
            else:
                fixes.append("GPUs with more memory or a smaller model")
        asleep = (
            f", less {gib(VLLM_ASLEEP)} vLLM keeps asleep"
            if worst.index in engines and not self.split
            else ""
        )
        return (
            f"the trainer needs {gib(trainer.peak_bytes)} per GPU at {n} rank{'s' if n > 1 else ''} "
            f"({trainer.breakdown()}) but GPU {worst.index} has {gib(room)} for it ({gib(worst.free_bytes)} "
            f"free{asleep}); use " + " or ".join(fixes)
        )

    def host_reason(self, host: int, ram: int, sleep_host: int, offload_host: int) -> str:
        if sleep_host and host - sleep_host <= ram:
            fix = (
                "--sleep-level 2 (vLLM discards its weights while asleep and gets them back from the trainer)"
            )
        else:
            fix = "--placement split (nothing is offloaded) or a machine with more RAM"
        return (
            f"collocation needs {gib(host)} of host RAM ({gib(sleep_host)} vLLM asleep, {gib(offload_host)} "
            f"the offloaded trainer, {gib(HOST_BASE)} the appliance) but this machine has {gib(ram)}; "
            f"use {fix}"
        )


def _gpu_list(indices: Sequence[int]) -> str:
    """``GPUs 0-7`` for a run of three or more, ``GPUs 0,2``, ``GPU 0``."""
    if len(indices) > 2 and list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"GPUs {indices[0]}-{indices[-1]}"
    return ("GPU " if len(indices) == 1 else "GPUs ") + ",".join(str(i) for i in indices)


def _ram(ram: int | None) -> str:
    return gib(ram) if ram is not None else "an unknown amount"


def describe(plan: Plan) -> list[str]:
    """The plan in a few lines a person reads: the verdict first, the reason last."""
    m, e, tr = plan.machine, plan.engine_memory, plan.trainer_memory
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    p = plan.model.params
    size = f"{p / 1e9:.2f}B" if p >= 10**8 else f"{p / 1e6:.1f}M"
    model = f"{plan.model.name} ({size} parameters)" if plan.model.name else f"{size} parameters"
    if plan.device == "cpu":
        lines = [
            f"placement: CPU only, {_ram(m.ram_bytes)} RAM, model {model}: {verdict}",
            f"  engine: one, on the CPU ({gib(e.weights_bytes)} weights)",
            f"  trainer: {plan.trainer_ranks} rank(s) on the CPU, {gib(tr.peak_bytes)} each with a full "
            f"micro-batch ({tr.breakdown()})",
        ]
    else:
        sizes = ", ".join(gib(size) for size in sorted({g.total_bytes for g in m.gpus}))
        gpus = f"{len(m.gpus)} GPU(s) of {sizes}, {_ram(m.ram_bytes)} RAM"
        lines = [f"placement: {plan.placement} on {gpus}, model {model}: {verdict}"]
        if plan.replicas:
            groups = " ".join("[" + ",".join(str(i) for i in r) + "]" for r in plan.replicas)
            sleep = (
                f"; asleep at level {plan.sleep_level} while training "
                + ("(weights to host RAM)" if plan.sleep_level == 1 else "(weights discarded)")
                if plan.placement == "collocated"
                else "; never sleeps"
            )
            lines.append(
                f"  vLLM: {len(plan.replicas)} replica(s) x tensor parallel {plan.tensor_parallel_size} "
                f"on GPUs {groups}, gpu_memory_utilization {plan.gpu_memory_utilization or 0:.2f}{sleep}"
            )
            lines.append(
                f"  vLLM per GPU: {gib(e.need_bytes)} ({e.breakdown()}); its KV cache holds "
                f"{plan.kv_sequences} such sequences"
            )
        if plan.trainer_gpus:
            lines.append(
                f"  trainer: {plan.trainer_ranks} rank(s) on {_gpu_list(plan.trainer_gpus)}, "
                f"{gib(tr.peak_bytes)} per GPU ({tr.breakdown()})"
            )
    if plan.placement == "collocated" and plan.device == "cuda":
        lines.append(
            f"  host RAM: {gib(plan.host_ram_bytes)} of {_ram(m.ram_bytes)} ({gib(plan.sleep_host_bytes)} "
            f"vLLM asleep, {gib(plan.offload_host_bytes)} the trainer offloaded)"
        )
    lines.append(f"  {plan.reason}" if plan.fits else f"  why: {plan.reason}")
    lines.extend(f"  note: {note}" for note in plan.notes)
    return lines
