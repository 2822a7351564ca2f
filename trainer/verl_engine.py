"""verl's FSDP engine as the verl backend uses it: built once, its tensors read out whole.

Owns :func:`build_engine` (one ``FSDPEngineWithLMHead`` on FSDP2 from a model directory, with
verl's construction output sent to the debug log and LoRA's initialization seeded alike on every
rank) and the readers of its module's state: :func:`unique_state` (each tensor once, sharded as
it is), :func:`full_tensors` (whole, all-gathered over the ranks) and :func:`adapter_tensors`
(the LoRA adapters alone, named for the engine). It does not own the step, the checkpoints nor
what the weights become for the engine (``trainer.verl_backend``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.verl_lora import adapter_name

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """verl prints progress (memory, model size) and warns about engines it cannot import while
    an engine is built; that goes to the debug log instead of the appliance's output. (Both
    redirections are process-wide, so this wraps only engine construction, done once at start.)"""
    buffer = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer):
            warnings.simplefilter("ignore")
            yield
    finally:
        if buffer.getvalue():
            log.debug("verl: %s", buffer.getvalue().strip())


def build_engine(model_dir: Path, *, lr: float, weight_decay: float, grad_clip: float, **kw: Any) -> Any:
    """One verl ``FSDPEngineWithLMHead``, initialized. ``kw``: lora_rank, lora_alpha,
    param_dtype, gradient_checkpointing, remove_padding, max_token_len, param_offload."""
    with _quiet():
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        model_config = HFModelConfig(
            path=str(model_dir),
            load_tokenizer=False,
            override_config={"attn_implementation": "sdpa"},
            use_remove_padding=kw["remove_padding"],
            enable_gradient_checkpointing=kw["gradient_checkpointing"],
            lora_rank=kw["lora_rank"],
            lora_alpha=kw["lora_alpha"],
            target_modules="all-linear",
        )
        dtype = kw["param_dtype"]
        engine_config = FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",  # master weights; compute dtype is the mixed-precision policy's
            mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=kw["max_token_len"],
            infer_max_token_len_per_gpu=kw["max_token_len"],
            param_offload=kw["param_offload"],
            optimizer_offload=kw["param_offload"],
        )
        optimizer_config = FSDPOptimizerConfig(
            lr=lr, weight_decay=weight_decay, clip_grad=grad_clip, total_training_steps=1
        )
        engine: Any = FSDPEngineWithLMHead(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=CheckpointConfig(),
        )
        # The same random initialization (LoRA's A matrices) in every process and on every rank:
        # seeded, without disturbing the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            engine.initialize()
    return engine


def unique_state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's state dict (sharded DTensors as they are), each tensor once under its
    first name: tied embeddings share one."""
    seen: set[int] = set()
    for name, value in module.state_dict().items():
        if id(value) not in seen:
            seen.add(id(value))
            yield name, value


def _whole(value: torch.Tensor, world_size: int) -> torch.Tensor:
    """``value`` whole, detached: a sharded parameter all-gathered over the ranks (at world size 1
    the local shard is the whole tensor and nothing is gathered)."""
    if isinstance(value, DTensor):
        value = value.to_local() if world_size == 1 else value.full_tensor()
    return value.detach()


def full_tensors(module: torch.nn.Module, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors, whole, the module's own names, read where the parameters are
    (no onload: an offloaded trainer is read from host memory); tensors that share storage
    (tied embeddings) come once, under their first name.

    A collective at world size > 1: every rank must iterate it to the end, in step (each
    sharded parameter is all-gathered in turn).
    """
    for name, value in unique_state(module):
        yield name, _whole(value, world_size)


def adapter_tensors(module: torch.nn.Module, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA adapters, whole, named for the engine (``<module>.lora_A.weight``, see
    ``trainer.buckets.LoraAdapter``); base weights are neither read nor gathered.
    A collective at world size > 1 (each adapter is all-gathered in turn)."""
    for name, value in unique_state(module):
        if ".lora_A." in name or ".lora_B." in name:
            yield adapter_name(name), _whole(value, world_size)
