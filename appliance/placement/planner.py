"""How a placement is decided: the :class:`Planner` that makes a ``Plan``.

Owns the decision ``appliance.placement.plan`` asks for, given a machine, a model and the
settings: the GPU pools (collocated: every GPU generates and trains; split: the first K x t
generate, the next N train), t when it is not given (the smallest power of two whose vLLM
shard fits), what vLLM and a trainer rank may take of each GPU (``gpu_memory_utilization``
less what an offloaded trainer rank keeps there; what a sleeping vLLM leaves), the collocated
start-up's phases (:class:`Startup`: vLLM asleep while the trainer loads), the plan on the
CPU, and the checks in order (engine, trainer, host RAM), the first that fails being the
reason. Pure: the memory figures are ``appliance.placement.memory_model``'s, the reason's words
and the fix it offers ``appliance.placement.fixes``'s.

It does not own what the plan is asked (``appliance.placement.inputs``: the machine, the
settings), what it decides (``appliance.placement.decision``: the plan as data) nor how it
reads (``appliance.placement.text``). Invariant: the replicas' GPUs are disjoint, and in split
placement disjoint from the trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from appliance.placement.decision import Plan, Startup
from appliance.placement.fixes import cpu_reason, engine_reason, host_reason, trainer_reason
from appliance.placement.memory_model import (
    DEFAULT_MAX_MODEL_LEN,
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
from appliance.placement.text import ram_text

if TYPE_CHECKING:
    from appliance.placement.inputs import Gpu, Machine, PlacementSettings

__all__ = ["Planner"]


class Planner:
    """One plan: the GPU pools, then the checks in order (engine, trainer, host RAM); the first
    that fails is the reason (``appliance.placement.fixes`` words it)."""

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
            self.model,
            self.shape,
            t,
            max_len or self.max_len,
            self.settings.max_num_seqs,
            cpu=not self.gpus,
            serve_bytes=self.settings.compute_bytes,
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
            self.notes.append(
                "split on CPU: generation and training run at the same time on the same cores "
                "(there are no GPUs to divide; this tries the mode, it is not faster)"
            )
        replicas = s.engine_replicas or 1
        ranks = s.trainer_ranks or 1
        engine, trainer = self.engine(1), self.trainer(ranks)
        kv = s.cpu_kv_cache_bytes if s.engine == "vllm" else engine.kv_one_sequence_bytes
        # Each replica holds its own weights and cache in host RAM.
        engine_bytes = HOST_BASE + replicas * (engine.weights_bytes + kv + engine.overhead_bytes)

        def resident(memory: TrainerMemory) -> int:
            return engine_bytes + ranks * (memory.peak_bytes - memory.activation_bytes)

        ram = self.machine.ram_bytes if self.machine.ram_bytes is not None else resident(trainer)
        reason = cpu_reason(self, ranks, resident, ram)
        if not reason and resident(trainer) + ranks * trainer.activation_bytes > ram:
            self.notes.append(
                f"a full micro-batch ({s.tokens_per_microbatch} tokens) may take the run to "
                f"{gib(resident(trainer) + ranks * trainer.activation_bytes)} of {gib(ram)} RAM; "
                "--max-tokens-per-microbatch lowers it"
            )
        if (s.tensor_parallel_size or 1) > 1:
            self.notes.append("tensor_parallel_size applies to GPUs only: the CPU engine is not sharded")
        return self.result(
            replicas=((),) * replicas,
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

    def startup(self, engine_gpus: Sequence[Gpu], trains: set[int], trainer: TrainerMemory) -> Startup | None:
        """The start-up's phases on the GPU where they leave the least room (collocated: those
        that hold both a vLLM worker and a trainer rank)."""
        if self.split:
            return None

        def phases(gpu: Gpu) -> Startup:
            awake = int(self.utilization(gpu, trains) * gpu.total_bytes)
            return Startup(
                gpu=gpu.index,
                free_bytes=gpu.free_bytes,
                engine_bytes=awake,
                loading_bytes=VLLM_ASLEEP + trainer.load_bytes,
                serving_bytes=awake + TRAINER_OFFLOADED,
                beside_awake_bytes=awake + trainer.load_bytes,
            )

        shared = [phases(gpu) for gpu in engine_gpus if gpu.index in trains]
        return min(shared, key=lambda s: s.free_bytes - s.peak_bytes, default=None)

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
            kv_room = room - engine.weights_bytes - engine.overhead_bytes - engine.graph_bytes
            kv_sequences = max(0, int(kv_room // max(1, engine.kv_one_sequence_bytes)))
        # Asleep, each vLLM worker keeps its weights in host RAM at level 1 and its CUDA graph
        # pool at both levels (--sleep-mode-offload-cudagraph).
        sleep_weights = k * t * engine.weights_bytes if not self.split and s.sleep_level == 1 else 0
        sleep_host = sleep_weights + (0 if self.split else k * t * engine.graph_bytes)
        offload_host = 0 if self.split else n * trainer.state_bytes
        reference_host = self.model.params * REFERENCE_BYTES if s.reference_model else 0
        host = HOST_BASE + sleep_host + offload_host + reference_host
        if not reason and engine_list:
            reason = engine_reason(self, t, k, engine_list, trains)
        if not reason and trainer_list:
            reason = trainer_reason(self, n, trainer, trainer_list, engines, engine_gpus)
        ram = self.machine.ram_bytes
        if not reason and ram is not None and host > ram:
            reason = host_reason(host, ram, sleep_host, offload_host, sleep_weights=sleep_weights)
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
                f"{ram_text(ram)}"
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
            startup=self.startup(engine_list, trains, trainer),
        )
