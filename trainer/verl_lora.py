"""LoRA weights -> plain weights: the full state dict of a peft model as the base model's.

Owns :func:`merge_lora` (a whole state dict) and :func:`merge_lora_stream` (the same, one layer
at a time, for an export that never holds the whole model), and :func:`adapter_name` (how a
push that carries only the adapters names them). Engines serve a LoRA-trained policy as their
base weights plus the adapters (pushed alone); an export, and the whole-weights path, hand it
over merged: for every adapted linear layer ``W' = W + (alpha / r) * B @ A`` (peft's scaling
without rsLoRA), under the base model's own parameter names. This is computed from the
gathered weights, never in place on the training module (merging in place and un-merging again
would round the base weights). It does not own how adapters are added or trained (verl's FSDP
engine with ``HFModelConfig.lora_rank``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

_PREFIX = re.compile(r"^(base_model\.model\.|base_model\.)")


def adapter_name(name: str) -> str:
    """A peft adapter parameter's name as a push names it: ``base_model.model.model.layers.0.mlp.
    up_proj.lora_A.default.weight`` -> ``model.layers.0.mlp.up_proj.lora_A.weight`` (the base
    model's module, see ``trainer.buckets.LoraAdapter``)."""
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}."
        if marker in name:
            module = _PREFIX.sub("", name.split(marker)[0])
            return f"{module}.{kind}.weight"
    raise ValueError(f"{name!r} is not a LoRA adapter parameter")


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


def merge_lora_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], *, alpha: float, rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merge_lora` over a stream of (peft name, tensor): each adapted layer is yielded
    merged once its base weight and both adapters have been seen (peft's state dict keeps the
    three together, so at most a layer or so is held), every other tensor as it comes."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    scaling = alpha / rank
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if ".lora_A." in name or ".lora_B." in name:
            kind = "A" if ".lora_A." in name else "B"
            layer = _PREFIX.sub("", name.split(f".lora_{kind}.")[0])
        elif "lora_" in name:
            raise ValueError(f"cannot merge LoRA parameter {name!r} (only linear lora_A/lora_B adapters)")
        elif ".base_layer." in name:
            layer, kind = _PREFIX.sub("", name.split(".base_layer.")[0]), "W"
            if not name.endswith(".base_layer.weight"):  # a bias of an adapted layer: as is
                yield _PREFIX.sub("", name).replace(".base_layer.", "."), tensor
                continue
        else:
            yield _PREFIX.sub("", name), tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[kind] = tensor
        if len(parts) == 3:
            del pending[layer]
            base = parts["W"]
            delta = parts["B"].float() @ parts["A"].float()
            yield f"{layer}.weight", (base.float() + scaling * delta).to(base.dtype)
    if pending:
        raise ValueError(f"LoRA layers {sorted(pending)[:3]} lack their A/B pair or their base weight")
