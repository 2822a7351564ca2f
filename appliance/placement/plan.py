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

This module owns :func:`plan`, the package's entry, and the settings of a config
(:func:`settings_from_config`). What the plan is asked (``Machine``, ``PlacementSettings``) is
``appliance.placement.inputs``'s, the ``Plan`` it makes ``appliance.placement.decision``'s, the
decision ``appliance.placement.planner``'s, the reasons' words and fixes
``appliance.placement.fixes``'s, the plan's lines ``appliance.placement.text``'s; ``plan`` is
the package's face, so those names are importable from here too (for ``up`` and ``plan``).

It owns no memory figure (``appliance.placement.memory_model``), probes nothing
(``appliance.placement.machine`` reads this machine and model directories), refuses nothing
(``appliance.operations.preflight`` does) and starts nothing: putting engines and trainer ranks
on the planned GPUs is the engines' and the trainer's business. Invariant: the replicas' GPUs
are disjoint, and in split placement disjoint from the trainer's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from appliance.placement.decision import Plan
from appliance.placement.inputs import Gpu, Machine, PlacementSettings
from appliance.placement.memory_model import GIB, ModelSpec
from appliance.placement.planner import Planner
from appliance.placement.text import describe

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig

__all__ = ["Gpu", "Machine", "PlacementSettings", "Plan", "describe", "plan", "settings_from_config"]


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
