"""LoRA weights -> plain weights: the full state dict of a peft model as the base model's.

Owns :func:`merge_lora`. The engine serving the policy is a plain HF model, so a LoRA-trained
policy is handed over merged: for every adapted linear layer ``W' = W + (alpha / r) * B @ A``
(peft's scaling without rsLoRA), under the base model's own parameter names. This is computed
from the gathered state dict, never in place on the training module (merging in place and
un-merging again would round the base weights). It does not own how adapters are added or
trained (verl's FSDP engine with ``HFModelConfig.lora_rank``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_PREFIX = re.compile(r"^(base_model\.model\.|base_model\.)")


def merge_lora(state: Mapping[str, torch.Tensor], *, alpha: float, rank: int) -> dict[str, torch.Tensor]:
    """``state`` (peft names, e.g. ``base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight``)
    with every ``lora_A``/``lora_B`` pair folded into its ``base_layer.weight``, named as in the
    base model (``model.layers.0.mlp.up_proj.weight``)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    scaling = alpha / rank
    merged: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            layer, kind = (
                (name.split(".lora_A.")[0], "A") if ".lora_A." in name else (name.split(".lora_B.")[0], "B")
            )
            adapters.setdefault(_PREFIX.sub("", layer), {})[kind] = tensor
        elif "lora_" in name:
            raise ValueError(f"cannot merge LoRA parameter {name!r} (only linear lora_A/lora_B adapters)")
        else:
            merged[_PREFIX.sub("", name).replace(".base_layer.", ".")] = tensor
    for layer, pair in adapters.items():
        key = f"{layer}.weight"
        if set(pair) != {"A", "B"} or key not in merged:
            raise ValueError(f"LoRA layer {layer!r} lacks its A/B pair or its base weight")
        base = merged[key]
        delta = pair["B"].float() @ pair["A"].float()
        merged[key] = (base.float() + scaling * delta).to(base.dtype)
    return merged
