"""Constrained decoding in the torch engine: the random tiny model at temperature 1 only ever
writes what the grammar allows, and reports the log-probs of the masked distribution."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from appliance.chat import constraints
from appliance.chat.tokenizer import Tokenizer
from appliance.chat.tools import parse_assistant
from appliance.engines.base import GenerateRequest, GenerateResult, SamplingParams, validate_request
from appliance.engines.constraints import Constraint, GrammarCompiler
from appliance.engines.torch_engine import TorchEngine
from contracts.errors import BadRequest

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "s": {"enum": ["x", "y"]},
        "t": {"type": "string", "maxLength": 4},
    },
    "required": ["n", "s", "t"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 999, "minimum": 0}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "maxLength": 6}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    },
]
SEEDS = range(24)


def conforms(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether ``value`` matches ``schema``, for the few keywords these tests' schemas use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", math.inf)
    if kind == "object":
        properties = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(key in value for key in schema.get("required", ()))
            and (schema.get("additionalProperties", True) is not False or set(value) <= set(properties))
            and all(conforms(value[key], sub) for key, sub in properties.items() if key in value)
        )
    raise AssertionError(f"conforms() does not know {schema}")


@pytest_asyncio.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
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


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def params(tokenizer: Tokenizer, constraint: Constraint | None, **kwargs: Any) -> SamplingParams:
    fields: dict[str, Any] = {"max_tokens": 120, "temperature": 1.0, "stop_token_ids": (tokenizer.im_end_id,)}
    return SamplingParams(**{**fields, **kwargs}, constraint=constraint)


async def sample(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer, constraint: Constraint, **kwargs: Any
) -> list[GenerateResult]:
    """One completion per seed, all in flight together."""
    requests = [
        GenerateRequest(prompt_ids=prompt, params=params(tokenizer, constraint, seed=seed, **kwargs))
        for seed in SEEDS
    ]
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


def text_of(tokenizer: Tokenizer, result: GenerateResult) -> str:
    assert result.finish_reason == "stop", tokenizer.decode(result.token_ids)
    assert result.token_ids[-1] == tokenizer.im_end_id
    return tokenizer.decode(result.token_ids[:-1])


async def test_json_object_is_always_json(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    results = await sample(engine, prompt, tokenizer, constraints.json_object(), max_tokens=60)
    finished = [r for r in results if r.finish_reason == "stop"]
    assert len(finished) >= len(results) // 2
    for result in finished:
        assert isinstance(json.loads(text_of(tokenizer, result)), dict)
    for result in results:  # one cut by max_tokens is still the start of an object
        assert tokenizer.decode(result.token_ids).startswith("{")


async def test_json_schema_is_always_valid(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    for result in await sample(engine, prompt, tokenizer, constraints.json_schema(SCHEMA), top_p=0.9):
        assert conforms(json.loads(text_of(tokenizer, result)), SCHEMA)


async def test_a_forced_tool_is_always_called(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    for result in await sample(engine, prompt, tokenizer, constraints.tool_call(TOOLS, "echo")):
        message = parse_assistant(text_of(tokenizer, result), {"add", "echo"})
        assert [call.name for call in message.tool_calls] == ["echo"]
        assert len(json.loads(message.tool_calls[0].arguments)["text"]) <= 6


async def test_required_tools_are_called(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    names: list[str] = []
    for result in await sample(engine, prompt, tokenizer, constraints.tool_call(TOOLS, None), max_tokens=200):
        if result.finish_reason == "stop":
            message = parse_assistant(text_of(tokenizer, result), {"add", "echo"})
            assert message.tool_calls and message.content == ""
            names += [call.name for call in message.tool_calls]
    assert set(names) == {"add", "echo"}


async def test_greedy_decoding_is_constrained_too(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    constraint = constraints.tool_call(TOOLS, "add")
    result = await engine.generate(
        GenerateRequest(prompt_ids=prompt, params=params(tokenizer, constraint, temperature=0.0))
    )
    message = parse_assistant(text_of(tokenizer, result), {"add", "echo"})
    assert [call.name for call in message.tool_calls] == ["add"]


async def test_a_finished_grammar_forces_the_stop(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    constraint = Constraint("json_schema", 'start: "yes" | "no"')
    for result in await sample(engine, prompt, tokenizer, constraint, top_logprobs=3):
        assert text_of(tokenizer, result) in ("yes", "no")
        # The stop id was the only token left: probability 1, and no alternatives.
        assert result.logprobs[-1] == 0.0
        assert result.top_logprobs[-1] == ((tokenizer.im_end_id, 0.0),)


def replayed(
    model: Any,
    compiler: GrammarCompiler,
    constraint: Constraint,
    prompt: Sequence[int],
    result: GenerateResult,
    temperature: float,
    stop: int,
) -> tuple[list[float], list[float]]:
    """Per sampled token, log-softmax of the teacher-forced logits masked by the grammar (at
    ``temperature``, 1 for greedy), and the same unmasked."""
    completion = list(result.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *completion]])).logits[0, len(prompt) - 1 : -1].float()
    guide = compiler.guide(constraint, [stop])
    masked: list[float] = []
    for position, token in enumerate(completion):
        allowed = guide.allowed()
        row = logits[position] / (temperature or 1.0)
        masked.append(float(torch.log_softmax(row.masked_fill(~allowed, float("-inf")), -1)[token]))
        guide.consume(token)
    plain = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, torch.tensor(completion)[:, None])
    return masked, plain.squeeze(1).tolist()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
async def test_logprobs_are_of_the_masked_distribution(
    engine: TorchEngine,
    prompt: list[int],
    tokenizer: Tokenizer,
    reference_model: Any,
    tiny_model_dir: Path,
    temperature: float,
    top_p: float,
) -> None:
    constraint = constraints.tool_call(TOOLS, "echo")
    compiler = GrammarCompiler.from_model_dir(tiny_model_dir, tokenizer.vocab_size, tokenizer.im_end_id)
    request = params(tokenizer, constraint, temperature=temperature, top_p=top_p, seed=5)
    result = await engine.generate(GenerateRequest(prompt_ids=prompt, params=request))
    masked, plain = replayed(
        reference_model, compiler, constraint, prompt, result, temperature, tokenizer.im_end_id
    )
    assert result.logprobs == pytest.approx(masked, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(result.logprobs, plain, strict=True)) > 0.1  # the mask mattered


async def test_unconstrained_rows_in_the_same_batch_are_unaffected(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    free = GenerateRequest(
        prompt_ids=prompt, params=params(tokenizer, None, seed=11, max_tokens=24, top_logprobs=2)
    )
    alone = await engine.generate(free)
    bound = GenerateRequest(prompt_ids=prompt, params=params(tokenizer, constraints.json_object(), seed=11))
    together, constrained = await asyncio.gather(engine.generate(free), engine.generate(bound))
    assert together.token_ids == alone.token_ids
    assert together.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert [[t for t, _ in top] for top in together.top_logprobs] == [
        [t for t, _ in top] for top in alone.top_logprobs
    ]
    assert tokenizer.decode(constrained.token_ids).startswith("{")
    assert not tokenizer.decode(together.token_ids).startswith("{")


async def test_a_grammar_the_vocabulary_cannot_spell_fails_alone(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    # Compiles without a vocabulary, but the tiny tokenizer has no <nope> token.
    bad = GenerateRequest(
        prompt_ids=prompt, params=params(tokenizer, Constraint("tool_call", 'start: <nope> "x"'))
    )
    good = GenerateRequest(prompt_ids=prompt, params=params(tokenizer, None, max_tokens=4))
    failed, served = await asyncio.gather(engine.generate(bad), engine.generate(good), return_exceptions=True)
    assert isinstance(failed, BadRequest) and failed.param == "response_format"
    assert isinstance(served, GenerateResult)


async def test_a_constrained_request_needs_a_stop_id_it_can_sample(
    engine: TorchEngine, prompt: list[int], tokenizer: Tokenizer
) -> None:
    request = params(tokenizer, constraints.json_object(), stop_token_ids=(-1,))
    with pytest.raises(BadRequest) as caught:
        await engine.generate(GenerateRequest(prompt_ids=prompt, params=request))
    assert caught.value.param == "response_format"


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", "start: nothing_defined"),
        Constraint("json_schema", 'start: %json {"type": "no-such-type"}'),
        Constraint("xml", 'start: "a"'),
        Constraint("json_object", " "),
        {"kind": "json_object", "grammar": 'start: "a"'},
    ],
)
def test_validation_refuses_constraints_that_cannot_be_enforced(constraint: Any) -> None:
    request = GenerateRequest(prompt_ids=[1, 2], params=SamplingParams(constraint=constraint))
    with pytest.raises(BadRequest) as caught:
        validate_request(request, max_context=1024, vocab_size=1002)
    assert caught.value.param == "response_format"


def test_recorded_params_round_trip() -> None:
    constrained = SamplingParams(
        max_tokens=7, stop_token_ids=(2, 5), seed=3, constraint=constraints.json_object()
    )
    for original in (constrained, SamplingParams()):
        record = json.loads(json.dumps(dataclasses.asdict(original)))
        assert SamplingParams.from_record(record) == original
    assert SamplingParams.from_record({"temperature": 0.5, "a_later_field": 1}) == SamplingParams(
        temperature=0.5
    )
