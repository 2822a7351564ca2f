"""Constrained decoding through vLLM: the server enforces the same llguidance grammars as the
torch engine, and reports the log-probs of the same masked distribution."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from appliance.chat import constraints
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.tools import parse_assistant
from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams
from appliance.engines.constraints import Constraint, GrammarCompiler
from appliance.engines.torch_engine import TorchEngine
from appliance.engines.vllm_engine import VLLMEngine
from tests.appliance.engines.test_constraints import SCHEMA, TOOLS, conforms, replayed
from tests.appliance.engines.vllm_venv import VLLM_PYTHON, skip_without_vllm

skip_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

CONSTRAINTS = {
    "json_object": constraints.json_object(),
    "json_schema": constraints.json_schema(SCHEMA),
    "forced": constraints.tool_call(TOOLS, "echo"),
    "required": constraints.tool_call(TOOLS, None),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(
        tiny_model_dir,
        python=VLLM_PYTHON,
        max_batch_size=8,
        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    await engine.start()
    yield engine
    await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def torch_engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
    engine = TorchEngine(tiny_model_dir, max_batch_size=8)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nWhat is the result?<|im_end|>\n<|im_start|>assistant\n")


def request(
    prompt: list[int], tokenizer: Tokenizer, constraint: Constraint, **kwargs: Any
) -> GenerateRequest:
    fields: dict[str, Any] = {"max_tokens": 120, "stop_token_ids": (tokenizer.im_end_id,), "top_logprobs": 3}
    return GenerateRequest(
        prompt_ids=prompt, params=SamplingParams(**{**fields, **kwargs}, constraint=constraint)
    )


@pytest.mark.parametrize("name", list(CONSTRAINTS))
async def test_greedy_agrees_with_the_torch_engine(
    vllm: VLLMEngine, torch_engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer, name: str
) -> None:
    call = request(prompt, tokenizer, CONSTRAINTS[name], temperature=0.0)
    served, local = await vllm.generate(call), await torch_engine.generate(call)
    assert served.token_ids == local.token_ids
    assert served.finish_reason == local.finish_reason == "stop"
    assert served.logprobs == pytest.approx(local.logprobs, abs=1e-4)
    # Forbidden tokens (vLLM writes -9999 for their -inf) are no alternatives in either engine.
    assert [[t for t, _ in top] for top in served.top_logprobs] == [
        [t for t, _ in top] for top in local.top_logprobs
    ]


@pytest.mark.parametrize("name", ["json_schema", "forced"])
async def test_top_k_one_is_greedy_in_both_engines(
    vllm: VLLMEngine, torch_engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer, name: str
) -> None:
    """Top-k 1 at temperature 1 takes each engine's argmax of what the grammar allows (the cut
    never brings a forbidden token back), so both agree with greedy decoding and each other."""
    greedy = request(prompt, tokenizer, CONSTRAINTS[name], temperature=0.0)
    cut = request(prompt, tokenizer, CONSTRAINTS[name], temperature=1.0, top_k=1, seed=9)
    expected = await torch_engine.generate(greedy)
    for result in (await vllm.generate(cut), await torch_engine.generate(cut)):
        assert result.token_ids == expected.token_ids
        assert result.finish_reason == "stop"
        assert result.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


async def test_sampled_outputs_always_match(
    vllm: VLLMEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    forced = [request(prompt, tokenizer, CONSTRAINTS["forced"], temperature=1.0, seed=s) for s in range(12)]
    schema = [
        request(prompt, tokenizer, CONSTRAINTS["json_schema"], temperature=1.0, seed=s) for s in range(12)
    ]
    results: list[GenerateResult] = list(await asyncio.gather(*(vllm.generate(r) for r in forced + schema)))
    for result in results:
        assert result.finish_reason == "stop" and result.token_ids[-1] == tokenizer.im_end_id
    for result in results[: len(forced)]:
        message = parse_assistant(tokenizer.decode(result.token_ids[:-1]), {"add", "echo"})
        assert [call.name for call in message.tool_calls] == ["echo"]
    for result in results[len(forced) :]:
        assert conforms(json.loads(tokenizer.decode(result.token_ids[:-1])), SCHEMA)


async def test_reported_logprobs_are_of_the_masked_distribution(
    vllm: VLLMEngine, prompt: list[int], tokenizer: Tokenizer, tiny_model_dir: Path
) -> None:
    """In its default ``raw_logprobs`` mode vLLM reports log_softmax of the logits after the
    grammar's mask (the mask is applied before its sampler sees them): at temperature 1 that is
    exactly the distribution sampled from."""
    constraint = CONSTRAINTS["forced"]
    result = await vllm.generate(request(prompt, tokenizer, constraint, temperature=1.0, seed=4))
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    compiler = GrammarCompiler.from_model_dir(tiny_model_dir, tokenizer.vocab_size, tokenizer.im_end_id)
    masked, plain = replayed(model, compiler, constraint, prompt, result, 1.0, tokenizer.im_end_id)
    assert result.logprobs == pytest.approx(masked, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(result.logprobs, plain, strict=True)) > 0.1
