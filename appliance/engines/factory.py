"""Choosing and building the engine a run serves with.

Owns the mapping from the config's ``engine`` section (``config.engine.kind``) to an ``Engine``
implementation, and with ``engine_replicas`` > 1 an ``EngineFleet`` of that many (each vLLM
replica with its own port, log file ``logs/vllm-<i>.log`` and, on GPUs, its own devices:
``replica_devices``). The composition root calls ``create_engine``; nothing else constructs
engines for a real run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance.config import ENGINES, ApplianceConfig
from appliance.engines.base import Engine
from appliance.engines.fleet import EngineFleet
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine

# Where vLLM's interpreter is looked up lives with the server's command line (``vllm_process``,
# light to import: ``lightning-appliance doctor`` uses it); re-exported here for callers.
from appliance.engines.vllm_process import PROJECT_ROOT as PROJECT_ROOT
from appliance.engines.vllm_process import vllm_python as vllm_python
from appliance.placement.memory_model import MAX_UTILIZATION
from contracts.errors import ConfigError


def create_engine(
    config: ApplianceConfig,
    model_dir: Path,
    replica_gpus: Sequence[Sequence[int]] | None = None,
    gpu_memory_utilization: float | None = None,
) -> Engine:
    """The engine ``config.engine`` asks for: one, or a fleet of ``engine_replicas``
    (``EngineFleet``). ``replica_gpus``: the GPUs of each replica as the placement plan gives them
    (CUDA's numbering in this process); None: replica i on GPUs [i * t, (i + 1) * t).
    ``gpu_memory_utilization``: the plan's share of each GPU for vLLM (used unless the config
    sets one; neither: vLLM's default 0.9)."""
    config = config.with_resolved_device()  # a config built without load_config may say "auto"
    if config.engine.kind not in ENGINES:
        raise ConfigError(f"unknown engine {config.engine.kind!r}; available: {', '.join(ENGINES)}")
    replicas = config.engine.engine_replicas
    if replica_gpus is not None and len(replica_gpus) != replicas:
        raise ConfigError(f"the placement gives GPUs for {len(replica_gpus)} replicas, not {replicas}")
    if replicas == 1:
        return _replica(config, model_dir, None, replica_gpus, gpu_memory_utilization)
    return EngineFleet(
        [_replica(config, model_dir, i, replica_gpus, gpu_memory_utilization) for i in range(replicas)]
    )


def create_fleet(
    config: ApplianceConfig,
    model_dir: Path,
    replica_gpus: Sequence[Sequence[int]] | None = None,
    gpu_memory_utilization: float | None = None,
) -> EngineFleet:
    """``create_engine``'s engine as a fleet (of one, where it is one engine), which remote
    replicas may join at run time: a replica may serve up to the run's staleness bound behind
    (``eta`` in async mode, else 0), and a remote one gets ``remote_deadline_s`` per update and
    ``remote_stall_s`` per token of a call."""
    config = config.with_resolved_device()
    engine = create_engine(config, model_dir, replica_gpus, gpu_memory_utilization)
    fleet = engine if isinstance(engine, EngineFleet) else EngineFleet([engine])
    fleet.max_staleness = config.scheduler.eta if config.scheduler.mode == "async" else 0
    fleet.remote_deadline_s = config.engine.remote_deadline_s
    fleet.remote_stall_s = config.engine.remote_stall_s
    return fleet


def remote_engine(
    config: ApplianceConfig, model_dir: Path, url: str, served_name: str, policy_version: int, **options: Any
) -> VLLMEngine:
    """The engine of a remote replica: attached to the vLLM server at ``url`` (which serves the
    run's model as ``served_name``), sampling as the local engines do; ``options`` go to
    ``VLLMEngine`` (how it takes weights)."""
    return VLLMEngine(
        model_dir,
        base_url=url,
        served_model_name=served_name,
        policy_version=policy_version,
        dtype=config.engine_dtype(),
        log_path=config.data_dir / "logs" / "vllm-remote.log",
        lora_rank=config.trainer.lora_rank,
        **options,
    )


def _replica(
    config: ApplianceConfig,
    model_dir: Path,
    index: int | None,
    replica_gpus: Sequence[Sequence[int]] | None,
    gpu_memory_utilization: float | None = None,
) -> Engine:
    """One engine; ``index`` is its place in a fleet (None: the only engine)."""
    engine = config.engine
    if engine.kind == "torch":
        # A fleet's torch replicas share this process and its device (tests; on CPU, its cores).
        return TorchEngine(
            model_dir, device=config.device, max_batch_size=engine.max_batch_size, num_threads=config.threads
        )
    suffix = "" if index is None else f"-{index}"
    devices = None
    if config.device != "cpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if replica_gpus is not None:
            devices = visible_ids(replica_gpus[index or 0], visible)
        elif index is not None:
            devices = replica_devices(index, engine.tensor_parallel_size, visible)
    return VLLMEngine(
        model_dir,
        python=vllm_python(engine.vllm_python),
        # A fixed port: replica i listens on port + i.
        port=engine.vllm_port + (index or 0) if engine.vllm_port else 0,
        base_url=engine.vllm_url,
        device=config.device,
        # The trainer's compute dtype: sampled log-probs are the ones it trains on.
        dtype=config.engine_dtype(),
        max_batch_size=engine.max_batch_size,
        gpu_memory_utilization=engine.gpu_memory_utilization or gpu_memory_utilization or MAX_UTILIZATION,
        tensor_parallel_size=engine.tensor_parallel_size,
        max_model_len=engine.vllm_max_model_len,
        cpu_kv_cache_gib=engine.vllm_cpu_kv_cache_gib,
        logprobs_mode=vllm_logprobs_mode(config.proxy.temperature),
        log_path=config.data_dir / "logs" / f"vllm{suffix}.log",
        startup_timeout_s=engine.vllm_startup_timeout_s,
        # A LoRA run pushes adapters alone: the server serves them on the base weights.
        lora_rank=config.trainer.lora_rank,
        visible_devices=devices,
        enforce_eager=engine.enforce_eager,
    )


def replica_devices(index: int, tensor_parallel_size: int, visible: str | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of vLLM replica ``index``: GPUs [index * t, (index + 1) * t)
    of those this process sees (``visible``: its own ``CUDA_VISIBLE_DEVICES``, if set; else
    every GPU, numbered from 0)."""
    t = tensor_parallel_size
    return visible_ids(range(index * t, (index + 1) * t), visible)


def visible_ids(gpus: Sequence[int], visible: str | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of a child process that should use ``gpus`` (CUDA's numbering
    in this process): the entries of ``visible`` (this process's ``CUDA_VISIBLE_DEVICES``: indices
    or UUIDs) at those positions, or the numbers themselves when it is not set."""
    if visible is None or not visible.strip():
        return ",".join(str(i) for i in gpus)
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    missing = [i for i in gpus if i >= len(ids)]
    if missing:
        raise ConfigError(
            f"GPUs {list(gpus)} are wanted but CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}; "
            "lower --engine-replicas or --tensor-parallel-size"
        )
    return ",".join(ids[i] for i in gpus)


def vllm_logprobs_mode(temperature: float | None) -> str:
    """Which log-probs vLLM reports: the trainer needs those of the tempered, untruncated policy.

    vLLM offers the raw distribution (exact at temperature 1, any top-k and top-p) or the
    processed one (tempered, but renormalised over what top-k and top-p keep: exact for any
    temperature at top_p 1 and top_k off).
    Training calls sample at the configured temperature, so: raw at 1 (or when the client's
    temperature is kept), processed otherwise.
    """
    return "raw_logprobs" if temperature is None or temperature == 1.0 else "processed_logprobs"
