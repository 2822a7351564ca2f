"""Serving a LoRA adapter that was pushed alone: its tensors, their checks, and how each engine
takes them.

Owns reading an adapter push out of its buckets (``collect_adapter``: a copy of each tensor, so
the bucket file can be overwritten; an adapter is small: rank x (in + out) per adapted layer),
checking it against the served model (``check_adapter``), serving it on a torch module
(``attach`` / ``detach``: a forward hook per adapted linear layer adding
``(alpha / rank) * B (A x)``, the computation peft's LoRA layer makes while training, so the
engine's log-probs are the trainer's), and the files vLLM loads an adapter from
(``write_peft_adapter``, ``vllm_max_lora_rank``). The wire format itself (``LoraAdapter``, entry
names) is ``trainer.buckets``'s; when to load what is the engines'.

Why adapters alone: a LoRA run never changes the base weights, so a push of a 7B model's
adapters (rank 16: ~40 MB) replaces a push of its merged weights (14 GB in bf16), and the
engine computes with exactly the base weights and adapters the trainer computes with, instead
of a merge rounded to the serving dtype.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from contracts.errors import BadRequest
from trainer.buckets import LoraAdapter, WeightBucket, adapter_pairs, bucket_tensors

#: The ranks vLLM accepts as ``--max-lora-rank`` (its ``MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Module attributes that hold a served adapter (non-persistent buffers: they follow the module
#: between devices and stay out of its state dict).
_A, _B = "appliance_lora_A", "appliance_lora_B"
_SCALING, _HOOK = "appliance_lora_scaling", "appliance_lora_hook"


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A whole adapter push, copied out of its buckets."""

    adapter: LoraAdapter
    #: Entry name (``<module>.lora_A.weight`` / ``.lora_B.weight``) -> tensor, in push order.
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _copy_bucket(bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.clone()) for name, tensor in bucket_tensors(bucket)]


async def collect_adapter(buckets: AsyncIterator[WeightBucket]) -> AdapterWeights:
    """Every bucket of an adapter push up to its last, copied (each in a worker thread). A
    ``BadRequest`` for a push that mixes adapters with whole weights or changes its adapter, names
    a tensor twice, or ends before its last bucket."""
    adapter: LoraAdapter | None = None
    tensors: dict[str, torch.Tensor] = {}
    async for bucket in buckets:
        if bucket.adapter is None or (adapter is not None and bucket.adapter != adapter):
            raise BadRequest(
                f"weight bucket {bucket.index} does not belong to the LoRA adapter push it came in"
            )
        adapter = bucket.adapter
        for name, tensor in await asyncio.to_thread(_copy_bucket, bucket):
            if name in tensors:
                raise BadRequest(f"the LoRA adapter push names {name!r} twice")
            tensors[name] = tensor
        if bucket.last:
            break
    else:
        raise BadRequest("the weight buckets ended before their last bucket")
    assert adapter is not None  # the loop ran at least once (it broke at a last bucket)
    return AdapterWeights(adapter, tensors)


def check_adapter(
    weights: AdapterWeights, linear_shapes: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted module, its (A, B); ``BadRequest`` unless every module is a linear layer of
    ``linear_shapes`` (module name -> (out_features, in_features)) and A is rank x in, B out x rank."""
    adapter = weights.adapter
    if adapter.rank < 1 or adapter.alpha <= 0:
        raise BadRequest(
            f"a LoRA adapter needs rank >= 1 and alpha > 0, got rank {adapter.rank}, alpha {adapter.alpha}"
        )
    try:
        pairs = adapter_pairs(weights.tensors)
    except ValueError as exc:
        raise BadRequest(f"the LoRA adapter push does not fit: {exc}") from None
    unknown = sorted(module for module in pairs if module not in linear_shapes)
    misshapen: list[str] = []
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a_name, b_name) in pairs.items():
        if module in unknown:
            continue
        a, b = weights.tensors[a_name], weights.tensors[b_name]
        rows, cols = linear_shapes[module]
        if tuple(a.shape) != (adapter.rank, cols) or tuple(b.shape) != (rows, adapter.rank):
            misshapen.append(module)
        out[module] = (a, b)
    if unknown or misshapen:
        raise BadRequest(
            "the LoRA adapter does not fit the served model: modules that are not its linear "
            f"layers {unknown[:5]}, wrong shapes for rank {adapter.rank} {sorted(misshapen)[:5]}"
        )
    if not out:
        raise BadRequest("the LoRA adapter push holds no adapter")
    return out


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``model``'s linear layers: module name -> (out_features, in_features)."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }


def _lora_forward(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    # As peft's Linear LoRA layer: result + lora_B(lora_A(x)) * scaling (no dropout when serving).
    a: torch.Tensor = getattr(module, _A)
    b: torch.Tensor = getattr(module, _B)
    scaling: float = getattr(module, _SCALING)
    x: torch.Tensor = args[0].to(a.dtype)
    delta = F.linear(F.linear(x, a), b) * scaling
    return output + delta.to(output.dtype)


def attach(
    model: nn.Module, adapter: LoraAdapter, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Serve ``pairs`` (checked by ``check_adapter``) on ``model``, replacing any adapter it had;
    each (A, B) is copied to its layer's device and dtype."""
    detach(model)
    for name, (a, b) in pairs.items():
        module = model.get_submodule(name)
        weight: torch.Tensor = module.get_parameter("weight")
        module.register_buffer(_A, a.to(device=weight.device, dtype=weight.dtype), persistent=False)
        module.register_buffer(_B, b.to(device=weight.device, dtype=weight.dtype), persistent=False)
        setattr(module, _SCALING, adapter.scaling)
        setattr(module, _HOOK, module.register_forward_hook(_lora_forward))


def detach(model: nn.Module) -> int:
    """Stop serving an adapter on ``model``; returns how many layers had one."""
    done = 0
    for module in model.modules():
        hook = getattr(module, _HOOK, None)
        if hook is None:
            continue
        hook.remove()
        for attr in (_A, _B, _SCALING, _HOOK):
            delattr(module, attr)
        done += 1
    return done


def served_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter ``model`` serves, named as a push names it (empty without one)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if getattr(module, _HOOK, None) is not None:
            out[f"{name}.lora_A.weight"] = getattr(module, _A)
            out[f"{name}.lora_B.weight"] = getattr(module, _B)
    return out


def write_peft_adapter(directory: Path, weights: AdapterWeights) -> Path:
    """``weights`` as a peft adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``, peft's names), which vLLM's ``/v1/load_lora_adapter`` reads."""
    directory.mkdir(parents=True)
    pairs = adapter_pairs(weights.tensors)
    tensors = {f"base_model.model.{name}": tensor.contiguous() for name, tensor in weights.tensors.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": weights.adapter.rank,
        "lora_alpha": weights.adapter.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        # Whole module names (as peft writes them for "all-linear"): exactly the adapted layers.
        "target_modules": sorted(pairs),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")
