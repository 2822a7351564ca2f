"""merge_lora: peft state dicts folded into the base model's weights, by hand."""

from __future__ import annotations

import pytest
import torch

from trainer.verl_lora import merge_lora


def test_adapters_are_folded_in_with_alpha_over_rank() -> None:
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    a = torch.tensor([[1.0, 2.0]])  # (r=1, in=2)
    b = torch.tensor([[0.5], [-1.0]])  # (out=2, r=1)
    state = {
        "base_model.model.model.embed_tokens.weight": torch.ones(3, 2),
        "base_model.model.model.layers.0.q_proj.base_layer.weight": w,
        "base_model.model.model.layers.0.q_proj.base_layer.bias": torch.tensor([0.1, 0.2]),
        "base_model.model.model.layers.0.q_proj.lora_A.default.weight": a,
        "base_model.model.model.layers.0.q_proj.lora_B.default.weight": b,
        "base_model.model.lm_head.weight": torch.ones(3, 2),
    }
    merged = merge_lora(state, alpha=4, rank=1)
    assert sorted(merged) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.q_proj.bias",
        "model.layers.0.q_proj.weight",
    ]
    # W + (4 / 1) * B @ A = I + 4 * [[0.5, 1], [-1, -2]]
    expected = torch.tensor([[3.0, 4.0], [-4.0, -7.0]])
    torch.testing.assert_close(merged["model.layers.0.q_proj.weight"], expected)
    assert torch.equal(merged["model.layers.0.q_proj.bias"], torch.tensor([0.1, 0.2]))


def test_incomplete_or_unknown_adapters_are_refused() -> None:
    with pytest.raises(ValueError, match="lacks its A/B pair"):
        merge_lora(
            {"m.q.base_layer.weight": torch.eye(2), "m.q.lora_A.default.weight": torch.ones(1, 2)},
            alpha=1,
            rank=1,
        )
    with pytest.raises(ValueError, match="only linear lora_A/lora_B"):
        merge_lora({"m.emb.lora_embedding_A.default": torch.ones(1, 2)}, alpha=1, rank=1)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        merge_lora({}, alpha=1, rank=0)
