"""When a plan does not fit: the one line that says what does not, and the least change that would.

Owns the reasons a planner (``appliance.placement.planner.Planner``, seen through the
:class:`Planner` protocol here) refuses a plan with, each
ending in the flags that would make it fit on this machine, searched from the least change
up: more trainer ranks, LoRA (``--lora-rank 16``), recomputed activations, a larger tensor
parallel size, a shorter context, vLLM's sleep level 2, split placement; or, when nothing fits
here, what machine would. Pure: it asks the planner what fits (its budgets per GPU and the
memory model's figures) and decides nothing itself.

It does not own the budgets nor the order of the checks (``appliance.placement.planner``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from appliance.placement.inputs import Gpu, PlacementSettings
from appliance.placement.memory_model import (
    HOST_BASE,
    VLLM_ASLEEP,
    EngineMemory,
    ModelSpec,
    TrainerMemory,
    gib,
)

__all__ = ["SUGGESTED_LORA_RANK", "cpu_reason", "engine_reason", "host_reason", "trainer_reason"]

#: The LoRA rank a full fine-tune that does not fit is offered.
SUGGESTED_LORA_RANK = 16


class Planner(Protocol):
    """What the reasons ask of a planner (``appliance.placement.planner.Planner``): its pools,
    its budgets per GPU and the memory model's figures for a candidate."""

    count: int
    gpus: tuple[Gpu, ...]
    max_len: int
    model: ModelSpec
    settings: PlacementSettings
    split: bool

    def trainer(self, ranks: int, **changes: Any) -> TrainerMemory: ...
    def engine(self, t: int, max_len: int | None = None) -> EngineMemory: ...
    def t_choices(self, limit: int) -> list[int]: ...
    def offloaded_trainer(self, gpu: Gpu, trains: set[int]) -> int: ...
    def utilization(self, gpu: Gpu, trains: set[int]) -> float: ...
    def engine_budget(self, gpu: Gpu, trains: set[int]) -> float: ...
    def engine_fits(
        self, t: int, gpus: Sequence[Gpu], trains: set[int], max_len: int | None = None
    ) -> bool: ...
    def trainer_budget(self, gpu: Gpu, engines: set[int]) -> int: ...


# Each takes ``p``, the planner asking: its settings, its budgets per GPU, its memory figures.


def cpu_reason(p: Planner, ranks: int, resident: Callable[[TrainerMemory], int], ram: int) -> str:
    """Why the engine and ``ranks`` trainer ranks do not fit in host RAM ("" when they do);
    ``resident``: what a run with such a trainer keeps in RAM."""
    trainer = p.trainer(ranks)
    if resident(trainer) <= ram:
        return ""
    lora = p.trainer(ranks, lora_rank=SUGGESTED_LORA_RANK)
    fits_with_lora = not p.settings.lora_rank and resident(lora) <= ram
    fix = f"--lora-rank {SUGGESTED_LORA_RANK}" if fits_with_lora else "a smaller model or more RAM"
    return (
        f"the engine and {ranks} trainer rank(s) ({trainer.method}) need {gib(resident(trainer))} of "
        f"host RAM but this machine has {gib(ram)}; use {fix}"
    )


def engine_reason(p: Planner, t: int, k: int, gpus: list[Gpu], trains: set[int]) -> str:
    """Why vLLM's K = ``k`` replicas at tensor parallel ``t`` do not fit on ``gpus`` (those of
    ``trains`` also hold an offloaded trainer rank); "" when they do."""
    s = p.settings
    for gpu in gpus:
        asked = p.utilization(gpu, trains) * gpu.total_bytes
        kept = p.offloaded_trainer(gpu, trains)
        if s.gpu_memory_utilization is not None and asked > gpu.free_bytes - kept:
            room = (gpu.free_bytes - kept) / gpu.total_bytes
            held = f", less {gib(kept)} an offloaded trainer rank keeps" if kept else ""
            return (
                f"gpu_memory_utilization {s.gpu_memory_utilization:.2f} asks {gib(asked)} of GPU "
                f"{gpu.index} but {gib(gpu.free_bytes)} is free{held}; use gpu_memory_utilization "
                f"{math.floor(room * 100) / 100:.2f} or less"
            )
    if p.model.num_heads is not None and p.model.num_heads % t:
        return (
            f"tensor parallel {t} does not divide the model's {p.model.num_heads} attention heads; "
            f"use --tensor-parallel-size {p.t_choices(t)[-1]}"
        )
    engine = p.engine(t)
    worst = min(gpus, key=lambda g: p.engine_budget(g, trains))
    budget = p.engine_budget(worst, trains)
    if engine.need_bytes <= budget:
        return ""
    fixes: list[str] = []
    pool = p.count - 1 if p.split else p.count
    bigger = [u for u in p.t_choices(pool) if u > t and p.engine_fits(u, p.gpus[:pool], trains)]
    if bigger:
        fix = f"--tensor-parallel-size {bigger[0]}"
        if s.engine_replicas is not None and k * bigger[0] > pool:
            fix += f" --engine-replicas {max(1, pool // bigger[0])}"
        fixes.append(fix)
    shorter = (p.max_len - 1) // 1024 * 1024
    while shorter >= 1024 and not p.engine_fits(t, gpus, trains, shorter):
        shorter -= 1024
    if shorter >= 1024:
        fixes.append(f"--max-model-len {shorter}")
    return (
        f"vLLM needs {gib(engine.need_bytes)} per GPU at tensor parallel {t} ({engine.breakdown()}) "
        f"but gets {gib(budget)} of GPU {worst.index} (gpu_memory_utilization "
        f"{p.utilization(worst, trains):.2f} of {gib(worst.total_bytes)}); use "
        + (" or ".join(fixes) or "GPUs with more memory")
    )


def trainer_reason(
    p: Planner, n: int, trainer: TrainerMemory, gpus: list[Gpu], engines: set[int], engine_gpus: int
) -> str:
    """Why ``n`` trainer ranks of ``trainer`` do not fit on ``gpus`` (those of ``engines`` also
    hold a sleeping vLLM); "" when they do."""
    worst = min(gpus, key=lambda g: p.trainer_budget(g, engines))
    room = p.trainer_budget(worst, engines)
    if trainer.peak_bytes <= room:
        return ""
    s = p.settings
    most = p.count - engine_gpus if p.split else p.count
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
        return next((r for r in range(1, up_to + 1) if p.trainer(r, **changes).peak_bytes <= room), None)

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
    asleep = f", less {gib(VLLM_ASLEEP)} vLLM keeps asleep" if worst.index in engines and not p.split else ""
    return (
        f"the trainer needs {gib(trainer.peak_bytes)} per GPU at {n} rank{'s' if n > 1 else ''} "
        f"({trainer.breakdown()}) but GPU {worst.index} has {gib(room)} for it ({gib(worst.free_bytes)} "
        f"free{asleep}); use " + " or ".join(fixes)
    )


def host_reason(host: int, ram: int, sleep_host: int, offload_host: int, *, sleep_weights: int) -> str:
    """Why collocation's ``host`` bytes of host RAM (``sleep_host`` for vLLM asleep, of which
    ``sleep_weights`` its weights at level 1; ``offload_host`` for the offloaded trainer) do not
    fit in ``ram``."""
    if sleep_weights and host - sleep_weights <= ram:
        fix = "--sleep-level 2 (vLLM discards its weights while asleep and gets them back from the trainer)"
    else:
        fix = "--placement split (nothing is offloaded) or a machine with more RAM"
    return (
        f"collocation needs {gib(host)} of host RAM ({gib(sleep_host)} vLLM asleep, {gib(offload_host)} "
        f"the offloaded trainer, {gib(HOST_BASE)} the appliance) but this machine has {gib(ram)}; "
        f"use {fix}"
    )
