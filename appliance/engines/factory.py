"""Choosing and building the engine a run serves with.

Owns the mapping from ``config.engine`` to an ``Engine`` implementation. The composition root
calls ``create_engine``; nothing else constructs engines for a real run.
"""

from __future__ import annotations

from pathlib import Path

from appliance.config import ENGINES, ApplianceConfig
from appliance.engines.base import Engine
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine

# Where vLLM's interpreter is looked up lives with the server's command line (``vllm_process``,
# light to import: ``lightning-appliance doctor`` uses it); re-exported here for callers.
from appliance.engines.vllm_process import PROJECT_ROOT as PROJECT_ROOT
from appliance.engines.vllm_process import vllm_python as vllm_python
from appliance.errors import ConfigError


def create_engine(config: ApplianceConfig, model_dir: Path) -> Engine:
    config = config.with_resolved_device()  # a config built without load_config may say "auto"
    if config.engine == "torch":
        return TorchEngine(
            model_dir, device=config.device, max_batch_size=config.max_batch_size, num_threads=config.threads
        )
    if config.engine == "vllm":
        return VLLMEngine(
            model_dir,
            python=vllm_python(config.vllm_python),
            port=config.vllm_port,
            base_url=config.vllm_url,
            device=config.device,
            max_batch_size=config.max_batch_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            max_model_len=config.vllm_max_model_len,
            cpu_kv_cache_gib=config.vllm_cpu_kv_cache_gib,
            logprobs_mode=vllm_logprobs_mode(config.temperature),
            log_path=config.data_dir / "logs" / "vllm.log",
            startup_timeout_s=config.vllm_startup_timeout_s,
            # A LoRA run pushes adapters alone: the server serves them on the base weights.
            lora_rank=config.lora_rank,
        )
    raise ConfigError(f"unknown engine {config.engine!r}; available: {', '.join(ENGINES)}")


def vllm_logprobs_mode(temperature: float | None) -> str:
    """Which log-probs vLLM reports: the trainer needs those of the tempered, untruncated policy.

    vLLM offers the raw distribution (exact at temperature 1, any top-p) or the processed one
    (tempered, but renormalised over the top-p nucleus: exact for any temperature at top_p 1).
    Training calls sample at the configured temperature, so: raw at 1 (or when the client's
    temperature is kept), processed otherwise.
    """
    return "raw_logprobs" if temperature is None or temperature == 1.0 else "processed_logprobs"
