"""What a placement decides: the :class:`Plan` (where vLLM's replicas and the trainer's ranks go,
what each needs, whether it fits and why not) and a collocated start's phases (:class:`Startup`).

Plain data and its JSON (``ApplianceStarted.placement`` records ``Plan.to_json``); the decision
is ``appliance.placement.planner``'s, its wording ``appliance.placement.text``'s.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from appliance.placement.inputs import Machine, PlacementSettings
from appliance.placement.memory_model import EngineMemory, ModelSpec, TrainerMemory

__all__ = ["Plan", "Startup"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Startup:
    """A collocated start on its tightest GPU, in the order ``appliance.app`` takes: vLLM starts
    awake, sleeps while the trainer is built and restored, and wakes once the trainer has
    offloaded. Bytes on the GPU in each phase."""

    gpu: int
    free_bytes: int
    #: vLLM started, at its fraction.
    engine_bytes: int
    #: vLLM asleep and the trainer rank loading (``TrainerMemory.load_bytes``).
    loading_bytes: int
    #: vLLM awake again beside the offloaded trainer rank.
    serving_bytes: int
    #: The order not taken: the trainer loading beside an awake vLLM.
    beside_awake_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.engine_bytes, self.loading_bytes, self.serving_bytes)


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
    #: Host RAM: vLLM asleep (every replica's weights at level 1, its CUDA graph pools at both
    #: levels), the offloaded trainer ranks' state, and all the plan needs (on CPU: what stays
    #: resident).
    sleep_host_bytes: int
    offload_host_bytes: int
    host_ram_bytes: int
    fits: bool
    reason: str
    notes: tuple[str, ...] = ()
    #: The model's figures estimated from its parameter count (``Shape.of``).
    estimated: tuple[str, ...] = ()
    #: The start-up's phases where vLLM and a trainer rank share a GPU (None: none does).
    startup: Startup | None = None

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON types (``ApplianceStarted.placement`` records it)."""
        out = dataclasses.asdict(self)
        out["engine_memory"]["need_bytes"] = self.engine_memory.need_bytes
        out["engine_memory"]["kv_one_sequence_bytes"] = self.engine_memory.kv_one_sequence_bytes
        out["trainer_memory"]["peak_bytes"] = self.trainer_memory.peak_bytes
        converted: dict[str, Any] = json.loads(json.dumps(out))
        return converted
